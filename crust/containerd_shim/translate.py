"""What the shim translates between containerd's task API and the microVM
handler's PodRuntime (specs/handler.proto): a bundle's config.json read
and checked, an OCI process as a ProcessSpec, the guest's cgroup numbers as
containerd's cgroup v2 metrics.
Every malformed input is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

from crust.api import containerd_cgroups_v2_pb2 as cgroups_v2
from crust.api import handler_pb2
from crust.common import cri_annotations, ttrpc
from crust.common.ttrpc import TtrpcError

# What containerd's CRI unpacks Task.Stats into (the message's full name).
CGROUP_V2_METRICS_TYPE = "io.containerd.cgroups.v2.Metrics"


def bad(message: str) -> TtrpcError:
    return TtrpcError(ttrpc.INVALID_ARGUMENT, message)


def checked_create(request):
    """A CreateTaskRequest with an id and an absolute bundle, else INVALID_ARGUMENT."""
    if not request.id:
        raise bad("id: the container id is empty")
    if not request.bundle or not os.path.isabs(request.bundle):
        raise bad(f"bundle: an absolute path is needed, not {request.bundle!r}")
    return request


def read_config(bundle: str) -> dict:
    try:
        with open(Path(bundle) / "config.json") as handle:
            config = json.load(handle)
    except FileNotFoundError:
        raise bad(f"bundle {bundle} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise bad(f"bundle {bundle}: config.json does not read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise bad(f"bundle {bundle}: config.json is not an object")
    return config


def is_sandbox(config: dict) -> bool:
    # Without CRI's annotations (ctr run) a container is a pod of its own.
    return cri_annotations.container_type(config) == cri_annotations.SANDBOX


def process_spec(spec: dict, stdin: bool = False) -> handler_pb2.ProcessSpec:
    """An OCI process (config.json's "process", an exec's spec) as
    PodRuntime's ProcessSpec; stdin: containerd gave it a standard input."""
    if not isinstance(spec, dict):
        raise bad("spec: the process is not a JSON object")
    args = spec.get("args")
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise bad("spec.args: a process needs a non-empty list of strings")
    env = spec.get("env") or []
    if not isinstance(env, list) or not all(isinstance(e, str) for e in env):
        raise bad("spec.env: a list of KEY=value strings")
    user = spec.get("user") or {}
    if not isinstance(user, dict):
        raise bad("spec.user: not an object")
    try:
        uid, gid = int(user.get("uid", 0)), int(user.get("gid", 0))
        groups = [int(g) for g in user.get("additionalGids") or []]
    except (TypeError, ValueError):
        raise bad("spec.user: uid, gid and additionalGids are numbers") from None
    return handler_pb2.ProcessSpec(args=args, env=env, cwd=str(spec.get("cwd") or "/"), uid=uid, gid=gid,
                                   additional_gids=groups, terminal=bool(spec.get("terminal")), stdin=stdin)


def cgroup_metrics(numbers: handler_pb2.ContainerStatsResponse) -> cgroups_v2.Metrics:
    """The guest's cgroup files (ContainerStats) as containerd's cgroup v2 metrics."""
    stat = {k: v for k, v in _known(cgroups_v2.MemoryStat, numbers.memory).items() if k not in ("usage", "usage_limit")}
    memory = cgroups_v2.MemoryStat(usage=numbers.memory_current, usage_limit=numbers.memory_max, **stat)
    cpu = cgroups_v2.CPUStat(**_known(cgroups_v2.CPUStat, numbers.cpu))
    memory_events = cgroups_v2.MemoryEvents(**_known(cgroups_v2.MemoryEvents, numbers.memory_events))
    return cgroups_v2.Metrics(pids=cgroups_v2.PidsStat(current=numbers.pids_current, limit=numbers.pids_max),
                              cpu=cpu, memory=memory, memory_events=memory_events)


def _known(message, values) -> dict:
    """The values that message has a field for (a newer kernel writes keys it has not)."""
    return {k: v for k, v in values.items() if k in message.DESCRIPTOR.fields_by_name}
