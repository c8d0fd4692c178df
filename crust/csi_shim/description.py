"""The deferred-mount description returned from NodePublishVolume.

It carries only what a guest can use: the device, the file system, the mount
options a guest kernel understands, read-only as a flag, the fsGroup and its
policy, and the identity of the device. Host-only options and anything
secret never go in: the description ends up in a file on disk.
"""

from __future__ import annotations

from crust.api import csi_pb2
from crust.contract import encryption

# Options that only make sense on the host that performs the mount.
HOST_ONLY = {"bind", "rbind", "remount", "defaults", "_netdev", "nofail", "auto", "noauto", "user", "users",
             "nouser", "owner", "group"}
HOST_ONLY_PREFIXES = ("context=", "fscontext=", "defcontext=", "rootcontext=", "x-", "comment=")
READ_FLAGS = {"ro", "rw"}


def guest_options(flags: list[str]) -> tuple[list[str], bool]:
    """Split mount flags into guest-usable options and a read-only flag."""
    options, readonly = [], False
    for flag in flags:
        if flag in READ_FLAGS:
            readonly = readonly or flag == "ro"
            continue
        if flag in HOST_ONLY or flag.startswith(HOST_ONLY_PREFIXES):
            continue
        if flag not in options:
            options.append(flag)
    return options, readonly


def describe(*, volume_id: str, device: str, major: int, minor: int, fs_type: str, flags: list[str],
             readonly: bool, capacity_bytes: int, supplemental_group: str, change_policy: str,
             volume_context: dict[str, str]) -> csi_pb2.DeferredMount:
    options, ro_flag = guest_options(flags)
    return csi_pb2.DeferredMount(
        volume_type="block",
        device=device,
        fs_type=fs_type,
        mount_options=options,
        readonly=readonly or ro_flag,
        volume_supplemental_group=supplemental_group,
        volume_supplemental_group_change_policy=change_policy,
        volume_id=volume_id,
        capacity_bytes=capacity_bytes,
        device_major=major,
        device_minor=minor,
        # volume_context comes from the CO and holds no secrets (those travel
        # in the separate secrets field, which is never copied here).
        volume_context=volume_context,
        # That the volume is encrypted, never with what: the key travels
        # from the proxy's memory to the claiming handler only.
        encryption=encryption.of_context(volume_context),
        integrity=encryption.integrity_of(volume_context),
    )
