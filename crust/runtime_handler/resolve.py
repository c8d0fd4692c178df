"""From an OCI mount source to a deferred volume (and a subpath inside it).

kubelet lays a CSI volume out as .../pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount;
a container may mount that path or a directory below it (a subPath). The
runtime probes the source and each parent, up to the .../<pv>/mount level,
looking for an entry named by the digest of the probed path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from crust.common.errors import FailedPrecondition
from crust.contract.mountinfo import MountInfo, digest
from crust.runtime_handler.index import VolumeIndex

CSI_DIR = "kubernetes.io~csi"


class SubpathEscapes(ValueError):
    pass


class EntryRefused(FailedPrecondition):
    """The volume's entry is there, in a format this handler does not read
    (FAILED_PRECONDITION wherever it reaches a caller)."""


@dataclass(frozen=True)
class Resolved:
    info: MountInfo
    digest: str
    subpath: str  # "" for the volume's root; never absolute, never with ".."


def candidates(source: str) -> list[str]:
    """The source and its parents, deepest first, stopping at the CSI
    volume's mount level (never probing above a volume)."""
    path = os.path.normpath(source)
    found = [path]
    if CSI_DIR not in path.split("/"):
        return found  # not below a CSI volume: only the exact path can match
    while True:
        parts = path.split("/")
        if len(parts) >= 3 and parts[-3] == CSI_DIR and parts[-1] == "mount":
            break  # .../kubernetes.io~csi/<pv>/mount: the volume's own level
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
        found.append(path)
    return found


def resolve(source: str, index: VolumeIndex) -> Resolved | None:
    if not source.startswith("/"):
        return None
    if ".." in source.split("/"):
        raise SubpathEscapes(f"mount source {source!r} contains '..'")
    for probe in candidates(source):
        name = digest(probe)
        info = index.get(name)
        if info is None and (why := index.refusal(name)) is not None:
            raise EntryRefused(why)
        if info is not None:
            subpath = os.path.relpath(os.path.normpath(source), probe)
            return Resolved(info, name, "" if subpath == "." else subpath)
    return None
