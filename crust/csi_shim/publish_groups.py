"""The groups of a publish: the pod's fsGroup as the CO hands it over
(volume_mount_group, or the deferral's supplemental group and its change
policy), checked field by field, and where it is applied: deferred, by the
sandbox (the description's group); on the host, by the shim."""

from __future__ import annotations

import re

from crust.api import csi_pb2
from crust.common.errors import InvalidArgument
from crust.sys import ownership

CHANGE_POLICIES = ("", "Always", "OnRootMismatch")
_GROUP = re.compile(r"^[0-9]{1,10}$")


def publish_groups(request: csi_pb2.NodePublishVolumeRequest) -> tuple[str, str, str]:
    """(supplemental group, its change policy, mount group) of a publish.

    volume_mount_group is the pod's fsGroup that kubelet delegates to
    plugins advertising VOLUME_MOUNT_GROUP. Deferred, it becomes the
    description's group (policy OnRootMismatch unless the CO names one):
    the sandbox applies it. On the host the shim applies it itself."""
    mount_cap = request.volume_capability.mount
    group = mount_cap.volume_supplemental_group
    policy = mount_cap.volume_supplemental_group_change_policy
    mount_group = mount_cap.volume_mount_group
    if (group or policy) and not request.defer_fs_ops:
        # Name the field that was actually set, so the CO operator knows which one.
        name = "volume_supplemental_group" if group else "volume_supplemental_group_change_policy"
        raise InvalidArgument(f"volume_capability.mount.{name} may only be set together with defer_fs_ops")
    for name, value in (("volume_supplemental_group", group), ("volume_mount_group", mount_group)):
        if value and not _GROUP.match(value):
            raise InvalidArgument(f"volume_capability.mount.{name} must be a numeric group id, got {value!r}")
    if policy not in CHANGE_POLICIES:
        raise InvalidArgument("volume_capability.mount.volume_supplemental_group_change_policy must be "
                              f"Always or OnRootMismatch, got {policy!r}")
    if not request.defer_fs_ops:
        return "", "", mount_group
    if group and mount_group and group != mount_group:
        raise InvalidArgument(f"volume_capability.mount.volume_mount_group {mount_group} differs from "
                              f"volume_supplemental_group {group}; a pod has one fsGroup")
    if mount_group and not group:
        group, policy = mount_group, policy or ownership.ON_ROOT_MISMATCH
    return group, policy, ""
