"""A pod's guest memory: sized from what the CRI runtime says of the pod,
between the node's floor and ceiling, and given to a running VM by
hot-plugging a DIMM.

What the CRI says: kubelet's RunPodSandbox carries the pod's resources
(LinuxPodSandboxConfig.resources: the sum of its containers' limits) and
overhead (LinuxPodSandboxConfig.overhead: its RuntimeClass's). Each runtime
hands them to the sandbox's spec in annotations of its own:
- containerd: `io.kubernetes.cri.sandbox-memory`, the limits in bytes (0:
  no container has one); the overhead is not passed on;
- CRI-O: `pod-linux-resources.crio.io` and `pod-linux-overhead.crio.io`
  (`io.kubernetes.cri-o.PodLinuxResources` / `PodLinuxOverhead` before),
  the CRI's messages as JSON (`memory_limit_in_bytes`).

The guest's size is the containers' limits plus what the guest keeps for
itself (its kernel, the agent, the page cache): the pod's overhead when the
CRI names one above the floor, else the floor. A pod without limits gets
the floor; no pod gets more than the ceiling, whatever its annotations say.

Every VM starts with the floor (booted, taken from the pool or restored
from the template alike: a template has one size) and room for one DIMM
up to the ceiling (`-m floor,slots=1,maxmem=ceiling`). A pod that wants
more gets the difference, in whole 128 MiB blocks (the guest kernel's
memory block: a part of one is never onlined), as one pc-dimm backed by a
shared memfd (virtiofsd maps all of the guest's RAM); the guest's kernel
onlines it by itself (memhp_default_state=online), a memory block at a time:
the DIMM is placed past the guest root's virtio-pmem (the other device in
that space) at an address aligned to the guest's block, which the kernel
sizes by the end of the boot memory (the largest power of two up to 2 GiB
that it is a multiple of; at least 128 MiB), else no block of it is whole.
The pod's /dev/shm is
then resized to half of the new total, and every Memory emptyDir mounted
after is bounded by it the same way (crust.guest.places).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from crust.api import agent_pb2
from crust.common import cri_annotations, ttrpc
from crust.common.errors import InvalidArgument, Unavailable
from crust.kata.agent import calls
from crust.kata.agent.calls import SHM_TMPFS
from crust.kata.vmm.config import BLOCK_MIB, MIB
from crust.kata.vmm.qmp import QmpError, QmpGone, QmpTimeout

log = logging.getLogger(__name__)

DIMM_ID, BACKEND_ID = "podmem", "podmem-ram"
CONTAINERD_MEMORY = "io.kubernetes.cri.sandbox-memory"
CRIO_RESOURCES = ("pod-linux-resources.crio.io", "io.kubernetes.cri-o.PodLinuxResources")
CRIO_OVERHEAD = ("pod-linux-overhead.crio.io", "io.kubernetes.cri-o.PodLinuxOverhead")
# How long the guest may take to online a DIMM (seconds under emulation).
ONLINE_TIMEOUT = 60.0


def _bytes(field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"{field}: {value!r} is no number of bytes")
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgument(f"{field}: {value!r} is no number of bytes") from None
    if number < 0:
        raise InvalidArgument(f"{field}: {number} bytes is below 0")
    return number


def _crio_memory(annotations: dict, keys: tuple[str, ...]) -> int:
    for key in keys:
        text = annotations.get(key)
        if not isinstance(text, str) or not text or text == "null":
            continue
        try:
            message = json.loads(text)
        except ValueError:
            raise InvalidArgument(f"annotations[{key}]: not JSON") from None
        if not isinstance(message, dict):
            raise InvalidArgument(f"annotations[{key}]: not a JSON object")
        return _bytes(f"annotations[{key}].memory_limit_in_bytes", message.get("memory_limit_in_bytes", 0))
    return 0


def requested(spec: dict) -> tuple[int, int]:
    """(the containers' limits, the pod's overhead) in bytes, as the CRI
    runtime that wrote the sandbox's spec gives them (0: none given)."""
    annotations = cri_annotations.annotations_of(spec)
    if cri_annotations.keys_of(annotations) is cri_annotations.CRIO:
        return _crio_memory(annotations, CRIO_RESOURCES), _crio_memory(annotations, CRIO_OVERHEAD)
    value = annotations.get(CONTAINERD_MEMORY)
    return (_bytes(f"annotations[{CONTAINERD_MEMORY}]", value) if value not in (None, "") else 0), 0


def check_bounds(floor_mib: int, ceiling_mib: int) -> None:
    if ceiling_mib < floor_mib:
        raise ValueError(f"the guest memory's ceiling ({ceiling_mib} MiB) is below its floor ({floor_mib} MiB)")


def guest_mib(limits: int, overhead: int, floor_mib: int, ceiling_mib: int) -> int:
    """The guest's memory for a pod: the floor plus whole blocks, at most
    the ceiling's."""
    check_bounds(floor_mib, ceiling_mib)
    wanted = limits + max(overhead, floor_mib * MIB)
    extra = max(0, wanted - floor_mib * MIB)
    blocks = -(-extra // (BLOCK_MIB * MIB))
    room = (ceiling_mib - floor_mib) // BLOCK_MIB
    return floor_mib + min(blocks, room) * BLOCK_MIB


def block_bytes(floor_mib: int) -> int:
    """The guest kernel's memory block for a boot memory of floor_mib: the
    largest power of two, 128 MiB to 2 GiB, that the memory's end is a
    multiple of (x86's rule in a VM)."""
    end = floor_mib * MIB
    size = 2 << 30
    while size > BLOCK_MIB * MIB and end % size:
        size //= 2
    return size


async def dimm_address(vm, floor_mib: int) -> int | None:
    """Where the pod's DIMM goes: past every memory device the VM has (the
    guest root), aligned to the guest's memory block; None (QEMU's choice)
    when it has none."""
    devices = await vm.qmp.execute("query-memory-devices") or []
    ends = [int(d["data"]["memaddr"]) + int(d["data"]["size"]) for d in devices
            if isinstance(d.get("data"), dict) and "memaddr" in d["data"] and "size" in d["data"]]
    if not ends:
        return None
    block = block_bytes(floor_mib)
    return -(-max(ends) // block) * block


async def plug(vm, client, mib: int, sandbox_id: str) -> None:
    """mib more memory for the running VM: a DIMM hot-plugged, onlined by
    the guest (waited for: its agent's MemTotal grows by it), the pod's
    /dev/shm resized to half of the new total. Unavailable when QEMU or
    the guest does not take it."""
    if mib <= 0:
        return
    started = time.monotonic()
    before = await _guest_memory(client, sandbox_id)
    try:
        await vm.qmp.execute("object-add", {"qom-type": "memory-backend-memfd", "id": BACKEND_ID,
                                            "size": mib * MIB, "share": True})
        dimm = {"driver": "pc-dimm", "id": DIMM_ID, "memdev": BACKEND_ID}
        address = await dimm_address(vm, vm.config.memory_mib)
        if address is not None:
            dimm["addr"] = address
        await vm.qmp.execute("device_add", dimm)
    except (QmpError, QmpGone, QmpTimeout) as exc:
        raise Unavailable(f"pod {sandbox_id}: its VM took no {mib} MiB DIMM: {exc}") from None
    vm.plugged_mib = mib
    deadline = time.monotonic() + ONLINE_TIMEOUT
    while True:
        now = await _guest_memory(client, sandbox_id)
        if now >= before + mib * MIB:
            break
        if time.monotonic() > deadline:
            raise Unavailable(f"pod {sandbox_id}: its guest onlined {(now - before) // MIB} of the {mib} MiB "
                              f"plugged within {ONLINE_TIMEOUT:.0f} s")
        await asyncio.sleep(0.1)
    await calls.mount_pod_tmpfs(client, SHM_TMPFS, "")
    log.info("guest memory plugged", extra={"fields": {"sandbox": sandbox_id, "mib": mib,
                                                       "seconds": round(time.monotonic() - started, 2)}})


async def _guest_memory(client, sandbox_id: str) -> int:
    """The guest's MemTotal as its agent tells it (only waited on: a guest
    that lies delays its own pod, bounded by ONLINE_TIMEOUT)."""
    try:
        details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=30)
    except (ttrpc.TtrpcError, ConnectionError) as exc:
        raise Unavailable(f"pod {sandbox_id}: its guest's memory not read: {exc}") from None
    return details.memory_bytes
