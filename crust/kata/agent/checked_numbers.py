"""What a guest reports is checked against what the host knows before it
reaches kubelet: the guest is not trusted to answer numbers that can be.

- a volume's stats: capacity at most the size of the device the host
  attached, used and available at most the capacity, inodes used and free
  at most their total, every number within int64 (CSI's VolumeUsage);
- a container's cgroup numbers: its memory (memory.current and the byte
  counts of memory.stat) at most the VM's memory, every number within int64,
  and its cumulative counters (cpu.stat's times and counts, memory.events)
  never below what the same cgroup reported before (CounterFloors).

Each check answers "" or why the answer cannot be, naming the field. A
volume's impossible stats become its condition (abnormal, with the reason:
kubelet reports it) with no usage; a container's become DATA_LOSS naming
the pod and the field.
"""

from __future__ import annotations

from crust.api import agent_pb2

INT64_MAX = (1 << 63) - 1
# memory.stat's byte counts (cgroup v2); its other keys count events or pages.
MEMORY_BYTES = frozenset({
    "anon", "file", "kernel", "kernel_stack", "pagetables", "sec_pagetables", "percpu", "sock", "vmalloc",
    "shmem", "zswap", "zswapped", "file_mapped", "file_dirty", "file_writeback", "swapcached", "anon_thp",
    "file_thp", "shmem_thp", "inactive_anon", "active_anon", "inactive_file", "active_file", "unevictable",
    "slab_reclaimable", "slab_unreclaimable", "slab"})


def volume_stats(s: agent_pb2.VolumeStatsResponse, device_bytes: int | None) -> str:
    """Why the guest's stats of a volume on a device of device_bytes
    (None: unknown) cannot be; "" when they can."""
    for field in ("total_bytes", "free_bytes", "available_bytes", "used_bytes", "inodes_total",
                  "inodes_free", "inodes_used"):
        value = getattr(s, field)
        if value > INT64_MAX:
            return f"{field} {value} is beyond int64"
    if device_bytes is not None and s.total_bytes > device_bytes:
        return f"total_bytes {s.total_bytes} is more than its device's {device_bytes} bytes"
    for field in ("used_bytes", "free_bytes", "available_bytes"):
        if getattr(s, field) > s.total_bytes:
            return f"{field} {getattr(s, field)} is more than total_bytes {s.total_bytes}"
    if s.available_bytes > s.free_bytes:
        return f"available_bytes {s.available_bytes} is more than free_bytes {s.free_bytes}"
    for field in ("inodes_used", "inodes_free"):
        if getattr(s, field) > s.inodes_total:
            return f"{field} {getattr(s, field)} is more than inodes_total {s.inodes_total}"
    return ""


def container_stats(s: agent_pb2.StatsContainerResponse, vm_memory_bytes: int) -> str:
    """Why the guest's cgroup numbers of a container in a VM of
    vm_memory_bytes cannot be; "" when they can."""
    for field in ("memory_current", "memory_max", "pids_current", "pids_max"):
        value = getattr(s, field)
        if value > INT64_MAX:
            return f"{field} {value} is beyond int64"
    for name, numbers in (("cpu_stat", s.cpu_stat), ("memory_stat", s.memory_stat),
                          ("memory_events", s.memory_events)):
        for key, value in sorted(numbers.items()):
            if value > INT64_MAX:
                return f"{name}[{key}] {value} is beyond int64"
    if s.memory_current > vm_memory_bytes:
        return f"memory_current {s.memory_current} is more than the VM's memory, {vm_memory_bytes} bytes"
    for key in sorted(MEMORY_BYTES & set(s.memory_stat)):
        if s.memory_stat[key] > vm_memory_bytes:
            return f"memory_stat[{key}] {s.memory_stat[key]} is more than the VM's memory, {vm_memory_bytes} bytes"
    return ""


# The cumulative counters of a cgroup (v2): they only grow while it lives.
COUNTERS = {
    "cpu_stat": frozenset({"usage_usec", "user_usec", "system_usec", "nr_periods", "nr_throttled",
                           "throttled_usec", "nr_bursts", "burst_usec"}),
    "memory_events": frozenset({"low", "high", "max", "oom", "oom_kill", "oom_group_kill"}),
}


class CounterFloors:
    """A pod's cgroups' counters as last reported, by container id ("": the
    pod's): an answer with a counter below its floor cannot be. One entry a
    live container, removed with it (forget), so the floors of a pod whose
    containers are restarted again and again do not pile up."""

    def __init__(self) -> None:
        self._floors: dict[str, dict[str, int]] = {}

    def check(self, container_id: str, s: agent_pb2.StatsContainerResponse) -> str:
        """Why the answer's counters cannot be ("" when they can); an answer
        that can be raises the floors."""
        floors = self._floors.get(container_id, {})
        now = {f"{name}[{key}]": value for name, keys in COUNTERS.items()
               for key, value in getattr(s, name).items() if key in keys}
        for field, value in sorted(now.items()):
            if value < floors.get(field, 0):
                return f"{field} {value} is less than the {floors[field]} it reported before"
        self._floors[container_id] = {**floors, **now}
        return ""

    def forget(self, container_id: str) -> None:
        self._floors.pop(container_id, None)

    def __len__(self) -> int:
        return len(self._floors)
