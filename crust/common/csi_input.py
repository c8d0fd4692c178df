"""Checks of CSI request fields, shared by every crust CSI service.

Each check raises InvalidArgument with a message that names the field, so a
CO operator can tell exactly which part of the request was wrong.
"""

from __future__ import annotations

import os

from crust.api import csi_pb2
from crust.common.errors import InvalidArgument, NotFound, OutOfRange

AccessMode = csi_pb2.VolumeCapability.AccessMode

SINGLE_NODE_MODES = {
    AccessMode.SINGLE_NODE_WRITER,
    AccessMode.SINGLE_NODE_READER_ONLY,
    AccessMode.SINGLE_NODE_SINGLE_WRITER,
    AccessMode.SINGLE_NODE_MULTI_WRITER,
}
READ_ONLY_MODES = {AccessMode.SINGLE_NODE_READER_ONLY, AccessMode.MULTI_NODE_READER_ONLY}

MAX_PATH = 4096  # PATH_MAX, with the terminating NUL counted as the kernel does
MAX_COMPONENT = 255  # NAME_MAX: the longest file name Linux file systems take
MAX_NAME = 128
MAX_OPTION = 256


def required(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument(f"{field} is required")
    return value


def name(value: str, field: str = "name") -> str:
    required(value, field)
    if len(value) > MAX_NAME:
        raise InvalidArgument(f"{field} is {len(value)} characters; at most {MAX_NAME} are allowed")
    if "\x00" in value:
        raise InvalidArgument(f"{field} contains a NUL character")
    return value


def path(value: str, field: str) -> str:
    """An absolute, normalised path without NUL (what kubelet sends)."""
    required(value, field)
    if "\x00" in value:
        raise InvalidArgument(f"{field} contains a NUL character")
    if len(value.encode("utf-8", "surrogatepass")) >= MAX_PATH:
        raise InvalidArgument(f"{field} is {len(value.encode('utf-8', 'surrogatepass'))} bytes; "
                              f"paths must be shorter than {MAX_PATH} bytes")
    for part in value.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT:
            raise InvalidArgument(f"{field} has a component of {len(part.encode('utf-8', 'surrogatepass'))} "
                                  f"bytes ({part[:32]!r}...); at most {MAX_COMPONENT} are allowed")
    if not value.startswith("/"):
        raise InvalidArgument(f"{field} must be an absolute path, got {value!r}")
    # normpath keeps a leading "//" (POSIX leaves its meaning open), so a
    # doubled slash is refused explicitly.
    if (os.path.normpath(value) != value.rstrip("/") and value != "/") or "//" in value:
        raise InvalidArgument(f"{field} must be normalised (no '.', '..' or '//'), got {value!r}")
    return value.rstrip("/") or "/"


def lookup_path(value: str, field: str) -> str:
    """A path that only names something published before (volume_path of
    NodeGetVolumeStats and NodeExpandVolume): bad text is INVALID_ARGUMENT,
    but a relative or unnormalised path is NOT_FOUND: nothing was ever
    published there (csi-sanity asks for exactly this)."""
    required(value, field)
    if not value.startswith("/") or "//" in value or os.path.normpath(value) != value.rstrip("/"):
        path(value if value.startswith("/") else "/" + value, field)  # the text checks still apply
        raise NotFound(f"nothing is published at {field} {value!r}")
    return path(value, field)


def access_type(cap: csi_pb2.VolumeCapability, field: str) -> str:
    kind = cap.WhichOneof("access_type")
    if kind is None:
        raise InvalidArgument(f"{field}.access_type must be mount or block")
    return kind


def access_mode(cap: csi_pb2.VolumeCapability, field: str, supported: set[int]) -> int:
    mode = cap.access_mode.mode
    if not cap.HasField("access_mode") or mode == AccessMode.UNKNOWN:
        raise InvalidArgument(f"{field}.access_mode is required")
    if mode not in AccessMode.Mode.values():
        raise InvalidArgument(f"{field}.access_mode.mode {mode} is not an access mode")
    if mode not in supported:
        raise InvalidArgument(
            f"{field}.access_mode {AccessMode.Mode.Name(mode)} is not supported; "
            "volumes live on one node (use a SINGLE_NODE_* mode)"
        )
    return mode


def capability(cap: csi_pb2.VolumeCapability, field: str, supported_modes: set[int],
               fs_types: tuple[str, ...]) -> str:
    """Validate one capability; returns its access type (mount or block)."""
    kind = access_type(cap, field)
    access_mode(cap, field, supported_modes)
    if kind == "mount":
        fs = cap.mount.fs_type
        if fs and fs not in fs_types:
            raise InvalidArgument(f"{field}.mount.fs_type {fs!r} is not supported; use one of {', '.join(fs_types)}")
        mount_flags(list(cap.mount.mount_flags), f"{field}.mount.mount_flags")
    return kind


def mount_flags(flags: list[str], field: str) -> list[str]:
    """Each flag must be one option: a comma or control character would
    smuggle extra options into the mount command."""
    for i, flag in enumerate(flags):
        if not flag:
            raise InvalidArgument(f"{field}[{i}] is empty")
        if len(flag) > MAX_OPTION:
            raise InvalidArgument(f"{field}[{i}] is longer than {MAX_OPTION} characters")
        if "," in flag or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in flag):
            raise InvalidArgument(f"{field}[{i}] {flag!r} must be a single option (no ',' or control characters)")
    return flags


def capacity(rng: csi_pb2.CapacityRange | None, *, default: int, minimum: int, maximum: int,
             align: int, field: str = "capacity_range") -> int:
    """Pick a size inside the range: the required size rounded up to `align`,
    at least `minimum`; OUT_OF_RANGE when that does not fit the limit."""
    required_bytes = rng.required_bytes if rng else 0
    limit_bytes = rng.limit_bytes if rng else 0
    if required_bytes < 0 or limit_bytes < 0:
        raise InvalidArgument(f"{field}: sizes must not be negative")
    if limit_bytes and required_bytes > limit_bytes:
        raise InvalidArgument(f"{field}.required_bytes ({required_bytes}) exceeds limit_bytes ({limit_bytes})")
    size = required_bytes or (min(default, limit_bytes) if limit_bytes else default)
    size = max(size, minimum)
    size = -(-size // align) * align
    if limit_bytes and size > limit_bytes:
        # Rounding up overshot the limit; the aligned size below the limit
        # may still satisfy both the request and the minimum.
        below = limit_bytes // align * align
        if below >= max(required_bytes, minimum):
            size = below
    if limit_bytes and size > limit_bytes:
        raise OutOfRange(
            f"{field}: the smallest volume this driver can make is {size} bytes "
            f"(at least {minimum}, in steps of {align}), above limit_bytes {limit_bytes}"
        )
    if size > maximum:
        raise OutOfRange(f"{field}: {size} bytes is more than the largest volume possible here ({maximum} bytes)")
    return size
