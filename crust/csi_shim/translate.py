"""Capability translation: what the CO asks as a file system, the backend
serves as a raw block device. The file system type and mount flags stay on
the shim's side (kubelet sends them again at stage and publish time)."""

from __future__ import annotations

from crust.api import csi_pb2


def to_block(cap: csi_pb2.VolumeCapability) -> csi_pb2.VolumeCapability:
    if not cap.HasField("mount"):
        return cap
    block = csi_pb2.VolumeCapability()
    block.CopyFrom(cap)
    block.ClearField("mount")
    block.block.SetInParent()
    return block


def caps_to_block(caps) -> list[csi_pb2.VolumeCapability]:
    return [to_block(c) for c in caps]
