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
from crust.contract.mountinfo import PLACEHOLDER_SOURCE, MountInfo, digest
from crust.runtime_handler.index import VolumeIndex
from crust.sys import mount as sysmount

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


def pod_volumes(pod_uid: str, index: VolumeIndex) -> list[Resolved]:
    """The deferred volumes kubelet published for a pod, as indexed now:
    the entries at .../pods/<pod_uid>/volumes/kubernetes.io~csi/<pv>/mount
    (a volume's own level; a subPath is bound from it later)."""
    found = []
    for name, info in index.items():
        parts = os.path.normpath(info.target_path).split("/")
        if len(parts) >= 6 and parts[-1] == "mount" and parts[-3] == CSI_DIR and parts[-4] == "volumes" \
                and parts[-5] == pod_uid and parts[-6] == "pods":
            found.append(Resolved(info, name, ""))
    return sorted(found, key=lambda r: r.info.target_path)


def placeholder_at(path: str) -> str | None:
    """Where the shim's placeholder is mounted, when path lies on it."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        entry = sysmount.entry_of(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    if entry is not None and entry.fs_type == "tmpfs" and entry.source == PLACEHOLDER_SOURCE:
        return entry.mount_point
    return None


def refuse_link_to_deferred(source: str, index: VolumeIndex) -> None:
    """A deferred volume is reached only by the path it was published at.
    A bind source whose way crosses a symbolic link and ends in a deferred
    volume (an entry names its real path or a parent, or the shim's
    placeholder is what it lands on) is refused: the bind would follow the
    link and hand another pod's volume, or its empty placeholder, to this
    one (FailedPrecondition naming both paths)."""
    if not source.startswith("/"):
        return
    real = os.path.realpath(source)
    if real == os.path.normpath(source):
        return  # no link on the way: resolved by its text
    volume = next((probe for probe in candidates(real) if index.get(digest(probe)) is not None), None)
    volume = volume or placeholder_at(real)
    if volume is not None:
        raise FailedPrecondition(
            f"mount source {source} leads through a symbolic link to {real}, the deferred volume {volume}: a "
            "deferred volume is mounted only from the path it was published at, and its placeholder is never bound")
