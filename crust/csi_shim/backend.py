"""The shim's view of the CSI driver it wraps.

It learns the backend's capabilities once at start and relies only on the
CSI spec, so any driver that serves raw block volumes can sit behind it.
"""

from __future__ import annotations

import logging

import grpc

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common.channel import local_aio_channel
from crust.common.errors import Forwarded
from crust.csi_shim.passthrough import forward_timeout, forwardable_metadata

log = logging.getLogger(__name__)

NodeRPC = csi_pb2.NodeServiceCapability.RPC


class Backend:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.channel = local_aio_channel(endpoint)
        self.identity = csi_pb2_grpc.IdentityStub(self.channel)
        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
        self.group_controller = csi_pb2_grpc.GroupControllerStub(self.channel)
        self.node = csi_pb2_grpc.NodeStub(self.channel)
        self.node_capabilities: set[int] = set()
        self.plugin_name = ""

    async def learn(self, timeout: float = 30.0) -> None:
        """Wait for the backend to answer, then read its name and node capabilities."""
        info = await self.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=timeout,
                                                 wait_for_ready=True)
        self.plugin_name = info.name
        try:
            caps = await self.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=timeout)
            self.node_capabilities = {c.rpc.type for c in caps.capabilities if c.HasField("rpc")}
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self.node_capabilities = set()  # a controller-only backend
        log.info("backend learned", extra={"fields": {
            "backend": self.plugin_name,
            "node_capabilities": sorted(NodeRPC.Type.Name(c) for c in self.node_capabilities
                                        if c in NodeRPC.Type.values())}})

    @property
    def stages(self) -> bool:
        return NodeRPC.STAGE_UNSTAGE_VOLUME in self.node_capabilities

    @property
    def expands(self) -> bool:
        return NodeRPC.EXPAND_VOLUME in self.node_capabilities

    async def call(self, method, request, context: grpc.aio.ServicerContext | None, metadata=None):
        """Call the backend with the caller's deadline and metadata; its errors
        come back unchanged (status code and message)."""
        timeout = forward_timeout(context) if context is not None else 60.0
        md = forwardable_metadata(context) if context is not None else metadata
        try:
            return await method(request, timeout=timeout, metadata=md)
        except grpc.aio.AioRpcError as exc:
            raise Forwarded.from_rpc_error(exc) from None

    async def close(self) -> None:
        await self.channel.close()
