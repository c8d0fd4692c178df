"""Staying registered with the proxy: register, heartbeat, register again
after the proxy restarted (it answers a heartbeat with NOT_FOUND), and claim
or release volumes."""

from __future__ import annotations

import asyncio
import logging

import grpc

from crust.api import registry_pb2, registry_pb2_grpc
from crust.common.channel import local_aio_channel
from crust.common.errors import Forwarded

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, proxy_endpoint: str, name: str, endpoint: str, filesystems: list[str], features: list[str]):
        self.name = name
        self.endpoint = endpoint
        self.filesystems = filesystems
        self.features = features
        self.channel = local_aio_channel(proxy_endpoint)
        self.stub = registry_pb2_grpc.RegistryStub(self.channel)
        self.lease_id = ""
        self.lease_seconds = 15
        self.registered = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.on_register = None  # async callback after each (re-)registration

    async def register(self) -> None:
        rsp = await self.stub.RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name=self.name, endpoint=self.endpoint, filesystems=self.filesystems, features=self.features),
            timeout=5)
        self.lease_id, self.lease_seconds = rsp.lease_id, rsp.lease_seconds
        self.registered.set()
        log.info("registered with the proxy", extra={"fields": {"handler": self.name, "lease_s": rsp.lease_seconds}})
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
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.info("the proxy forgot us (restarted?): registering again")
                    self.registered.clear()
                    continue
                log.warning("proxy unreachable", extra={"fields": {"error": exc.code().name}})
                self.registered.clear()
            await asyncio.sleep(max(0.2, self.lease_seconds / 3))

    def start(self) -> None:
        self.task = asyncio.create_task(self.keep_alive())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        try:
            if self.lease_id:
                await self.stub.UnregisterHandler(registry_pb2.UnregisterHandlerRequest(
                    name=self.name, lease_id=self.lease_id), timeout=2)
        except grpc.aio.AioRpcError:
            pass
        await self.channel.close()

    async def claim(self, target_path: str, sandbox_id: str, sandbox_pid: int) -> str:
        try:
            rsp = await self.stub.ClaimVolume(registry_pb2.ClaimVolumeRequest(
                target_path=target_path, handler=self.name, sandbox_id=sandbox_id, sandbox_pid=sandbox_pid),
                timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise Forwarded.from_rpc_error(exc) from None
        return rsp.mount_info_json

    async def release(self, target_path: str, sandbox_id: str, abnormal_reason: str = "") -> None:
        try:
            await self.stub.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(
                target_path=target_path, handler=self.name, sandbox_id=sandbox_id,
                abnormal_reason=abnormal_reason), timeout=10)
        except grpc.aio.AioRpcError as exc:
            raise Forwarded.from_rpc_error(exc) from None
