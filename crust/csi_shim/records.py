"""What the shim remembers per volume it serves with the mount access type.

Everything the kernel can tell (is the file system mounted on the host, is a
placeholder on a target) is read back from mountinfo; the record keeps what
it cannot: the capability, the backend's private paths, and which targets
were published deferred or on the host.
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, Field


def volume_key(volume_id: str) -> str:
    """A file-name-safe key for any CSI volume id (ids are opaque strings)."""
    return hashlib.sha256(volume_id.encode()).hexdigest()[:32]


class ShimPublish(BaseModel):
    deferred: bool
    readonly: bool = False
    supplemental_group: str = ""
    supplemental_group_change_policy: str = ""
    # volume_mount_group of a host publish: the pod's fsGroup, applied by the
    # shim because kubelet delegated it (VOLUME_MOUNT_GROUP).
    mount_group: str = ""


class ShimVolumeRecord(BaseModel):
    volume_id: str
    # The staging path kubelet gave: where the file system is mounted on the
    # host while non-deferred publishes exist.
    staging_path: str
    fs_type: str
    mount_flags: list[str] = Field(default_factory=list)
    access_mode: int = 0
    # The backend stages and publishes the volume as raw block here, inside
    # the shim's state dir: the device node is bind-mounted on backend_target.
    backend_staging: str = ""
    backend_target: str
    publish_context: dict[str, str] = Field(default_factory=dict)
    volume_context: dict[str, str] = Field(default_factory=dict)
    published: dict[str, ShimPublish] = Field(default_factory=dict)

    def deferred_targets(self) -> list[str]:
        return sorted(t for t, p in self.published.items() if p.deferred)

    def host_targets(self) -> list[str]:
        return sorted(t for t, p in self.published.items() if not p.deferred)
