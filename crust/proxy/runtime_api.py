"""The Runtime API (KEP-2857) the shim calls for deferred volumes."""

from __future__ import annotations

from crust.api import csi_pb2, runtime_pb2, runtime_pb2_grpc
from crust.common import csi_input
from crust.common.errors import FailedPrecondition, InvalidArgument, NotFound
from crust.contract import device as device_identity
from crust.contract import encryption, freeze_policy
from crust.contract.mountinfo import FS_GROUP, FS_GROUP_CHANGE_POLICY, MountInfo
from crust.proxy.paths import check_target
from crust.proxy.routing import Router
from crust.proxy.state import ProxyState
from crust.sys import freeze as sysfreeze
from crust.sys import fs

Req = runtime_pb2.RuntimeStageVolumeRequest
POLICY_NAMES = {Req.ALWAYS: "Always", Req.ON_ROOT_MISMATCH: "OnRootMismatch"}


class RuntimeService(runtime_pb2_grpc.RuntimeServicer):
    def __init__(self, state: ProxyState, router: Router):
        self.state = state
        self.router = router

    def _target(self, value: str) -> str:
        return check_target(value, self.state.config.kubelet_root, "volume_target_path")

    def _volume(self, target: str):
        volume = self.state.get(target)
        if volume is None:
            raise NotFound(f"no deferred volume is published at {target}")
        return volume

    async def RuntimeStageVolume(self, request: runtime_pb2.RuntimeStageVolumeRequest, context):
        target = self._target(request.volume_target_path)
        if request.volume_type != Req.BLOCK:
            raise InvalidArgument("volume_type must be BLOCK (network volumes are not served)")
        device = csi_input.path(request.volume_backing_path, "volume_backing_path")
        if request.fs_type not in fs.SUPPORTED:
            raise InvalidArgument(f"fs_type {request.fs_type!r} is not supported; use one of {', '.join(fs.SUPPORTED)}")
        csi_input.mount_flags(list(request.mount_flags), "mount_flags")
        metadata = {}
        if request.volume_supplemental_group:
            if not request.volume_supplemental_group.isdigit():
                raise InvalidArgument("volume_supplemental_group must be a numeric group id")
            metadata[FS_GROUP] = request.volume_supplemental_group
        if request.volume_supplemental_group_change_policy in POLICY_NAMES:
            metadata[FS_GROUP_CHANGE_POLICY] = POLICY_NAMES[request.volume_supplemental_group_change_policy]
        major, minor = device_identity.handed_over(device, request.device_major, request.device_minor,
                                                   target_path=target, source="RuntimeStageVolume")
        published = self.state.get(target)
        decision = self.state.decision(target)
        if published is not None and decision is not None and decision.deferred and \
                (published.info.device, published.info.device_major, published.info.device_minor) != \
                (device, major, minor):
            # kubelet published this target through the proxy: its device is
            # the one the CSI plugin returned, and only kubelet changes it.
            raise device_identity.refuse(
                f"volume_target_path {target} was published by kubelet with device {published.info.device} "
                f"({published.info.device_major}:{published.info.device_minor}); the Runtime API cannot point "
                f"it at {device} ({major}:{minor})", target_path=target, device=device)
        if encryption.of_context(request.volume_context):
            raise FailedPrecondition(
                f"{target} is an encrypted volume ({encryption.PARAMETER}): RuntimeStageVolume carries no secret, "
                "so its key would never reach a sandbox; publish it through the proxy's CSI endpoint")
        info = MountInfo(device=device, fstype=request.fs_type, metadata=metadata,
                         options=list(request.mount_flags), readonly=request.readonly,
                         volume_id=request.volume_id, target_path=target, capacity_bytes=request.capacity_bytes,
                         device_major=major, device_minor=minor,
                         volume_context=dict(request.volume_context))
        await self.state.stage(info)
        return runtime_pb2.RuntimeStageVolumeResponse()

    async def RuntimeUnstageVolume(self, request, context):
        target = self._target(request.volume_target_path)
        await self.state.unstage(target)
        return runtime_pb2.RuntimeUnstageVolumeResponse()

    async def RuntimeGetVolumeStats(self, request, context):
        volume = self._volume(self._target(request.volume_target_path))
        return await self.router.stats(volume, context)

    async def RuntimeExpandVolume(self, request: runtime_pb2.RuntimeExpandVolumeRequest, context):
        volume = self._volume(self._target(request.volume_target_path))
        rng = request.capacity_range if request.HasField("capacity_range") else csi_pb2.CapacityRange()
        capacity = await self.router.expand(volume, rng, context)
        return runtime_pb2.RuntimeExpandVolumeResponse(capacity_bytes=capacity)

    async def RuntimeFreezeVolume(self, request: runtime_pb2.RuntimeFreezeVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        try:
            timeout = sysfreeze.timeout_of(request.timeout_seconds, "timeout_seconds")
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if request.policy and request.policy not in freeze_policy.MODES:
            raise InvalidArgument(f"policy must be one of {', '.join(freeze_policy.MODES)} or empty, "
                                  f"not {request.policy!r}")
        return runtime_pb2.RuntimeFreezeVolumeResponse(
            frozen=await self.router.freeze(volume_id, timeout, request.policy, context))

    async def RuntimeThawVolume(self, request: runtime_pb2.RuntimeThawVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        return runtime_pb2.RuntimeThawVolumeResponse(
            thawed=await self.router.thaw(volume_id, set(request.volume_target_paths), context))
