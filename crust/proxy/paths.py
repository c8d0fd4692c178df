"""Checks of target paths the proxy is asked to publish into its directory."""

from __future__ import annotations

import os
from pathlib import Path

from crust.common import copath, csi_input
from crust.common.errors import InvalidArgument


def check_target(path: str, kubelet_root: Path, field: str = "target_path") -> str:
    """An absolute, normalised path inside the kubelet root that leads
    there: it is walked without following a symlink (crust.common.copath),
    so a link planted on the way (to /etc, or to anywhere else outside the
    root) is refused, not only a path whose text leaves the root."""
    path = csi_input.path(path, field)
    root = os.path.normpath(str(kubelet_root))
    if not (path + "/").startswith(root.rstrip("/") + "/") or path == root:
        raise InvalidArgument(f"{field} {path!r} is outside the kubelet root {root}")
    copath.refuse_links(path, field)
    return path
