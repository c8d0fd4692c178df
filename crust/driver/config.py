"""Configuration of `crust driver`, validated once at start."""

from __future__ import annotations

import enum
import re
import shutil
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from crust.common.private import make_dirs

DRIVER_NAME = "loop.csi.crust.dev"
# The one topology segment of the loop backend: the node whose pool holds the
# volume's backing file.
TOPOLOGY_KEY = "topology.loop.csi.crust.dev/node"

_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class Mode(str, enum.Enum):
    ALL = "all"
    CONTROLLER = "controller"
    NODE = "node"

    @property
    def controller(self) -> bool:
        return self in (Mode.ALL, Mode.CONTROLLER)

    @property
    def node(self) -> bool:
        return self in (Mode.ALL, Mode.NODE)


class DriverConfig(BaseModel):
    endpoint: str
    node_id: str
    data_dir: Path
    mode: Mode = Mode.ALL
    backend: str = "loop"
    # Pool size the node offers (sum of volume sizes it accepts); 0 = the size
    # of the file system holding data_dir. Volumes are sparse files, so this is
    # a provisioning limit, not an allocation.
    capacity_bytes: int = Field(default=0, ge=0)
    max_volumes_per_node: int = Field(default=64, ge=1, le=4096)
    # Default file system when a mount capability names none.
    default_fs_type: str = "ext4"
    # Advertise the capabilities of the proposed alpha RPCs (GET_ID,
    # GET_NODE_INFO). The RPCs are served either way; the capabilities stay
    # off by default because today's COs and conformance tools reject
    # capability values they do not know.
    advertise_alpha: bool = False
    # Distributed provisioning (mode all only): this process is the
    # controller of this node's pool alone, as each node runs its own next to
    # a node-deployed external-provisioner. No attach step is advertised
    # (the CSIDriver sets attachRequired: false) and volumes grow at the node
    # (NodeExpandVolume grows the backing file): the attacher and resizer
    # sidecars have no per-node mode, so no request may need another node.
    distributed: bool = False
    # Prometheus metrics on metrics_address:metrics_port; 0: off.
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_address: str = "127.0.0.1"

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, value: str) -> str:
        if not _NODE_ID.fullmatch(value):
            raise ValueError("node id must be 1-63 characters of letters, digits, '.', '_' or '-'")
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if value != "loop":
            raise ValueError(f"unknown backend {value!r}; available: loop")
        return value

    @field_validator("default_fs_type")
    @classmethod
    def _fs(cls, value: str) -> str:
        if value not in ("ext4", "xfs"):
            raise ValueError("default fs type must be ext4 or xfs")
        return value

    @model_validator(mode="after")
    def _distributed_needs_all(self) -> "DriverConfig":
        if self.distributed and self.mode is not Mode.ALL:
            raise ValueError("distributed provisioning needs mode all: each node is its own controller")
        return self

    def effective_capacity(self) -> int:
        if self.capacity_bytes:
            return self.capacity_bytes
        make_dirs(self.data_dir)
        return shutil.disk_usage(self.data_dir).total
