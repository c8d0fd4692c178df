"""A container's cgroup v2 numbers in the guest, as StatsContainer answers
them: the cgroup crust gives each container below the pod's
(/sys/fs/cgroup/crust/<container id>, which outlives crun's own cgroup
until the container is removed, so an OOM kill still shows after its
exit), or for container id "" the pod's cgroup above them all."""

from __future__ import annotations

import os
import time

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.errors import AgentError, check_id

POD_CGROUP = "/sys/fs/cgroup/crust"
KEYED = {"cpu.stat": "cpu_stat", "memory.stat": "memory_stat", "memory.events": "memory_events"}
SINGLE = {"memory.current": "memory_current", "memory.max": "memory_max", "pids.current": "pids_current",
          "pids.max": "pids_max"}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _number(word: str) -> int:
    """A cgroup value; "max" (no limit) is 0."""
    return 0 if word == "max" else int(word)


def available(root: str = POD_CGROUP) -> bool:
    """Whether the guest has cgroup v2 where crust puts its containers."""
    return os.path.exists(os.path.join(os.path.dirname(root), "cgroup.controllers"))


def stats(container_id: str, root: str = POD_CGROUP) -> agent_pb2.StatsContainerResponse:
    check_id("container_id", container_id, empty_ok=True)
    cgroup = os.path.join(root, container_id) if container_id else root
    if not os.path.isdir(cgroup):
        raise AgentError(ttrpc.NOT_FOUND, f"container_id {container_id!r}: no cgroup in the guest")
    answer = agent_pb2.StatsContainerResponse(timestamp_ns=time.time_ns())
    found = False
    for name, field in KEYED.items():
        text = _read(os.path.join(cgroup, name))
        if text is None:
            continue
        found = True
        values = getattr(answer, field)
        for line in text.splitlines():
            words = line.split()
            if len(words) == 2 and words[1].isdigit():
                values[words[0]] = int(words[1])
    for name, field in SINGLE.items():
        text = _read(os.path.join(cgroup, name))
        if text is not None and (text.strip().isdigit() or text.strip() == "max"):
            found = True
            setattr(answer, field, _number(text.strip()))
    if not found:
        raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id {container_id!r}: its cgroup has no cpu, "
                                                   "memory or pids files")
    return answer


def signal_all(container_id: str, number: int, root: str = POD_CGROUP) -> int:
    """Every process in the container's cgroup and below it signalled (for
    SIGKILL, by the cgroup's cgroup.kill: a fork meanwhile is caught too);
    how many were there. 0 counts them."""
    check_id("container_id", container_id)
    top = os.path.join(root, container_id)
    pids = [int(word) for directory, _, _ in os.walk(top)
            for word in (_read(os.path.join(directory, "cgroup.procs")) or "").split()]
    kill = os.path.join(top, "cgroup.kill")
    if number == 9 and os.path.exists(kill):
        try:
            with open(kill, "w") as f:
                f.write("1")
            return len(pids)
        except FileNotFoundError:
            return 0   # removed meanwhile: nothing was left in it
    count = 0
    for pid in pids:
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            continue
        count += 1
    return count
