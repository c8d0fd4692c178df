"""Impossible answers are refused: a guest's volume stats are checked
against the size of the device the host attached, its cgroup numbers
against the VM's memory, everything against int64. The checks themselves,
its cumulative counters against what it reported before, then forged
answers of a guest's agent (the agent's own ttrpc server on a
unix socket, its stats calls answering what a hostile guest would) through
the host's client: the volume's condition abnormal naming the pod and the
field, the container's stats DATA_LOSS naming them, never INTERNAL."""

from __future__ import annotations


import pytest

from crust.api import agent_pb2
from crust.common.errors import DataLoss
from crust.guest.service import AgentService
from crust.kata.agent import calls, checked_numbers, volume_calls
from tests.harness.guest_serving import serving

MiB = 1 << 20
DEVICE = 32 * MiB
VM_MEMORY = 256 * MiB


def volume(**numbers) -> agent_pb2.VolumeStatsResponse:
    fine = dict(total_bytes=30 * MiB, free_bytes=20 * MiB, available_bytes=18 * MiB, used_bytes=10 * MiB,
                inodes_total=8192, inodes_free=8000, inodes_used=192)
    return agent_pb2.VolumeStatsResponse(**{**fine, **numbers})


def test_a_volumes_stats_that_can_be_pass():
    assert checked_numbers.volume_stats(volume(), DEVICE) == ""
    assert checked_numbers.volume_stats(volume(total_bytes=DEVICE), DEVICE) == ""
    assert checked_numbers.volume_stats(volume(total_bytes=1 << 40, free_bytes=0, available_bytes=0), None) == ""


@pytest.mark.parametrize("numbers, field", [
    (dict(total_bytes=1 << 63), "total_bytes"),
    (dict(used_bytes=(1 << 64) - 1), "used_bytes"),
    (dict(total_bytes=DEVICE + 4096), "total_bytes"),
    (dict(used_bytes=31 * MiB), "used_bytes"),
    (dict(available_bytes=25 * MiB), "available_bytes"),
    (dict(free_bytes=31 * MiB), "free_bytes"),
    (dict(inodes_used=9000), "inodes_used"),
    (dict(inodes_free=1 << 63), "inodes_free"),
], ids=["beyond-int64", "used-max", "over-device", "used-over-total", "available-over-free", "free-over-total",
        "inodes-used", "inodes-free"])
def test_a_volumes_impossible_stats_are_named_by_their_field(numbers, field):
    why = checked_numbers.volume_stats(volume(**numbers), DEVICE)
    assert why.startswith(field), why


def test_a_containers_numbers_are_checked_against_the_vms_memory():
    fine = agent_pb2.StatsContainerResponse(memory_current=100 * MiB, memory_max=1 << 30,
                                            memory_stat={"anon": 50 * MiB, "pgfault": 1 << 40})
    assert checked_numbers.container_stats(fine, VM_MEMORY) == ""
    for forged, field in ((dict(memory_current=(1 << 64) - 1), "memory_current"),
                          (dict(memory_current=VM_MEMORY + 1), "memory_current"),
                          (dict(memory_stat={"file": 1 << 40}), "memory_stat[file]"),
                          (dict(cpu_stat={"usage_usec": 1 << 63}), "cpu_stat[usage_usec]")):
        why = checked_numbers.container_stats(agent_pb2.StatsContainerResponse(**forged), VM_MEMORY)
        assert why.startswith(field), (forged, why)


def stats(**counters) -> agent_pb2.StatsContainerResponse:
    return agent_pb2.StatsContainerResponse(memory_current=MiB, **counters)


def test_counters_never_go_below_what_the_same_cgroup_reported():
    floors = checked_numbers.CounterFloors()
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 100, "nr_periods": 3}, memory_events={"oom": 1})) == ""
    # Growing or equal: fine; a gauge (memory, pids) may go down.
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 150, "nr_periods": 3}, memory_events={"oom": 1})) == ""
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 149})) == \
        "cpu_stat[usage_usec] 149 is less than the 150 it reported before"
    assert floors.check("c1", stats(memory_events={"oom": 0})) == \
        "memory_events[oom] 0 is less than the 1 it reported before"
    # A refused answer does not lower the floor; each cgroup has its own.
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 149})) != ""
    assert floors.check("c2", stats(cpu_stat={"usage_usec": 1})) == ""
    # A key that is no counter is not held to one.
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 150, "unknown": 1})) == ""
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 150, "unknown": 0})) == ""
    # Forgotten with its container: the floors of a pod whose containers
    # come and go do not pile up.
    for n in range(100):
        floors.check(f"restart-{n}", stats(cpu_stat={"usage_usec": n}))
        floors.forget(f"restart-{n}")
    assert len(floors) == 2
    floors.forget("c1")
    assert floors.check("c1", stats(cpu_stat={"usage_usec": 1})) == ""


class Forging(AgentService):
    """A guest's agent whose stats answers are whatever it likes."""

    volume = volume()
    cgroup = agent_pb2.StatsContainerResponse()

    async def VolumeStats(self, request, call):
        return self.volume

    async def StatsContainer(self, request, call):
        return self.cgroup


async def test_forged_answers_are_refused_naming_the_pod_and_the_field(tmp_path):
    service = Forging()
    async with serving(tmp_path, service) as (client, _):
        mount_point = "/run/pod/volumes/v1"
        fine = await volume_calls.stats(client, mount_point, False, DEVICE, "pod p1")
        assert not fine.condition.abnormal and fine.usage[0].total == 30 * MiB
        service.volume = volume(total_bytes=1 << 63, used_bytes=1 << 63)
        refused = await volume_calls.stats(client, mount_point, False, DEVICE, "pod p1")
        assert refused.usage == [] and refused.condition.abnormal
        assert "pod p1" in refused.condition.message and "total_bytes" in refused.condition.message
        service.volume = volume(total_bytes=DEVICE * 4)
        refused = await volume_calls.stats(client, mount_point, False, DEVICE, "pod p1")
        assert refused.condition.abnormal and "its device's 33554432 bytes" in refused.condition.message

        service.cgroup = agent_pb2.StatsContainerResponse(memory_current=(1 << 64) - 1)
        floors = checked_numbers.CounterFloors()
        with pytest.raises(DataLoss) as lost:
            await calls.container_stats(client, "c1", VM_MEMORY, floors)
        assert "container c1" in lost.value.message and "memory_current" in lost.value.message
        service.cgroup = agent_pb2.StatsContainerResponse(memory_current=10 * MiB, cpu_stat={"usage_usec": 500})
        assert (await calls.container_stats(client, "c1", VM_MEMORY, floors)).memory_current == 10 * MiB
        # A counter that went back is refused, naming it and what was reported before.
        service.cgroup = agent_pb2.StatsContainerResponse(memory_current=10 * MiB, cpu_stat={"usage_usec": 400})
        with pytest.raises(DataLoss) as lost:
            await calls.container_stats(client, "c1", VM_MEMORY, floors)
        assert "cpu_stat[usage_usec] 400 is less than the 500 it reported before" in lost.value.message
