"""The shim's task service's metrics (crust.containerd_shim.task)."""

from __future__ import annotations


def test_cgroup_numbers_become_containerds_cgroup_v2_metrics():
    from crust.api import handler_pb2
    from crust.containerd_shim.task import CGROUP_V2_METRICS_TYPE, cgroup_metrics

    response = handler_pb2.ContainerStatsResponse(
        cpu={"usage_usec": 1500, "user_usec": 1000, "system_usec": 500, "new_key": 7},
        memory={"anon": 4096, "inactive_file": 8192}, memory_current=65536, memory_max=0,
        memory_events={"oom_kill": 1, "max": 3}, pids_current=2, pids_max=100, timestamp_ns=1)
    metrics = cgroup_metrics(response)
    assert (metrics.cpu.usage_usec, metrics.cpu.user_usec, metrics.cpu.system_usec) == (1500, 1000, 500)
    assert (metrics.memory.usage, metrics.memory.anon, metrics.memory.inactive_file) == (65536, 4096, 8192)
    assert (metrics.pids.current, metrics.pids.limit, metrics.memory_events.oom_kill) == (2, 100, 1)
    assert CGROUP_V2_METRICS_TYPE == metrics.DESCRIPTOR.full_name
