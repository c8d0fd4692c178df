"""Kata's two readers of a direct-assigned volume, written from the rules of
their public source, independent of crust's own parser: what a stock Kata
takes from a mountInfo.json in its layout, and what it refuses.

- runtime-rs (Kata 4's default shim): kata-types' `DirectVolumeMountInfo`
  is deserialized by serde_json: "volume-type", "device" and "fstype" are
  required strings, "metadata" (a map of strings) and "options" (a list of
  strings) may be absent, a wrong type or a null is an error, a repeated key
  is an error, keys it does not name are ignored, and the file must be
  UTF-8. The volume type picks the volume: "spdkvol"/"spoolvol" (SPDK),
  "vfiovol" (VFIO), anything else the raw-block volume, which refuses a type
  other than "directvol" (`volume type "block" is invalid`) and a device
  that is neither a block device nor a regular file. It mounts `fstype`,
  read-only when the container's mount is, and applies no fsGroup from
  "metadata".
- The Go runtime (Kata 3's, still shipped): encoding/json into its
  `MountInfo`: keys match their names case-insensitively, an absent key or
  a null leaves the zero value, a wrong type is an error, the last of a
  repeated key wins, other keys are ignored. It never reads "volume-type".
  It mounts `fstype` read-only when "ro" is among "options", passes the
  options on, takes `metadata.fsGroup` as a decimal group id (a bad one is
  logged and skipped) and `metadata.fsGroupChangePolicy` only with it, and
  attaches `device` when it is a block device.

Each reader raises KataRefuses with Kata's wording where Kata fails.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from pathlib import Path

MOUNT_INFO = "mountInfo.json"


class KataRefuses(Exception):
    pass


def entry_dir(root: Path, volume_path: str) -> Path:
    """Both runtimes: URL-safe base64 of the volume path, with padding."""
    return root / base64.urlsafe_b64encode(volume_path.encode()).decode()


def _strict_pairs(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise KataRefuses(f"duplicate field `{key}`")
        seen[key] = value
    return seen


def _no_constant(name):
    raise KataRefuses(f"expected value, found {name}")


# -- runtime-rs ---------------------------------------------------------------------------------


RS_REQUIRED = ("volume-type", "device", "fstype")
RS_SPDK = ("spdkvol", "spoolvol")
RS_VFIO = "vfiovol"
RS_RAW_BLOCK = "directvol"


def runtime_rs_parse(data: bytes) -> dict:
    """serde_json into DirectVolumeMountInfo."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise KataRefuses("stream did not contain valid UTF-8") from None
    try:
        raw = json.loads(text, object_pairs_hook=_strict_pairs, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise KataRefuses(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise KataRefuses("invalid type: expected struct DirectVolumeMountInfo")
    info = {}
    for key in RS_REQUIRED:
        if key not in raw:
            raise KataRefuses(f"missing field `{key}`")
        if not isinstance(raw[key], str):
            raise KataRefuses(f"invalid type for `{key}`: expected a string")
        info[key] = raw[key]
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise KataRefuses("invalid type for `metadata`: expected a map of strings")
    options = raw.get("options", [])
    if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
        raise KataRefuses("invalid type for `options`: expected a sequence of strings")
    info["metadata"], info["options"] = metadata, options
    return info


def runtime_rs_reads(root: Path, volume_path: str, read_only: bool = False) -> dict:
    """What runtime-rs does with the bind mount of `volume_path`: the
    storage it hands its agent, or KataRefuses."""
    entry = entry_dir(root, volume_path)
    if not entry.is_dir():
        raise KataRefuses(f"direct volume path {entry} Not Found")  # not a direct volume at all
    info = runtime_rs_parse((entry / MOUNT_INFO).read_bytes())
    kind = info["volume-type"]
    if kind in RS_SPDK or kind == RS_VFIO:
        raise KataRefuses(f"volume type {kind!r} is no raw block volume")
    if kind != RS_RAW_BLOCK:
        raise KataRefuses(f'volume type "{kind}" is invalid')
    try:
        mode = os.stat(info["device"]).st_mode
    except OSError as exc:
        raise KataRefuses(f"stat volume device file: {info['device']}: {exc}") from None
    if not (stat.S_ISBLK(mode) or stat.S_ISREG(mode)):
        raise KataRefuses(f'invalid volume device "{info["device"]}" for volume type "{kind}"')
    return {"device": info["device"], "fstype": info["fstype"], "read_only": read_only, "fs_group": None}


# -- the Go runtime -----------------------------------------------------------------------------


GO_FIELDS = {"volume-type": str, "device": str, "fstype": str, "metadata": dict, "options": list}


def go_parse(data: bytes) -> dict:
    """encoding/json into the Go runtime's MountInfo."""
    try:
        raw = json.loads(data.decode("utf-8", errors="replace"), parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise KataRefuses(f"not JSON: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise KataRefuses("json: cannot unmarshal into Go value of type volume.MountInfo")
    info = {"volume-type": "", "device": "", "fstype": "", "metadata": {}, "options": []}
    for key, value in raw.items():
        field = next((f for f in GO_FIELDS if f == key), None) or \
            next((f for f in GO_FIELDS if f.casefold() == key.casefold()), None)
        if field is None or value is None:
            continue
        kind = GO_FIELDS[field]
        ok = isinstance(value, kind)
        if ok and kind is dict:
            ok = all(isinstance(v, str) for v in value.values())
        if ok and kind is list:
            ok = all(isinstance(o, str) for o in value)
        if not ok:
            raise KataRefuses(f"json: cannot unmarshal into Go struct field MountInfo.{field}")
        info[field] = value
    return info


def go_runtime_reads(root: Path, volume_path: str) -> dict:
    """What the Go runtime makes of a bind mount of `volume_path`."""
    path = entry_dir(root, volume_path) / MOUNT_INFO
    if not path.exists():
        raise KataRefuses(f"{path}: no such file (not a direct volume)")
    info = go_parse(path.read_bytes())
    fs_group = None
    policy = None
    for key, value in info["metadata"].items():
        if key == "fsGroup":
            if re.fullmatch(r"[+-]?[0-9]+", value):  # strconv.Atoi; anything else is logged and skipped
                fs_group = int(value)
        elif key == "fsGroupChangePolicy" and "fsGroup" in info["metadata"]:
            policy = value
    try:
        is_block = stat.S_ISBLK(os.stat(info["device"]).st_mode)
    except OSError:
        is_block = False
    return {"device": info["device"], "fstype": info["fstype"], "options": info["options"],
            "read_only": "ro" in info["options"], "fs_group": fs_group, "fs_group_change_policy": policy,
            "attached": is_block}
