"""The handler's own socket: what the proxy asks (stats, expansion, sandbox
liveness) and the local sandbox control used by `crust sandbox`."""

from __future__ import annotations

from crust.api import handler_pb2, handler_pb2_grpc
from crust.common import csi_input
from crust.common.errors import FailedPrecondition
from crust.runtime_handler.handler import RuntimeHandler, State
from crust.sys import blockdev


class HandlerService(handler_pb2_grpc.HandlerServicer):
    def __init__(self, handler: RuntimeHandler):
        self.handler = handler

    async def GetVolumeStats(self, request: handler_pb2.GetVolumeStatsRequest, context):
        sandbox, volume = self.handler.find(csi_input.required(request.target_path, "target_path"),
                                            csi_input.required(request.sandbox_id, "sandbox_id"))
        stats = await sandbox.stats(volume.mount_point, volume.readonly)
        return handler_pb2.GetVolumeStatsResponse(usage=stats.usage, volume_condition=stats.condition)

    async def ExpandVolume(self, request: handler_pb2.ExpandVolumeRequest, context):
        sandbox, volume = self.handler.find(csi_input.required(request.target_path, "target_path"),
                                            csi_input.required(request.sandbox_id, "sandbox_id"))
        wanted = request.capacity_range.required_bytes if request.HasField("capacity_range") else 0
        size = blockdev.size_bytes(volume.device)
        if wanted > size:
            # The file system can only grow to what the device holds: the
            # device is grown first (by the driver), then the handler is asked.
            raise FailedPrecondition(f"capacity_range.required_bytes {wanted} is more than the {size} bytes of "
                                     f"{volume.device}: grow the device first")
        with self.handler.inflight.hold(request.target_path):
            await sandbox.grow(volume.fs_type, volume.device, volume.mount_point)
        return handler_pb2.ExpandVolumeResponse(capacity_bytes=blockdev.size_bytes(volume.device))

    async def GetSandbox(self, request, context):
        entry = self.handler.sandboxes.get(request.sandbox_id)
        if entry is None:
            return handler_pb2.GetSandboxResponse(state=State.GONE)
        return handler_pb2.GetSandboxResponse(state=State.RUNNING if entry[0].alive() else State.STOPPED)


class SandboxControlService(handler_pb2_grpc.SandboxControlServicer):
    def __init__(self, handler: RuntimeHandler):
        self.handler = handler

    async def RunSandbox(self, request: handler_pb2.RunSandboxRequest, context):
        record = await self.handler.run_sandbox(csi_input.required(request.bundle, "bundle"),
                                                csi_input.required(request.sandbox_id, "sandbox_id"))
        sandbox, record = self.handler.sandboxes[record.sandbox_id]
        return handler_pb2.RunSandboxResponse(sandbox=self.handler.info(sandbox, record))

    async def DeleteSandbox(self, request, context):
        await self.handler.delete_sandbox(csi_input.required(request.sandbox_id, "sandbox_id"))
        return handler_pb2.DeleteSandboxResponse()

    async def ListSandboxes(self, request, context):
        return handler_pb2.ListSandboxesResponse(sandboxes=[
            self.handler.info(s, r) for s, r in sorted(self.handler.sandboxes.values(), key=lambda e: e[1].sandbox_id)
        ])
