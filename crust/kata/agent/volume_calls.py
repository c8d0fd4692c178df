"""A pod's volumes through the guest's agent (specs/agent.proto's volume
calls): mounted, measured, grown and unmounted by the guest's kernel, each
named by the handler's key for it (the last component of its mount point,
<workdir>/volumes/<key>). A volume the agent does not know is told to the
caller (None, False).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Protocol

from crust.api import agent_pb2, csi_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc
from crust.kata.agent import checked_numbers
from crust.kata.agent.client import AgentClient, handler_error
from crust.runtime_handler.sandbox import VolumeStats

Usage = csi_pb2.VolumeUsage
# The longest a mount waits for its disk in the guest (a hot-plug is seen
# within a second when the host is not starved of CPU).
MOUNT_TIMEOUT = 60.0
# Under the proxy's 10 s per handler call: a guest too slow to answer is
# a volume condition, not a failed call.
STATS_TIMEOUT = 5.0
GROW_TIMEOUT = 120.0
UNMOUNT_TIMEOUT = 60.0
OPEN_TIMEOUT = 180.0
# A freeze syncs the file system first: under the proxy's 10 s per handler call.
FREEZE_TIMEOUT = 8.0
# Freezes of one volume outstanding at once: more is a guest's lie.
MAX_FREEZE_DEPTH = 1024
# The slowest a guest writes dm-integrity's tags over a new volume (about
# 14 MB/s under software emulation): what a first open with integrity adds.
INTEGRITY_WIPE_BYTES_PER_SECOND = 4 * 1024 * 1024
INTEGRITY = "hmac-sha256"

FS_GROUP_POLICIES = {"Always": agent_pb2.FsGroup.ALWAYS, "OnRootMismatch": agent_pb2.FsGroup.ON_ROOT_MISMATCH}


class AgentCapabilities(Protocol):
    """What the guest's agent said it can do (a VM's agent port knows it)."""

    def has(self, capability: str) -> bool: ...


def serves(port: AgentCapabilities, disk_bus: str, fs_type: str = "") -> bool:
    """Whether the guest's agent mounts volumes on this disk bus (and of fs_type)."""
    bus = caps.DISK_VIRTIO_SCSI if disk_bus == "virtio-scsi" else caps.DISK_VIRTIO_BLK
    return port.has(bus) and (not fs_type or port.has(caps.fs(fs_type)))


def volume_id(mount_point: str) -> str:
    return PurePosixPath(mount_point).name


def is_encrypted(inside: str) -> bool:
    """Whether what the sandbox mounts is an opened encrypted volume's
    mapping (its name) rather than a disk (its serial)."""
    return inside.startswith("crypt-")


def storage(inside: str, fs_type: str, options: list[str], readonly: bool, mount_point: str,
            fs_group: tuple[int, str] | None) -> agent_pb2.Storage:
    s = agent_pb2.Storage(volume_id=volume_id(mount_point), fs_type=fs_type, options=options, readonly=readonly,
                          mount_point=mount_point)
    if is_encrypted(inside):
        s.encrypted = inside
    else:
        s.disk.serial = inside
    if fs_group is not None:
        gid, policy = fs_group
        s.fs_group.CopyFrom(agent_pb2.FsGroup(gid=gid, policy=FS_GROUP_POLICIES.get(policy, agent_pb2.FsGroup.ALWAYS)))
    return s


async def _call(client: AgentClient, method: str, request, timeout: float, what: str, *, unknown=...):
    """The call's answer; its refusal as the handler's error naming `what`,
    or `unknown` when given and the agent answered NOT_FOUND."""
    try:
        return await client.call(method, request, timeout=timeout)
    except ttrpc.TtrpcError as exc:
        if exc.code == ttrpc.NOT_FOUND and unknown is not ...:
            return unknown
        raise handler_error(exc, what) from None
    except ConnectionError as exc:
        raise handler_error(ttrpc.TtrpcError(ttrpc.UNAVAILABLE, f"the connection broke: {exc}"), what) from None


async def mount(client: AgentClient, s: agent_pb2.Storage) -> agent_pb2.MountVolumeResponse:
    return await _call(client, "MountVolume", agent_pb2.MountVolumeRequest(storage=s), MOUNT_TIMEOUT,
                       f"volume {s.volume_id}")


async def stats(client: AgentClient, mount_point: str, readonly: bool, device_bytes: int | None,
                what: str) -> VolumeStats | None:
    """The volume's usage and condition; None when the agent does not know
    it. Numbers that cannot be on a device of device_bytes (None: unknown)
    are refused (crust.kata.agent.checked_numbers): no usage, and the condition
    abnormal naming `what` (the pod) and the field."""
    key = volume_id(mount_point)
    s = await _call(client, "VolumeStats", agent_pb2.VolumeStatsRequest(volume_id=key), STATS_TIMEOUT,
                    f"volume {key}", unknown=None)
    if s is None:
        return None
    why = checked_numbers.volume_stats(s, device_bytes)
    if why:
        return VolumeStats([], csi_pb2.VolumeCondition(
            abnormal=True, message=f"{what}: the guest reported stats of volume {key} that cannot be: {why}"))
    usage = [Usage(unit=Usage.BYTES, total=s.total_bytes, available=s.available_bytes, used=s.used_bytes),
             Usage(unit=Usage.INODES, total=s.inodes_total, available=s.inodes_free, used=s.inodes_used)]
    condition = csi_pb2.VolumeCondition(abnormal=s.condition.abnormal, message=s.condition.message)
    if s.readonly and not readonly and not s.condition.abnormal:
        condition = csi_pb2.VolumeCondition(abnormal=True, message="the file system went read-only in the guest")
    return VolumeStats(usage, condition)


async def grow(client: AgentClient, mount_point: str) -> bool:
    """Grows the volume's file system to its device; False when the agent does not know it."""
    key = volume_id(mount_point)
    return await _call(client, "GrowVolume", agent_pb2.GrowVolumeRequest(volume_id=key), GROW_TIMEOUT,
                       f"volume {key}", unknown=False) is not False


async def freeze(client: AgentClient, mount_point: str, timeout_seconds: int) -> int | None:
    """Freezes the volume's file system in the guest (the guest thaws it by
    itself after timeout_seconds); the depth, or None when the agent does
    not know the volume."""
    key = volume_id(mount_point)
    answer = await _call(client, "FreezeVolume", agent_pb2.FreezeVolumeRequest(
        volume_id=key, timeout_seconds=timeout_seconds), FREEZE_TIMEOUT, f"volume {key}", unknown=None)
    if answer is None:
        return None
    if not 1 <= answer.depth <= MAX_FREEZE_DEPTH:
        raise handler_error(ttrpc.TtrpcError(ttrpc.INTERNAL, f"the guest answered depth {answer.depth}"),
                            f"volume {key}")
    return answer.depth


async def thaw(client: AgentClient, mount_point: str) -> tuple[int, bool]:
    key = volume_id(mount_point)
    answer = await _call(client, "ThawVolume", agent_pb2.ThawVolumeRequest(volume_id=key), FREEZE_TIMEOUT,
                         f"volume {key}")
    return min(answer.depth, MAX_FREEZE_DEPTH), answer.was_frozen


async def unmount(client: AgentClient, mount_point: str) -> bool:
    """Unmounts the volume; False when the agent does not know it."""
    key = volume_id(mount_point)
    answer = await _call(client, "UnmountVolume", agent_pb2.UnmountVolumeRequest(volume_id=key), UNMOUNT_TIMEOUT,
                         f"volume {key}")
    return answer.known


async def wait_disk_removed(client: AgentClient, serial: str, timeout: float) -> None:
    await _call(client, "WaitDiskRemoved", agent_pb2.WaitDiskRemovedRequest(disk=agent_pb2.Disk(serial=serial)),
                timeout, f"disk {serial}")


def serves_encrypted(port: AgentCapabilities, disk_bus: str, fs_type: str, integrity: str) -> bool:
    """Whether the guest's agent opens encrypted volumes (with integrity when asked)."""
    return serves(port, disk_bus, fs_type) and port.has(caps.LUKS2) and (not integrity or port.has(caps.LUKS2_INTEGRITY))


async def open_encrypted(client: AgentClient, serial: str, fs_type: str, name: str, passphrase: bytearray, *,
                         integrity: str, size_bytes: int) -> agent_pb2.OpenEncryptedResponse:
    """crust's LUKS2 volume on the disk opened as name (formatted first
    when blank). A passphrase no key slot takes is FAILED_PRECONDITION, as
    any other volume the pod cannot use."""
    timeout = OPEN_TIMEOUT + (size_bytes / INTEGRITY_WIPE_BYTES_PER_SECOND if integrity else 0)
    request = agent_pb2.OpenEncryptedRequest(
        name=name, disk=agent_pb2.Disk(serial=serial), passphrase=bytes(passphrase), format_if_blank=True,
        fs_type=fs_type, integrity=agent_pb2.OpenEncryptedRequest.HMAC_SHA256 if integrity == INTEGRITY else
        agent_pb2.OpenEncryptedRequest.NONE)
    try:
        return await client.call("OpenEncrypted", request, timeout=timeout)
    except ttrpc.TtrpcError as exc:
        if exc.code == ttrpc.PERMISSION_DENIED:
            exc = ttrpc.TtrpcError(ttrpc.FAILED_PRECONDITION, f"wrong passphrase: {exc.message}")
        raise handler_error(exc, f"encrypted volume {name}") from None
    except ConnectionError as exc:
        raise handler_error(ttrpc.TtrpcError(ttrpc.UNAVAILABLE, f"the connection broke: {exc}"),
                            f"encrypted volume {name}") from None
    finally:
        request.Clear()


async def resize_encrypted(client: AgentClient, name: str) -> int:
    answer = await _call(client, "ResizeEncrypted", agent_pb2.ResizeEncryptedRequest(name=name), GROW_TIMEOUT,
                         f"encrypted volume {name}")
    return answer.size_bytes


async def close_encrypted(client: AgentClient, name: str) -> None:
    await _call(client, "CloseEncrypted", agent_pb2.CloseEncryptedRequest(name=name), UNMOUNT_TIMEOUT,
                f"encrypted volume {name}")
