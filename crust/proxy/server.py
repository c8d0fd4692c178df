"""`crust proxy`: the host daemon next to kubelet.

Two unix sockets in one process:
- the CSI endpoint kubelet talks to (forwarding to the plugin, deciding and
  recording deferral, staging returned descriptions);
- the runtime endpoint: the KEP's Runtime API (called by the shim) and the
  handler registry (called by runtime handlers), created 0600 inside a
  0700 directory (or 0660/0750 for a configured group); every caller is
  named by the kernel (crust.common.peergate) and must be an allowed uid,
  or have the configured group as its effective gid.
Plus a periodic sweep and Prometheus metrics on a loopback port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat

import grpc

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import REGISTRY

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from crust.common import metrics
from crust.common.endpoint import clear_stale_socket, socket_path
from crust.common.grpcserver import Daemon, unary_handlers
from crust.common.peergate import PeerPolicy
from crust.common.private import make_dirs
from crust.csi_shim.backend import Backend
from crust.csi_shim.passthrough import Passthrough
from crust.proxy import csi_frontend
from crust.proxy.config import ProxyConfig
from crust.proxy.kube import PodLookup
from crust.proxy.kubelet_registration import KubeletRegistration, registration_socket
from crust.proxy.policy import Decider
from crust.proxy.registry import RegistryService
from crust.proxy.routing import Router
from crust.proxy.runtime_api import RuntimeService
from crust.proxy.state import ProxyState

log = logging.getLogger(__name__)


def prepare_runtime_socket_dir(config: ProxyConfig) -> None:
    """The runtime socket lives in a directory only its users can enter."""
    path = socket_path(config.runtime_endpoint)
    parent = os.path.dirname(path)
    allowed = 0o750 if config.runtime_socket_group is not None else 0o700
    if not os.path.exists(parent):
        make_dirs(parent)
    if config.runtime_socket_group is not None:
        os.chown(parent, 0, config.runtime_socket_group)
        os.chmod(parent, 0o750)
    mode = stat.S_IMODE(os.stat(parent).st_mode)
    if mode & ~allowed:
        raise SystemExit(f"crust proxy: the directory of the runtime socket, {parent}, is mode {mode:o}; it must "
                         f"be {allowed:o} or stricter so no other user can reach the registry")


class HandlerLeaseCollector:
    """Seconds since each registered handler's last heartbeat, at each scrape."""

    def __init__(self, state: ProxyState):
        self.state = state

    def collect(self):
        age = GaugeMetricFamily("crust_proxy_handler_lease_age_seconds",
                                "Seconds since a runtime handler's last heartbeat", labels=["handler"])
        for handler in sorted(self.state.handlers.values(), key=lambda h: h.name):
            age.add_metric([handler.name], handler.lease_age())
        yield age


class Proxy:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.state = ProxyState(config)
        self.router = Router(self.state)
        self.plugin = Backend(config.plugin_endpoint)
        pods = PodLookup(config.policy.kubernetes) if config.policy.deferral.runtime_classes or \
            config.policy.deferral.fs_group_from_pod else None
        self.frontend = csi_frontend.CsiFrontend(self.state, self.plugin, Decider(config.policy.deferral, pods),
                                                 self.router)
        self.csi = Daemon("proxy-csi", config.csi_endpoint, [])
        self.passthrough: Passthrough | None = None
        self.runtime = Daemon("proxy-runtime", config.runtime_endpoint, [
            runtime_pb2.DESCRIPTOR.services_by_name["Runtime"].full_name,
            registry_pb2.DESCRIPTOR.services_by_name["Registry"].full_name,
        ], socket_mode=0o660 if config.runtime_socket_group is not None else 0o600,
            socket_group=config.runtime_socket_group,
            peer_policy=PeerPolicy(config.runtime_allowed_uids,
                                   [config.runtime_socket_group] if config.runtime_socket_group is not None else []))
        self.sweeper: asyncio.Task | None = None
        self.registration: KubeletRegistration | None = None

    async def node_status(self) -> registry_pb2.GetNodeStatusResponse:
        """Kubelet's registration and the health of the proxy and its plugin."""
        response = registry_pb2.GetNodeStatusResponse(components=[
            registry_pb2.ComponentHealth(name="proxy", endpoint=self.config.csi_endpoint, status="SERVING")])
        if self.registration is not None:
            response.kubelet_registration.CopyFrom(self.registration.message())
        plugin = registry_pb2.ComponentHealth(name=f"plugin ({self.plugin.plugin_name})",
                                              endpoint=self.config.plugin_endpoint)
        try:
            # Probe passes through the shim to the driver: the whole chain answers.
            probe = await self.plugin.identity.Probe(csi_pb2.ProbeRequest(), timeout=2)
            ready = not probe.HasField("ready") or probe.ready.value
            plugin.status = "SERVING" if ready else "NOT_SERVING"
            plugin.detail = "" if ready else "Probe: not ready"
        except grpc.aio.AioRpcError as exc:
            plugin.status, plugin.detail = "UNREACHABLE", f"{exc.code().name}: {exc.details()}"
        response.components.append(plugin)
        return response

    async def start(self) -> None:
        make_dirs(self.config.state_dir)
        prepare_runtime_socket_dir(self.config)
        await self.state.reconcile()
        # The runtime side first: the shim may call it as soon as kubelet can
        # reach the CSI side.
        runtime_pb2_grpc.add_RuntimeServicer_to_server(RuntimeService(self.state, self.router), self.runtime.server)
        registry_pb2_grpc.add_RegistryServicer_to_server(RegistryService(self.state, self.node_status),
                                                         self.runtime.server)
        await self.runtime.start()
        await self.plugin.learn()
        if self.config.kubelet_registration_dir is not None:
            await self._check_registration_free()
        self.csi.server.add_generic_rpc_handlers((
            unary_handlers("csi.v1.Node", self.frontend, csi_frontend.METHODS),))
        self.passthrough = Passthrough(self.plugin.channel)
        self.csi.fallback_handlers.append(self.passthrough)
        await self.csi.start()
        if self.config.kubelet_registration_dir is not None:
            # Last: kubelet may call CSI as soon as it has registered us.
            self.registration = KubeletRegistration(
                self.config.kubelet_registration_dir, self.plugin.plugin_name,
                self.config.kubelet_registration_path or socket_path(self.config.csi_endpoint),
                health=[self.csi.health, self.runtime.health])
            await self.registration.start()
        if self.config.metrics_port:
            REGISTRY.register(HandlerLeaseCollector(self.state))
            metrics.serve(self.config.metrics_port, self.config.metrics_address)
        self.sweeper = asyncio.create_task(self._sweep_forever())

    async def _check_registration_free(self) -> None:
        """Refuse to start, with a clear message, when another server (a
        node-driver-registrar) already serves this driver's registration."""
        path = registration_socket(self.config.kubelet_registration_dir, self.plugin.plugin_name)
        try:
            clear_stale_socket(str(path))
        except RuntimeError as exc:
            await self.runtime.stop(0)
            raise SystemExit(f"crust proxy: cannot serve kubelet's registration: {exc}. Is a "
                             "node-driver-registrar registering this driver? Use one or the other: drop "
                             "--kubelet-registration-dir (kubeletRegistration.enabled: false) to keep it") from None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_seconds)
            try:
                removed = await self.state.sweep()
                if removed:
                    log.info("sweep removed entries", extra={"fields": {"removed": removed}})
            except Exception:  # noqa: BLE001 - the sweep must outlive one bad entry
                log.exception("sweep failed")

    async def stop(self, grace: float = 5.0) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()
        if self.registration is not None:
            # First: kubelet deregisters the driver instead of calling a
            # socket that is about to go away.
            await self.registration.stop()
        await self.csi.stop(grace)
        await self.runtime.stop(grace)
        await self.router.close()
        if self.passthrough is not None:
            self.passthrough.close()
        await self.plugin.close()

    async def run(self) -> None:
        await self.start()
        self.runtime.install_signal_handlers()  # one signal stops both sockets
        await self.runtime.stopping.wait()
        await self.stop()


def serve(config: ProxyConfig) -> None:
    async def main() -> None:
        await Proxy(config).run()

    asyncio.run(main())
