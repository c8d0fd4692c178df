"""Checks of target paths the proxy is asked to publish into its directory."""

from __future__ import annotations

import os
from pathlib import Path

from crust.common import csi_input
from crust.common.errors import InvalidArgument


def check_target(path: str, kubelet_root: Path, field: str = "target_path") -> str:
    """An absolute, normalised path inside the kubelet root, reached without
    a symlink that leads outside it."""
    path = csi_input.path(path, field)
    root = os.path.normpath(str(kubelet_root))
    if not (path + "/").startswith(root.rstrip("/") + "/") or path == root:
        raise InvalidArgument(f"{field} {path!r} is outside the kubelet root {root}")
    # A symlink on the way must not lead out of the root. The parent exists
    # when kubelet publishes; otherwise the deepest ancestor that exists (a
    # dangling symlink included) is what the path would be reached through.
    existing = os.path.dirname(path)
    while existing != root and not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    real_root = os.path.realpath(root)
    real = os.path.realpath(existing)
    if not (real + "/").startswith(real_root.rstrip("/") + "/") and real != real_root:
        raise InvalidArgument(f"{field} {path!r} leads outside the kubelet root through a symlink")
    return path


def check_sandbox_id(value: str, field: str = "sandbox_id") -> str:
    csi_input.required(value, field)
    if "/" in value or value in (".", "..") or "\x00" in value or len(value.encode()) > 255 \
            or value.startswith(".") or value == "mountInfo.json":
        raise InvalidArgument(f"{field} {value!r} must be a plain file name (no '/', no leading '.', <= 255 bytes)")
    return value
