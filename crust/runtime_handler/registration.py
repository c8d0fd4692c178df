"""Staying registered with the proxy: register, heartbeat, register again
after the proxy forgot us, and claim or release volumes.

The lease the proxy returns is the handler's identity: every call in the
handler's name carries it, and the proxy keeps a name for the lease that
registered it while that lease lives. It is a bearer secret, so it is never
logged. With a lease file (in the handler's state directory, 0600), a
restarted handler presents its lease again and gets its name, and the
claims its surviving sandboxes hold, back at once; without one it waits
until its old lease expires.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc

from crust.api import registry_pb2, registry_pb2_grpc
from crust.common.atomicfile import write_atomic
from crust.common.channel import local_aio_channel
from crust.common.errors import Forwarded, NoSpace, Unavailable
from crust.common.saferead import read_bounded
from crust.contract import encryption

log = logging.getLogger(__name__)

MAX_LEASE_BYTES = 256


def read_lease(path: Path | None) -> str:
    """The lease kept at path ('' when there is none, or it is not a small
    regular file that only its owner can read)."""
    if path is None:
        return ""
    try:
        if os.lstat(path).st_mode & 0o077:
            log.warning("ignoring a lease file others can read", extra={"fields": {"path": str(path)}})
            return ""
        lease = read_bounded(path, MAX_LEASE_BYTES).decode("ascii", "replace").strip()
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as exc:
        log.warning("ignoring an unreadable lease file", extra={"fields": {"path": str(path), "error": str(exc)}})
        return ""
    return lease if lease.isalnum() else ""


class Registration:
    def __init__(self, proxy_endpoint: str, name: str, endpoint: str, filesystems: list[str], features: list[str],
                 lease_file: Path | None = None):
        self.name = name
        self.endpoint = endpoint
        self.filesystems = filesystems
        self.features = features
        self.channel = local_aio_channel(proxy_endpoint)
        self.stub = registry_pb2_grpc.RegistryStub(self.channel)
        self.lease_file = lease_file
        self.lease_id = read_lease(lease_file)
        self.lease_seconds = 15
        self.registered = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.on_register = None  # async callback after each (re-)registration
        self._lease_unsaved = False

    def _keep_lease(self, lease: str) -> None:
        if self.lease_file is None or lease == read_lease(self.lease_file):
            return
        try:
            write_atomic(self.lease_file, lease.encode(), mode=0o600)
            self._lease_unsaved = False
        except NoSpace as exc:
            # Registered all the same (the lease is held in memory and kept
            # alive); written at a later heartbeat once there is room.
            self._lease_unsaved = True
            log.warning("the lease could not be kept on disk yet", extra={"fields": {"error": exc.message}})

    async def wait_registered(self, what: str, timeout: float = 10.0) -> None:
        """Until the proxy knows this handler (what claims a volume needs);
        Unavailable, naming `what`, when it does not within timeout (the
        proxy down or restarting): the caller's request may be retried."""
        try:
            await asyncio.wait_for(self.registered.wait(), timeout)
        except TimeoutError:
            raise Unavailable(f"{what}: handler {self.name} is not registered with the proxy "
                              f"(within {timeout:.0f} s); retry") from None

    async def register(self) -> None:
        rsp = await self.stub.RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name=self.name, endpoint=self.endpoint, filesystems=self.filesystems, features=self.features,
            lease_id=self.lease_id), timeout=5)
        renewed = bool(self.lease_id) and rsp.lease_id == self.lease_id
        self.lease_id, self.lease_seconds = rsp.lease_id, rsp.lease_seconds
        await asyncio.to_thread(self._keep_lease, rsp.lease_id)
        self.registered.set()
        log.info("registered with the proxy", extra={"fields": {
            "handler": self.name, "lease_s": rsp.lease_seconds, "lease": "kept" if renewed else "new"}})
        if self.on_register is not None:
            await self.on_register()

    async def keep_alive(self) -> None:
        while True:
            try:
                if not self.registered.is_set():
                    await self.register()
                else:
                    await self.stub.Heartbeat(registry_pb2.HeartbeatRequest(
                        name=self.name, lease_id=self.lease_id), timeout=5)
                    if self._lease_unsaved:  # a full disk refused it at the registration
                        await asyncio.to_thread(self._keep_lease, self.lease_id)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.NOT_FOUND:
                    log.info("the proxy forgot us: registering again")
                    self.registered.clear()
                    continue
                if code == grpc.StatusCode.PERMISSION_DENIED:
                    # Our lease lapsed and another handler holds the name now.
                    log.error("the proxy gave our name to another lease", extra={"fields": {
                        "handler": self.name, "error": exc.details()}})
                    self.lease_id = ""
                    self.registered.clear()
                elif code == grpc.StatusCode.ALREADY_EXISTS:
                    log.error("our name is held by another live handler", extra={"fields": {
                        "handler": self.name, "error": exc.details()}})
                    self.registered.clear()
                else:
                    log.warning("proxy unreachable", extra={"fields": {"error": code.name}})
                    self.registered.clear()
            await asyncio.sleep(max(0.2, self.lease_seconds / 3))

    def start(self) -> None:
        self.task = asyncio.create_task(self.keep_alive())

    async def stop(self, unregister: bool = True) -> None:
        """Stop renewing. With unregister (no sandbox of ours is left), the
        name is given up and the lease file removed; without, the lease is
        kept for the next start, whose sandboxes' claims it holds."""
        if self.task is not None:
            self.task.cancel()
        if unregister and self.lease_id:
            try:
                await self.stub.UnregisterHandler(registry_pb2.UnregisterHandlerRequest(
                    name=self.name, lease_id=self.lease_id), timeout=2)
                if self.lease_file is not None:
                    self.lease_file.unlink(missing_ok=True)
            except grpc.aio.AioRpcError:
                pass
        await self.channel.close()

    async def claim(self, target_path: str, sandbox_id: str, sandbox_pid: int) -> str:
        answer, passphrase = await self.claim_keyed(target_path, sandbox_id, sandbox_pid)
        encryption.wipe(passphrase)
        return answer

    async def claim_keyed(self, target_path: str, sandbox_id: str,
                          sandbox_pid: int) -> tuple[str, bytearray | None]:
        """The claim's description, and an encrypted volume's passphrase
        when the proxy handed it (the caller wipes it once used)."""
        try:
            rsp = await self.stub.ClaimVolume(registry_pb2.ClaimVolumeRequest(
                target_path=target_path, handler=self.name, sandbox_id=sandbox_id, sandbox_pid=sandbox_pid,
                lease_id=self.lease_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise Forwarded.from_rpc_error(exc) from None
        answer = rsp.mount_info_json
        passphrase = bytearray(rsp.volume_passphrase) if rsp.volume_passphrase else None
        rsp.Clear()  # the message's own copy is freed now, not with the call's frame
        return answer, passphrase

    async def release(self, target_path: str, sandbox_id: str, abnormal_reason: str = "") -> None:
        try:
            await self.stub.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(
                target_path=target_path, handler=self.name, sandbox_id=sandbox_id,
                abnormal_reason=abnormal_reason, lease_id=self.lease_id), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise Forwarded.from_rpc_error(exc) from None
