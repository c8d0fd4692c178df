"""mountInfo.json: the description of a deferred volume on disk.

The keys Kata Containers reads for its direct-assigned volumes
("volume-type", "device", "fstype", "metadata", "options") come first and
keep Kata's meaning, so a stock Kata can read our file (both its parsers,
the Go runtime's and runtime-rs's, ignore keys they do not know). crust's
own keys follow. The Kata mirror (kata_json) is the same file with the
"volume-type" Kata's runtime-rs mounts; the canonical entry keeps "block". The JSON schema generated
from this model is published as specs/mountinfo.schema.json.

Never a secret in here: the file sits on disk where runtimes read it.

"crust-schema-version" names the file's format (absent: 1). A reader takes
its own version and every older one, and refuses a newer one
(crust.common.formats.NewerFormat) instead of misreading it; the check is
in the model, so every reader of the file, and every record that embeds a
description, refuses the same way.
"""

from __future__ import annotations

import base64
import hashlib
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from crust.api import csi_pb2
from crust.common.formats import NewerFormat

# The format of mountInfo.json this crust writes; it reads 1 to this.
SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "crust-schema-version"

# The "volume-type" of a Kata mirror: Kata's runtime-rs hands every value
# but its SPDK and VFIO kinds to its raw-block volume, which takes only this
# one; the Go runtime does not read the key.
KATA_VOLUME_TYPE = "directvol"
# What a reader takes: "block" is the canonical entry's value, and the one
# mirrors and Kata-style drivers wrote for Kata's Go runtime.
VOLUME_TYPES = ("block", KATA_VOLUME_TYPE)

# Kata's metadata keys.
FS_GROUP = "fsGroup"
FS_GROUP_CHANGE_POLICY = "fsGroupChangePolicy"

# The mount source of the empty read-only tmpfs the shim puts on a target it
# deferred: a runtime that finds it there (and no entry) knows the volume is
# deferred to a sandbox and was not seen, rather than an empty directory.
PLACEHOLDER_SOURCE = "crust-deferred"

# Volume context keys that carry secrets: kubelet puts the pod's service
# account tokens there for a CSIDriver with tokenRequests.
SECRET_CONTEXT_KEYS = frozenset({"csi.storage.k8s.io/serviceAccount.tokens"})


class MountInfo(BaseModel):
    """One deferred volume, as a runtime handler needs it."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore")

    volume_type: Literal["block", "directvol"] = Field(
        "block", alias="volume-type",
        description="Kind of volume, a host block device: \"block\" in the canonical entry, \"directvol\" in "
                    "the Kata mirror (what Kata's runtime-rs mounts); a reader takes either.")
    device: str = Field(description="Host path of the block device, e.g. /dev/loop3.")
    fstype: str = Field(description="File system on the device (ext4, xfs).")
    metadata: dict[str, str] = Field(default_factory=dict,
                                     description="Kata's string map: fsGroup, fsGroupChangePolicy.")
    options: list[str] = Field(default_factory=list,
                               description="Mount options a guest can use (never host-only ones); "
                                           "\"ro\" when read-only, as Kata reads it.")

    # crust's keys.
    schema_version: int = Field(SCHEMA_VERSION, alias=SCHEMA_VERSION_KEY, ge=1,
                                description="Format of this file (absent: 1). A reader refuses a version newer "
                                            "than it knows rather than misread it.")
    readonly: bool = Field(False, description="Mount read-only.")
    volume_id: str = Field("", alias="volume-id", description="CSI volume id.")
    target_path: str = Field(alias="target-path", description="The CSI target path: the key of this entry.")
    capacity_bytes: int = Field(0, alias="capacity-bytes", description="Device size at publish time, refreshed after each expansion.")
    device_major: int = Field(0, alias="device-major", description="Major number of the device.")
    device_minor: int = Field(0, alias="device-minor", description="Minor number of the device.")
    volume_context: dict[str, str] = Field(default_factory=dict, alias="volume-context",
                                           description="Non-secret CSI volume context.")
    encryption: str = Field("", description="\"luks2\": the device holds (or, blank, will hold) a LUKS2 volume "
                                            "that only a sandbox opens, with the key the proxy hands the claiming "
                                            "handler; never the key itself. Empty: a plain file system.")
    integrity: str = Field("", description="\"hmac-sha256\": the LUKS2 volume is authenticated (dm-integrity under "
                                           "dm-crypt); a handler opens it only if it honours that. Empty: none.")

    @model_validator(mode="before")
    @classmethod
    def _known_format(cls, data):
        """Refuse a newer format before any key is read with today's meaning;
        an older one is read as this version (none differs yet)."""
        if isinstance(data, dict):
            version = data.get(SCHEMA_VERSION_KEY, data.get("schema_version", 1))
            if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
                raise NewerFormat(None, "mountInfo.json (crust-schema-version)", version, SCHEMA_VERSION)
        return data

    @field_validator("volume_context")
    @classmethod
    def _no_secrets(cls, value: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in value.items() if k not in SECRET_CONTEXT_KEYS}

    @model_validator(mode="after")
    def _readonly_in_options(self) -> "MountInfo":
        """Kata takes read-only from an "ro" option (it ignores "readonly"),
        so the two always agree."""
        if "ro" in self.options:
            self.readonly = True
        if self.readonly:
            self.options = [o for o in self.options if o != "rw"]
            if "ro" not in self.options:
                self.options.append("ro")
        return self

    @classmethod
    def from_deferred(cls, target_path: str, d: csi_pb2.DeferredMount) -> "MountInfo":
        metadata = {}
        if d.volume_supplemental_group:
            metadata[FS_GROUP] = d.volume_supplemental_group
        if d.volume_supplemental_group_change_policy:
            metadata[FS_GROUP_CHANGE_POLICY] = d.volume_supplemental_group_change_policy
        return cls(
            device=d.device, fstype=d.fs_type, metadata=metadata, options=list(d.mount_options),
            readonly=d.readonly, volume_id=d.volume_id, target_path=target_path,
            capacity_bytes=d.capacity_bytes, device_major=d.device_major, device_minor=d.device_minor,
            volume_context=dict(d.volume_context), encryption=d.encryption, integrity=d.integrity,
        )

    def to_json(self) -> bytes:
        return self.model_dump_json(by_alias=True, indent=1).encode()

    def kata_json(self) -> bytes:
        """The mirror in Kata's direct-volume layout: this file with Kata 4's
        volume type. crust's keys stay (Kata ignores them): the schema
        version tells crust's own direct-volume reader it is the proxy's."""
        return self.model_copy(update={"volume_type": KATA_VOLUME_TYPE}).to_json()


def digest(target_path: str) -> str:
    """Name of the entry directory: hex sha256 of the target path (KEP-2857)."""
    return hashlib.sha256(target_path.encode()).hexdigest()


def kata_name(target_path: str) -> str:
    """Name of Kata's entry directory: URL-safe base64 of the path, with padding."""
    return base64.urlsafe_b64encode(target_path.encode()).decode()


_DIGEST = re.compile(r"^[0-9a-f]{64}$")


def is_digest(name: str) -> bool:
    return bool(_DIGEST.fullmatch(name))


def json_schema() -> dict:
    schema = MountInfo.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://crust.dev/schemas/mountinfo.schema.json"
    schema["title"] = "crust mountInfo.json"
    return schema
