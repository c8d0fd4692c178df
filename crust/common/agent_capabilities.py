"""The names of the guest agent's capabilities (specs/agent.proto,
GuestDetailsResponse.capabilities): what the agent lists and what the host
asks for before it uses a call or a field, one name each, for both sides
(the agent runs on the guest's Python, which imports crust.common).

The proto's comment on GuestDetailsResponse.capabilities says what each
means; a unit test holds this list and that comment to the same names.
"""

from __future__ import annotations

CONTAINER_OCI = "container.oci"
CONTAINER_CREATE = "container.create"
CONTAINER_POD_PID = "container.pod-pid"
CONTAINER_TERMINAL = "container.terminal"
PROCESS_EXEC = "process.exec"
PROCESS_GUEST = "process.guest"
PROCESS_TERMINAL = "process.terminal"
PROCESS_STDIN = "process.stdin"
STATS_CGROUP2 = "stats.cgroup2"
DISK_VIRTIO_BLK = "disk.virtio-blk"
DISK_VIRTIO_SCSI = "disk.virtio-scsi"
VOLUME_GROW = "volume.grow"
VOLUME_FREEZE = "volume.freeze"
LUKS2 = "luks2"
LUKS2_INTEGRITY = "luks2.integrity"
SHARE_VIRTIOFS = "share.virtiofs"
TMPFS_POD = "tmpfs.pod"
MIRROR_ATOMIC_WRITER = "mirror.atomic-writer"
SUBPATH_BENEATH = "subpath.beneath"
NETWORK_INTERFACE = "network.interface"
GUEST_SETTINGS = "guest.settings"
RESUME = "resume"
WARM = "warm"
# One per file system type MountVolume mounts: fs.ext4, fs.xfs, ...
FS_PREFIX = "fs."

NAMES = (CONTAINER_OCI, CONTAINER_CREATE, CONTAINER_POD_PID, CONTAINER_TERMINAL, PROCESS_EXEC, PROCESS_GUEST,
         PROCESS_TERMINAL, PROCESS_STDIN, STATS_CGROUP2, DISK_VIRTIO_BLK, DISK_VIRTIO_SCSI, VOLUME_GROW, VOLUME_FREEZE, LUKS2,
         LUKS2_INTEGRITY, SHARE_VIRTIOFS, TMPFS_POD, MIRROR_ATOMIC_WRITER, SUBPATH_BENEATH, NETWORK_INTERFACE,
         GUEST_SETTINGS, RESUME, WARM)


def fs(fs_type: str) -> str:
    """The capability of a file system type: the agent mounts fs_type."""
    return FS_PREFIX + fs_type
