"""What a guest reports is checked against what the host knows before it
reaches kubelet: the guest is not trusted to answer numbers that can be.

- a volume's stats: capacity at most the size of the device the host
  attached, used and available at most the capacity, inodes used and free
  at most their total, every number within int64 (CSI's VolumeUsage);
- a container's cgroup numbers: its memory (memory.current and the byte
  counts of memory.stat) at most the VM's memory, every number within int64.

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
