"""The handler's own socket: what the proxy asks (stats, expansion, sandbox
liveness) and the local sandbox control used by `crust sandbox`."""

from __future__ import annotations

from crust.api import handler_pb2, handler_pb2_grpc
from crust.common import csi_input
from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.runtime_handler.containers import ContainerVolumes
from crust.runtime_handler.handler import RuntimeHandler, State
from crust.sys import blockdev
from crust.sys import freeze as sysfreeze


class HandlerService(handler_pb2_grpc.HandlerServicer):
    """Sandboxes are the handler's own, or (with crust's OCI runtime) pods
    whose containers runc runs: a sandbox id the handler did not make names
    a pod, answered from its containers' records."""

    def __init__(self, handler: RuntimeHandler):
        self.handler = handler

    def _container(self, target_path: str, sandbox_id: str):
        containers = self.handler.containers
        if sandbox_id in self.handler.sandboxes or containers is None:
            return None
        return containers.find(target_path, sandbox_id)

    async def GetVolumeStats(self, request: handler_pb2.GetVolumeStatsRequest, context):
        target_path = csi_input.required(request.target_path, "target_path")
        sandbox_id = csi_input.required(request.sandbox_id, "sandbox_id")
        in_container = self._container(target_path, sandbox_id)
        if in_container is not None:
            stats = await self.handler.containers.stats(*in_container)
        else:
            sandbox, volume = self.handler.find(target_path, sandbox_id)
            stats = await sandbox.stats(volume.mount_point, volume.readonly, volume.device)
        return handler_pb2.GetVolumeStatsResponse(usage=stats.usage, volume_condition=stats.condition)

    async def ExpandVolume(self, request: handler_pb2.ExpandVolumeRequest, context):
        target_path = csi_input.required(request.target_path, "target_path")
        sandbox_id = csi_input.required(request.sandbox_id, "sandbox_id")
        in_container = self._container(target_path, sandbox_id)
        if in_container is None:
            sandbox, volume = self.handler.find(target_path, sandbox_id)
        device = in_container[1].device if in_container is not None else volume.device
        wanted = request.capacity_range.required_bytes if request.HasField("capacity_range") else 0
        size = blockdev.size_bytes(device)
        if wanted > size:
            # The file system can only grow to what the device holds: the
            # device is grown first (by the driver), then the handler is asked.
            raise FailedPrecondition(f"capacity_range.required_bytes {wanted} is more than the {size} bytes of "
                                     f"{device}: grow the device first")
        with self.handler.inflight.hold(target_path):
            if in_container is not None:
                await self.handler.containers.expand(*in_container)
            else:
                await sandbox.grow(volume.fs_type, volume.device, volume.mount_point, volume.encrypted_name)
        return handler_pb2.ExpandVolumeResponse(capacity_bytes=blockdev.size_bytes(device))

    async def FreezeVolume(self, request: handler_pb2.FreezeVolumeRequest, context):
        target_path = csi_input.required(request.target_path, "target_path")
        sandbox_id = csi_input.required(request.sandbox_id, "sandbox_id")
        try:
            timeout = sysfreeze.timeout_of(request.timeout_seconds, "timeout_seconds")
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        in_container = self._container(target_path, sandbox_id)
        if in_container is not None:
            depth = await self.handler.containers.freeze(*in_container, timeout)
        else:
            sandbox, volume = self.handler.find(target_path, sandbox_id)
            depth = await sandbox.freeze(volume.mount_point, timeout)
        return handler_pb2.FreezeVolumeResponse(depth=depth)

    async def ThawVolume(self, request: handler_pb2.ThawVolumeRequest, context):
        target_path = csi_input.required(request.target_path, "target_path")
        sandbox_id = csi_input.required(request.sandbox_id, "sandbox_id")
        if sandbox_id not in self.handler.sandboxes and self.handler.containers is not None:
            # Thawed by target: the container that was frozen may be gone.
            depth, was_frozen = await self.handler.containers.freezer.thaw(target_path)
        else:
            sandbox, volume = self.handler.find(target_path, sandbox_id)
            depth, was_frozen = await sandbox.thaw(volume.mount_point)
        return handler_pb2.ThawVolumeResponse(depth=depth, was_frozen=was_frozen)

    async def GetSandbox(self, request, context):
        entry = self.handler.sandboxes.get(request.sandbox_id)
        if entry is None:
            containers = self.handler.containers
            if containers is None:
                return handler_pb2.GetSandboxResponse(state=State.GONE)
            # The pod's containers that are over let go of their volumes
            # first, so the answer and the claims agree.
            await containers.release_exited(request.sandbox_id)
            if containers.alive(request.sandbox_id):
                return handler_pb2.GetSandboxResponse(state=State.RUNNING)
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


class ContainerVolumesService(handler_pb2_grpc.ContainerVolumesServicer):
    """What crust's OCI runtime asks (crust.runtime_handler.containers)."""

    def __init__(self, containers: ContainerVolumes):
        self.containers = containers

    async def PrepareContainer(self, request: handler_pb2.PrepareContainerRequest, context):
        mounts = await self.containers.prepare(
            csi_input.required(request.container_id, "container_id"),
            csi_input.required(request.sandbox_id, "sandbox_id"), request.bundle, list(request.mounts),
            request.runtime_pid)
        return handler_pb2.PrepareContainerResponse(mounts=[self.containers.describe(m) for m in mounts])

    async def PrepareBundle(self, request: handler_pb2.PrepareBundleRequest, context):
        log_flags = {flag: value for flag, value in (("--log", request.log_path),
                                                     ("--log-format", request.log_format)) if value}
        mounts = await self.containers.prepare_bundle(
            csi_input.required(request.container_id, "container_id"), csi_input.required(request.bundle, "bundle"),
            request.runtime_pid, csi_input.required(request.state_dir, "state_dir"), log_flags)
        return handler_pb2.PrepareContainerResponse(mounts=[self.containers.describe(m) for m in mounts])

    async def ContainerCreated(self, request: handler_pb2.ContainerCreatedRequest, context):
        await self.containers.created(csi_input.required(request.container_id, "container_id"), request.pid)
        return handler_pb2.ContainerCreatedResponse()

    async def ReleaseContainer(self, request: handler_pb2.ReleaseContainerRequest, context):
        await self.containers.release(csi_input.required(request.container_id, "container_id"))
        return handler_pb2.ReleaseContainerResponse()

    async def ListContainers(self, request, context):
        return handler_pb2.ListContainersResponse(containers=[
            self.containers.info(r) for r in sorted(self.containers.containers.values(),
                                                    key=lambda r: r.container_id)])
