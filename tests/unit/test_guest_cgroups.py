"""StatsContainer: the guest agent's answer from a container's cgroup v2
files, run on the host without a VM (this host's cgroups are v1: the pod's
cgroup is a directory of the same files, written by the test). Through VMs
the same call answers CRI's ContainerStats and tells an OOM kill
(tests/vm/test_pod_streams.py, critest)."""

from __future__ import annotations

import asyncio

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.guest.service import AgentService
from tests.harness.guest_serving import serving

CPU_STAT = "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n"
MEMORY_EVENTS = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n"


@pytest.fixture
def pod_cgroup(tmp_path):
    sys_fs_cgroup = tmp_path / "cgroup"
    pod = sys_fs_cgroup / "crust"
    (pod / "ctr-1").mkdir(parents=True)
    (pod / "empty").mkdir()
    (sys_fs_cgroup / "cgroup.controllers").write_text("cpu memory pids\n")
    for cgroup, current in ((pod, 8 << 20), (pod / "ctr-1", 4 << 20)):
        (cgroup / "cpu.stat").write_text(CPU_STAT)
        (cgroup / "memory.stat").write_text("anon 4096\nfile 8192\n")
        (cgroup / "memory.events").write_text(MEMORY_EVENTS)
        (cgroup / "memory.current").write_text(f"{current}\n")
        (cgroup / "pids.current").write_text("3\n")
    (pod / "memory.max").write_text("max\n")
    (pod / "ctr-1" / "memory.max").write_text(f"{64 << 20}\n")
    (pod / "ctr-1" / "pids.max").write_text("max\n")
    return pod


def test_a_containers_cgroup_numbers_and_the_pods_come_back_as_written(tmp_path, pod_cgroup):
    async def scenario():
        async with serving(tmp_path, AgentService(pod_cgroup=str(pod_cgroup))) as (client, details):
            assert "stats.cgroup2" in details.capabilities
            one = await client.call("StatsContainer", agent_pb2.StatsContainerRequest(container_id="ctr-1"),
                                    timeout=10)
            assert dict(one.cpu_stat) == {"usage_usec": 1500, "user_usec": 1000, "system_usec": 500,
                                          "nr_periods": 0}
            assert dict(one.memory_stat) == {"anon": 4096, "file": 8192}
            assert one.memory_events["oom_kill"] == 1 and one.memory_events["max"] == 3
            assert (one.memory_current, one.memory_max, one.pids_current, one.pids_max) == (4 << 20, 64 << 20, 3, 0)
            assert one.timestamp_ns > 0
            pod = await client.call("StatsContainer", agent_pb2.StatsContainerRequest(container_id=""), timeout=10)
            assert (pod.memory_current, pod.memory_max) == (8 << 20, 0)

            for container_id, code in (("gone", ttrpc.NOT_FOUND), ("../crust", ttrpc.INVALID_ARGUMENT),
                                       ("empty", ttrpc.FAILED_PRECONDITION)):
                with pytest.raises(TtrpcError) as refused:
                    await client.call("StatsContainer", agent_pb2.StatsContainerRequest(container_id=container_id),
                                      timeout=10)
                assert refused.value.code == code and "container_id" in refused.value.message

    asyncio.run(scenario())


def test_a_guest_without_cgroup_v2_does_not_offer_stats(tmp_path):
    async def scenario():
        async with serving(tmp_path, AgentService(pod_cgroup=str(tmp_path / "none" / "crust"))) as (_, details):
            assert "stats.cgroup2" not in details.capabilities

    asyncio.run(scenario())
