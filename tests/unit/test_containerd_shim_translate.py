"""The shim's task service (crust.containerd_shim.task): a process's spec
from an OCI process and a container's metrics."""

from __future__ import annotations

import pytest

from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.containerd_shim.translate import process_spec


def test_cgroup_numbers_become_containerds_cgroup_v2_metrics():
    from crust.api import handler_pb2
    from crust.containerd_shim.translate import CGROUP_V2_METRICS_TYPE, cgroup_metrics

    response = handler_pb2.ContainerStatsResponse(
        cpu={"usage_usec": 1500, "user_usec": 1000, "system_usec": 500, "new_key": 7},
        memory={"anon": 4096, "inactive_file": 8192}, memory_current=65536, memory_max=0,
        memory_events={"oom_kill": 1, "max": 3}, pids_current=2, pids_max=100, timestamp_ns=1)
    metrics = cgroup_metrics(response)
    assert (metrics.cpu.usage_usec, metrics.cpu.user_usec, metrics.cpu.system_usec) == (1500, 1000, 500)
    assert (metrics.memory.usage, metrics.memory.anon, metrics.memory.inactive_file) == (65536, 4096, 8192)
    assert (metrics.pids.current, metrics.pids.limit, metrics.memory_events.oom_kill) == (2, 100, 1)
    assert CGROUP_V2_METRICS_TYPE == metrics.DESCRIPTOR.full_name


def test_process_spec_from_an_oci_process():
    spec = process_spec({"args": ["df", "-k", "/data"], "env": ["A=1"], "cwd": "/work",
                         "user": {"uid": 1000, "gid": 2000, "additionalGids": [3000]}})
    assert (list(spec.args), list(spec.env), spec.cwd, spec.uid, spec.gid, list(spec.additional_gids)) == (
        ["df", "-k", "/data"], ["A=1"], "/work", 1000, 2000, [3000])
    assert process_spec({"args": ["true"]}).cwd == "/"
    on_terminal = process_spec({"args": ["sh"], "terminal": True}, stdin=True)
    assert on_terminal.terminal and on_terminal.stdin
    for broken, field in [({}, "spec.args"), ({"args": []}, "spec.args"), ({"args": [1]}, "spec.args"),
                          ({"args": ["x"], "env": "A=1"}, "spec.env"),
                          ({"args": ["x"], "user": {"uid": "root"}}, "spec.user")]:
        with pytest.raises(TtrpcError) as caught:
            process_spec(broken)
        assert caught.value.code == ttrpc.INVALID_ARGUMENT and field in caught.value.message
