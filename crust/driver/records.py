"""On-disk records of the driver (pydantic models, one JSON file each).

Layout under --data-dir:

    pools/<node>/pool.json             PoolRecord, written by the node at start
    pools/<node>/volumes/<vol>.img     backing file of a volume (sparse)
    pools/<node>/snapshots/<snap>.img  frozen copy of a volume
    controller/volumes/<vol>.json      VolumeRecord (controller state)
    controller/snapshots/<snap>.json   SnapshotRecord (controller state)
    controller/groups/<group>.json     GroupSnapshotRecord (controller state)
    node/<node>/volumes/<vol>.json     NodeVolumeRecord (what this node staged
                                       and published; never controller state)
"""

from __future__ import annotations

import enum
import time
from pathlib import Path

from pydantic import BaseModel, Field


class Lifecycle(str, enum.Enum):
    # A record is written in CREATING before its backing file is made and in
    # DELETING before the file is removed; a restart finds these half-done
    # operations and finishes (delete) or rolls them back (create).
    CREATING = "creating"
    READY = "ready"
    DELETING = "deleting"


class ContentSource(BaseModel):
    snapshot_id: str = ""
    volume_id: str = ""


class ControllerPublish(BaseModel):
    readonly: bool = False
    access_mode: int = 0
    access_type: str = "mount"  # mount | block


class VolumeRecord(BaseModel):
    volume_id: str
    name: str
    node: str  # the pool (= node id) holding the backing file
    capacity_bytes: int
    # Requested range, kept to answer idempotent repeats of CreateVolume.
    required_bytes: int = 0
    limit_bytes: int = 0
    parameters: dict[str, str] = Field(default_factory=dict)
    mutable_parameters: dict[str, str] = Field(default_factory=dict)
    content_source: ContentSource = Field(default_factory=ContentSource)
    published: dict[str, ControllerPublish] = Field(default_factory=dict)
    state: Lifecycle = Lifecycle.CREATING
    created_at: float = Field(default_factory=time.time)


class SnapshotRecord(BaseModel):
    snapshot_id: str
    name: str
    source_volume_id: str
    node: str
    size_bytes: int
    parameters: dict[str, str] = Field(default_factory=dict)
    group_snapshot_id: str = ""
    state: Lifecycle = Lifecycle.CREATING
    created_at: float = Field(default_factory=time.time)


class GroupSnapshotRecord(BaseModel):
    group_snapshot_id: str
    name: str
    source_volume_ids: list[str]
    snapshot_ids: list[str] = Field(default_factory=list)
    parameters: dict[str, str] = Field(default_factory=dict)
    state: Lifecycle = Lifecycle.CREATING
    created_at: float = Field(default_factory=time.time)


class PoolRecord(BaseModel):
    node_id: str
    capacity_bytes: int
    max_volumes_per_node: int
    topology: dict[str, str]
    updated_at: float = Field(default_factory=time.time)


class NodePublish(BaseModel):
    readonly: bool = False
    access_type: str = "mount"
    # The read-only loop device a read-only raw block publish binds (its
    # own device: a read-only bind of a node does not stop writes).
    device: str = ""

    def same_request(self, other: "NodePublish") -> bool:
        return (self.readonly, self.access_type) == (other.readonly, other.access_type)


class NodeVolumeRecord(BaseModel):
    volume_id: str
    staging_path: str
    access_type: str  # mount | block
    access_mode: int = 0
    fs_type: str = ""
    mount_flags: list[str] = Field(default_factory=list)
    published: dict[str, NodePublish] = Field(default_factory=dict)
    # The writable loop device attached at stage. A hint, never the truth:
    # each use checks with one sysfs read that it still serves the volume's
    # file (a reboot or an operator may have detached or reused it).
    device: str = ""

    def devices(self) -> list[str]:
        """Every loop device this node attached for the volume."""
        return [d for d in [self.device, *(p.device for p in self.published.values())] if d]


def node_records_dir(data_dir: Path, node_id: str) -> Path:
    """Where a node keeps its NodeVolumeRecords (see the layout above)."""
    return data_dir / "node" / node_id / "volumes"
