"""Kubelet's plugin registration, served by the proxy itself.

Kubelet finds CSI drivers by watching its plugins_registry directory for unix
sockets: it dials each new one, asks GetInfo, registers the driver under the
name it got and from then on sends every CSI call to the endpoint it got;
finally it tells the plugin the outcome with NotifyRegistrationStatus.

The proxy answers GetInfo with the name of the plugin behind it (so kubelet
registers the driver the StorageClass and PVs name) and the proxy's own CSI
socket as the endpoint (so kubelet talks to the proxy, never past it). The
socket is `<dir>/<driver name>-reg.sock`, the name the upstream
node-driver-registrar uses, so one replaces the other without leftovers.

Kubelet's restart can wipe the directory, and an operator may delete the
socket by hand: the socket is checked once a second (one lstat; it also
survives the removal of the directory itself, which an inotify watch on it
would not) and bound again when it is gone. A clean stop removes it, so
kubelet deregisters the driver instead of dialling a dead socket.

Kubelet does not ask again after refusing a plugin (say, NodeGetInfo failed
while the driver was still starting) until the socket changes; the upstream
registrar exits so that its restart makes a new socket. The proxy makes a
new socket itself after a refusal, with a backoff (5 s doubling to 5 min), so
kubelet retries while the refusal stays visible in `crust status`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from crust.api import pluginregistration_pb2, pluginregistration_pb2_grpc, registry_pb2
from crust.common.grpcserver import CrustInterceptor, bind_unix

log = logging.getLogger(__name__)

CSI_PLUGIN = "CSIPlugin"
# The CSI spec's major version 1; kubelet picks the highest it supports.
SUPPORTED_VERSIONS = ("1.0.0",)
SERVICE_NAME = pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"].full_name
CHECK_SECONDS = 1.0
RETRY_FIRST_SECONDS = 5.0
RETRY_MAX_SECONDS = 300.0


def registration_socket(directory: Path, driver_name: str) -> Path:
    return directory / f"{driver_name}-reg.sock"


@dataclass
class RegistrationState:
    """What kubelet said last; shown by `crust status` and the health service."""

    info_at: float | None = None
    verdict_at: float | None = None
    registered: bool = False
    # Kubelet's last refusal, kept until it registers the driver.
    error: str = ""
    recreated: int = 0
    retry_at: float | None = None
    retry_backoff: float = 0.0

    @property
    def state(self) -> str:
        if self.verdict_at is None:
            return "waiting"
        return "registered" if self.registered else "refused"


class RegistrationService(pluginregistration_pb2_grpc.RegistrationServicer):
    def __init__(self, owner: "KubeletRegistration"):
        self.owner = owner

    async def GetInfo(self, request, context):
        self.owner.state.info_at = time.monotonic()
        return pluginregistration_pb2.PluginInfo(
            type=CSI_PLUGIN, name=self.owner.driver_name, endpoint=self.owner.endpoint_path,
            supported_versions=list(SUPPORTED_VERSIONS))

    async def NotifyRegistrationStatus(self, request: pluginregistration_pb2.RegistrationStatus, context):
        await self.owner.verdict(request.plugin_registered, request.error)
        return pluginregistration_pb2.RegistrationStatusResponse()


class KubeletRegistration:
    """The registration socket in kubelet's plugins_registry directory.

    health: the health servicers whose `pluginregistration.Registration`
    entry follows kubelet's verdict (NOT_SERVING after a refusal)."""

    def __init__(self, directory: Path, driver_name: str, endpoint_path: str, health=()):
        self.directory = directory
        self.driver_name = driver_name
        self.endpoint_path = endpoint_path
        self.health = list(health)
        self.socket = registration_socket(directory, driver_name)
        self.state = RegistrationState()
        self._server: grpc.aio.Server | None = None
        self._inode: int | None = None
        self._watcher: asyncio.Task | None = None

    async def _bind(self) -> None:
        server = grpc.aio.server(interceptors=[CrustInterceptor("kubelet-registration")])
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(RegistrationService(self), server)
        bind_unix(server, str(self.socket))
        await server.start()
        self._server = server
        self._inode = os.lstat(self.socket).st_ino

    async def start(self) -> None:
        await self._bind()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._watcher = asyncio.create_task(self._keep_socket())
        log.info("serving kubelet plugin registration", extra={"fields": {
            "socket": str(self.socket), "driver": self.driver_name, "endpoint": self.endpoint_path}})

    def _socket_is_ours(self) -> bool:
        try:
            return os.lstat(self.socket).st_ino == self._inode
        except FileNotFoundError:
            return False

    async def _keep_socket(self) -> None:
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            retry = self.state.retry_at is not None and time.monotonic() >= self.state.retry_at
            if self._socket_is_ours() and not retry:
                continue
            if retry:
                log.info("making the registration socket again so kubelet retries after its refusal",
                         extra={"fields": {"socket": str(self.socket)}})
                self.state.retry_at = None
            else:
                log.warning("the registration socket is gone (kubelet restarted or it was deleted); binding it again",
                            extra={"fields": {"socket": str(self.socket)}})
            old, self._server = self._server, None
            if old is not None:
                await old.stop(0)
            if self._socket_is_ours():
                os.unlink(self.socket)
            try:
                await self._bind()
            except (OSError, RuntimeError) as exc:
                # Another server holds the name (a node-driver-registrar?):
                # say so and try again; never take a live socket away.
                log.error("cannot bind the registration socket", extra={"fields": {"error": str(exc)}})
                continue
            # A new socket means a new registration: kubelet's next verdict
            # is about it, not the one before.
            self.state.recreated += 1
            self.state.verdict_at, self.state.registered = None, False

    async def verdict(self, registered: bool, error: str) -> None:
        s = self.state
        s.verdict_at, s.registered = time.monotonic(), registered
        if registered:
            s.error, s.retry_at, s.retry_backoff = "", None, 0.0
            log.info("kubelet registered the driver", extra={"fields": {"driver": self.driver_name}})
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        else:
            s.error = error or "kubelet refused the plugin without a reason"
            s.retry_backoff = min(s.retry_backoff * 2, RETRY_MAX_SECONDS) if s.retry_backoff else RETRY_FIRST_SECONDS
            s.retry_at = time.monotonic() + s.retry_backoff
            log.error("kubelet refused the driver", extra={"fields": {
                "driver": self.driver_name, "error": error, "retry_in_seconds": s.retry_backoff}})
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_health(self, status) -> None:
        for servicer in self.health:
            result = servicer.set(SERVICE_NAME, status)
            if asyncio.iscoroutine(result):
                await result

    def message(self) -> registry_pb2.KubeletRegistration:
        now = time.monotonic()
        s = self.state
        return registry_pb2.KubeletRegistration(
            socket=str(self.socket), driver_name=self.driver_name, endpoint=self.endpoint_path, state=s.state,
            error=s.error, info_age_seconds=now - s.info_at if s.info_at is not None else -1,
            verdict_age_seconds=now - s.verdict_at if s.verdict_at is not None else -1,
            socket_recreated=s.recreated)

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._server is not None:
            await self._server.stop(0)
            self._server = None
        # Only our own socket: a registrar that took the name over keeps it.
        if self._socket_is_ours():
            os.unlink(self.socket)
        log.info("kubelet registration socket removed", extra={"fields": {"socket": str(self.socket)}})
