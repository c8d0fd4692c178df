"""What a microVM container's binds are, decided from its OCI spec before
anything is touched: each bind a deferred volume the guest mounts, a
tmpfs of the pod in the guest, or a host path given through a share
(crust.kata.pod.containers then makes each ready and the guest's agent
places it, crust.guest.places).

plan() is a pure function of the spec's mounts and of what the host said
of each source (SourceFacts, gathered first by the caller: the volume the
runtime handler resolves it to, whether it exists and where its links
lead, the emptyDir of medium Memory it is), so every decision and refusal
is tested without a VM. Refusals name the mount by its destination, as
the pod's spec does, and carry the status CRI gives the user:
InvalidArgument for a spec that can never work, FailedPrecondition for
a source that is not there (yet).

placement() is the other end: what CreateContainer names beside the spec
once the sources are ready; in_pod_terms() says the agent's refusal of a
bind in the spec's words.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from google.protobuf import json_format

from crust.api import agent_pb2
from crust.common.errors import CrustError, FailedPrecondition, InvalidArgument
from crust.kata.agent.calls import SHM_TMPFS
from crust.runtime_handler.resolve import CSI_DIR
from crust.sys import mount as mounts

log = logging.getLogger("crust.kata.pod.pods")

# Mounts the OCI spec lists that the guest gives the container itself
# (/proc, /dev) or that a VM has no use for.
PSEUDO_TYPES = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "shm"}
# kubelet's directories (crust/kubelet/volumes.py has the layout).
EMPTY_DIR = "kubernetes.io~empty-dir"
SUBPATHS = "volume-subpaths"
BIND_REFUSAL = re.compile(r"binds\[(\d+)\]\.source(?:\.[a-z_]+)*: (?:subpath [^:]*: )?(.*)$")

VOLUME, TMPFS, HOST = "volume", "tmpfs", "host"


@dataclass(frozen=True)
class SourceFacts:
    """What the host says of one bind's source."""

    volume: Any = None          # the runtime handler's Resolved deferred (or direct) volume, or None
    direct: bool = False        # a Kata direct volume, not one of the proxy's
    exists: bool = False        # the source itself (a link counts, wherever it leads)
    real: str = ""              # where its links lead
    memory: tuple[str, str, str] | None = None   # an emptyDir of medium Memory: (name, subpath, size)


class PlannedBind(NamedTuple):
    """One bind of the spec: kind VOLUME (what: (Resolved, direct)), TMPFS
    (what: the pod tmpfs's name, a subpath in it, its size) or HOST (what:
    None, a bind through a share)."""

    mount: Any
    kind: str
    what: Any


def is_bind(m) -> bool:
    return m.type == "bind" or "bind" in m.options or "rbind" in m.options


def bind_sources(spec_mounts) -> list[str]:
    """The sources plan() needs facts of, each bind's; a relative one is
    refused here, before any is looked at (InvalidArgument naming it)."""
    sources = []
    for m in spec_mounts:
        if is_bind(m):
            _absolute(m)
            sources.append(m.source)
    return sources


def _absolute(m) -> None:
    if not m.source.startswith("/"):
        raise InvalidArgument(f"mount {m.destination}: source {m.source!r} must be an absolute path")


def plan(spec_mounts, facts: Mapping[str, SourceFacts]) -> list[PlannedBind]:
    """The spec's binds in its order, each with what it is. Refused before
    anything is made: a relative source, a source that does not exist, and
    a host path whose links lead to a CSI volume's path (a deferred
    volume's target or its placeholder reaches a container only as the
    volume, through its claim)."""
    binds = []
    for m in spec_mounts:
        if not is_bind(m):
            if m.type not in PSEUDO_TYPES:
                log.info("mount type not given to a guest container", extra={"fields": {
                    "destination": m.destination, "type": m.type}})
            continue
        _absolute(m)
        fact = facts[m.source]
        if fact.volume is not None:
            binds.append(PlannedBind(m, VOLUME, (fact.volume, fact.direct)))
            continue
        if not fact.exists:
            raise FailedPrecondition(f"mount {m.destination}: source {m.source} does not exist")
        if CSI_DIR in fact.real.split("/"):
            raise InvalidArgument(f"mount {m.destination}: source {m.source} leads to a CSI volume's path "
                                  f"({fact.real}); a CSI volume is mounted by its own path only")
        if m.destination == "/dev/shm":
            binds.append(PlannedBind(m, TMPFS, (SHM_TMPFS, "", "")))
        elif fact.memory is not None:
            binds.append(PlannedBind(m, TMPFS, fact.memory))
        else:
            binds.append(PlannedBind(m, HOST, None))
    return binds


def host_facts(source: str) -> SourceFacts:
    """What the host's file system and mount table say of a source that is
    no volume."""
    return SourceFacts(exists=os.path.lexists(source), real=os.path.realpath(source),
                       memory=memory_empty_dir(source))


def _tmpfs_size(entry) -> str:
    return next((o.split("=", 1)[1] for o in entry.super_options if o.startswith("size=")), "")


def memory_empty_dir(source: str) -> tuple[str, str, str] | None:
    """(name, subpath, size) when source is an emptyDir of medium Memory (a
    tmpfs kubelet mounted at pods/<uid>/volumes/kubernetes.io~empty-dir/<name>)
    or kubelet's bind of a subPath of one (pods/<uid>/volume-subpaths/<name>/
    <container>/<index>, a bind of a directory in that tmpfs); size is the
    tmpfs's size= option (kubelet's sizeLimit or the node's bound), which
    the guest's tmpfs keeps."""
    parts = source.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] != "pods":
            continue
        pod_dir, rest = "/".join(parts[: i + 1]), parts[i + 1:]
        if len(rest) >= 3 and rest[0] == "volumes" and rest[1] == EMPTY_DIR:
            top = mounts.at(f"{pod_dir}/volumes/{EMPTY_DIR}/{rest[2]}")
            if top is not None and top.fs_type == "tmpfs":
                return rest[2], "/".join(rest[3:]), _tmpfs_size(top)
        elif len(rest) == 4 and rest[0] == SUBPATHS:
            top = mounts.at(f"{pod_dir}/volumes/{EMPTY_DIR}/{rest[1]}")
            bound = mounts.at(source)
            if (top is not None and bound is not None and top.fs_type == "tmpfs"
                    and (bound.major, bound.minor) == (top.major, top.minor)):
                inside = os.path.relpath(bound.root, top.root)
                if inside == ".." or inside.startswith("../"):
                    return None
                return rest[1], "" if inside == "." else inside, _tmpfs_size(top)
        return None
    return None


def placement(spec: dict, rootfs: agent_pb2.SharePath, sources: list[tuple[agent_pb2.Source, bool]],
              pod_pid_namespace: bool) -> dict:
    """What CreateContainer names of a container beside its spec (the root
    in the share, each bind's source and mode, in the spec's order of its
    binds, the pod's PID namespace), as a record keeps it."""
    indexes = [i for i, m in enumerate(spec.get("mounts") or []) if m.get("type") == "bind"]
    if len(indexes) != len(sources):
        raise ValueError(f"{len(indexes)} binds in the spec, {len(sources)} sources given")
    request = agent_pb2.CreateContainerRequest(
        rootfs=agent_pb2.Source(share=rootfs), pod_pid_namespace=pod_pid_namespace,
        binds=[agent_pb2.Bind(mount_index=i, source=source, readonly=readonly)
               for i, (source, readonly) in zip(indexes, sources)])
    return json_format.MessageToDict(request, preserving_proto_field_name=True)


def in_pod_terms(error: CrustError, bind_names: list[str]) -> CrustError:
    """The agent's refusal of a bind (binds[i].source...: why) said as the
    pod's spec says the mount (mount /data: subPath 'x' of the emptyDir
    cache: why); other errors as they are."""
    found = BIND_REFUSAL.search(error.message)
    if found is None or int(found.group(1)) >= len(bind_names):
        return error
    return type(error)(f"{bind_names[int(found.group(1))]}: {found.group(2)}")
