"""Controller side of the shim: capability translation and snapshot freezes.

CreateVolume, ValidateVolumeCapabilities, ControllerPublishVolume and
GetCapacity carry volume capabilities; the shim rewrites mount capabilities
to block ones so the backend provisions and attaches a raw block volume.
CreateSnapshot and CreateVolumeGroupSnapshot freeze the deferred source
volumes in their sandboxes around the backend's call (crust.csi_shim.freeze).
Every other Controller RPC passes through untouched (crust.csi_shim.passthrough).
"""

from __future__ import annotations

from crust.api import csi_pb2
from crust.contract import encryption, freeze_policy
from crust.csi_shim import freeze
from crust.csi_shim.backend import Backend
from crust.csi_shim.translate import caps_to_block, to_block
from crust.sys import fs


# StorageClass parameters meant for crust itself (the proxy's deferral policy
# reads them from volume_context). The backend never sees them: any driver
# may reject parameters it does not know.
CRUST_PARAMETER_PREFIX = "crust.dev/"


def _room_for_luks2_header(request: csi_pb2.CreateVolumeRequest, forwarded: csi_pb2.CreateVolumeRequest,
                           integrity: str) -> None:
    """The guest makes the file system inside the LUKS2 volume, after its
    header (and beside dm-integrity's tags): a volume asked for at a file
    system's minimum (xfs: 300 MiB) gets that room on top, or the guest's
    mkfs would refuse it. The backend only sees block capabilities, so it
    cannot know."""
    fs_types = {c.mount.fs_type for c in request.volume_capabilities if c.HasField("mount")}
    fs_types.add(request.parameters.get("fsType", ""))
    inside = max(fs.MIN_SIZE.get(t, 0) for t in fs_types)
    floor = inside + encryption.room_inside(inside, integrity)
    if forwarded.capacity_range.required_bytes < floor and \
            not (forwarded.capacity_range.limit_bytes and forwarded.capacity_range.limit_bytes < floor):
        forwarded.capacity_range.required_bytes = floor


class ControllerShim:
    def __init__(self, backend: Backend, freezer: freeze.SnapshotFreezer):
        self.backend = backend
        self.freezer = freezer

    async def CreateSnapshot(self, request: csi_pb2.CreateSnapshotRequest, context):
        mode = freeze.mode_of(request.parameters)
        forwarded = csi_pb2.CreateSnapshotRequest()
        forwarded.CopyFrom(request)
        freeze.without_ours(request.parameters, forwarded.parameters)
        async with self.freezer.frozen([request.source_volume_id] if request.source_volume_id else [], mode,
                                       request.name):
            return await self.backend.call(self.backend.controller.CreateSnapshot, forwarded, context)

    async def CreateVolumeGroupSnapshot(self, request: csi_pb2.CreateVolumeGroupSnapshotRequest, context):
        mode = freeze.mode_of(request.parameters)
        forwarded = csi_pb2.CreateVolumeGroupSnapshotRequest()
        forwarded.CopyFrom(request)
        freeze.without_ours(request.parameters, forwarded.parameters)
        async with self.freezer.frozen([v for v in request.source_volume_ids if v], mode, request.name):
            return await self.backend.call(self.backend.group_controller.CreateVolumeGroupSnapshot, forwarded,
                                           context)

    async def CreateVolume(self, request: csi_pb2.CreateVolumeRequest, context):
        forwarded = csi_pb2.CreateVolumeRequest()
        forwarded.CopyFrom(request)
        del forwarded.volume_capabilities[:]
        forwarded.volume_capabilities.extend(caps_to_block(request.volume_capabilities))
        ours = {k: v for k, v in request.parameters.items() if k.startswith(CRUST_PARAMETER_PREFIX)}
        # An unknown value is refused before anything is made.
        integrity = encryption.integrity_of(ours, "parameters")
        freeze_policy.of(ours, "parameters")
        if encryption.of_context(ours, "parameters"):
            _room_for_luks2_header(request, forwarded, integrity)
        for key in ours:
            del forwarded.parameters[key]
        response = await self.backend.call(self.backend.controller.CreateVolume, forwarded, context)
        # The CO keeps volume_context with the volume and passes it to every
        # NodeStage/NodePublish, where the proxy's policy can see it.
        response.volume.volume_context.update(ours)
        return response

    async def ValidateVolumeCapabilities(self, request: csi_pb2.ValidateVolumeCapabilitiesRequest, context):
        forwarded = csi_pb2.ValidateVolumeCapabilitiesRequest()
        forwarded.CopyFrom(request)
        del forwarded.volume_capabilities[:]
        forwarded.volume_capabilities.extend(caps_to_block(request.volume_capabilities))
        response = await self.backend.call(self.backend.controller.ValidateVolumeCapabilities, forwarded, context)
        if response.HasField("confirmed"):
            # Confirm what the CO asked for, not the translation.
            del response.confirmed.volume_capabilities[:]
            response.confirmed.volume_capabilities.extend(request.volume_capabilities)
        return response

    async def ControllerPublishVolume(self, request: csi_pb2.ControllerPublishVolumeRequest, context):
        forwarded = csi_pb2.ControllerPublishVolumeRequest()
        forwarded.CopyFrom(request)
        if request.HasField("volume_capability"):
            forwarded.volume_capability.CopyFrom(to_block(request.volume_capability))
        return await self.backend.call(self.backend.controller.ControllerPublishVolume, forwarded, context)

    async def GetCapacity(self, request: csi_pb2.GetCapacityRequest, context):
        forwarded = csi_pb2.GetCapacityRequest()
        forwarded.CopyFrom(request)
        del forwarded.volume_capabilities[:]
        forwarded.volume_capabilities.extend(caps_to_block(request.volume_capabilities))
        return await self.backend.call(self.backend.controller.GetCapacity, forwarded, context)


METHODS = {
    "CreateVolume": (csi_pb2.CreateVolumeRequest, csi_pb2.CreateVolumeResponse),
    "ValidateVolumeCapabilities": (csi_pb2.ValidateVolumeCapabilitiesRequest,
                                   csi_pb2.ValidateVolumeCapabilitiesResponse),
    "ControllerPublishVolume": (csi_pb2.ControllerPublishVolumeRequest, csi_pb2.ControllerPublishVolumeResponse),
    "GetCapacity": (csi_pb2.GetCapacityRequest, csi_pb2.GetCapacityResponse),
    "CreateSnapshot": (csi_pb2.CreateSnapshotRequest, csi_pb2.CreateSnapshotResponse),
}

GROUP_METHODS = {
    "CreateVolumeGroupSnapshot": (csi_pb2.CreateVolumeGroupSnapshotRequest,
                                  csi_pb2.CreateVolumeGroupSnapshotResponse),
}
