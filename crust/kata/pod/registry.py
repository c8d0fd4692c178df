"""The pods the microVM handler knows: their records (one JSON file each,
crust.kata.pod.records), their locks, and each pod's sandbox (its VM), which
is the RuntimeHandler's. The pod's objects (crust.kata.pod.pods, containers,
processes, volumes) find a pod, its containers and processes here, and
record a pod's end here."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from crust.common.aio import KeyedLocks
from crust.common.errors import FailedPrecondition, NotFound
from crust.common.recordstore import RecordStore
from crust.kata.agent import stop_bound
from crust.kata.pod.records import VM_GONE_EXIT_CODE, ContainerRecord, PodRecord, ProcessRecord
from crust.kata.vmm.share import PodShare, tag_of
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord

log = logging.getLogger("crust.kata.pod.pods")


def _belongs(key: str, record: PodRecord) -> str:
    if record.sandbox_id != key:
        return f"it describes pod {record.sandbox_id!r}, not {key!r}"
    for cid, c in record.containers.items():
        if c.container_id != cid:
            return f"its container {c.container_id!r} is stored as {cid!r}"
    return ""


class PodRegistry:
    def __init__(self, handler: RuntimeHandler):
        self.handler = handler
        self.records = RecordStore(handler.state_dir / "pods", PodRecord, _belongs)
        self.pods: dict[str, PodRecord] = dict(self.records.load_all())
        self.locks = KeyedLocks()   # by pod
        self._unwritten: set[str] = set()  # pods stopped in memory whose record is not written yet

    # -- records ---------------------------------------------------------------------------

    async def save(self, pod: PodRecord) -> None:
        await self.records.put(pod.sandbox_id, pod)

    async def add(self, pod: PodRecord) -> None:
        """A new pod, recorded first."""
        await self.records.put(pod.sandbox_id, pod)
        self.pods[pod.sandbox_id] = pod

    def forget(self, pod_id: str) -> None:
        """Out of memory; its record stays until remove()."""
        self.pods.pop(pod_id, None)

    async def remove(self, pod_id: str) -> None:
        self.forget(pod_id)
        await self.records.delete(pod_id)

    # -- lookups ---------------------------------------------------------------------------

    def sandbox(self, pod_id: str) -> KataSandbox | None:
        entry = self.handler.entry(pod_id)
        return entry[0] if entry is not None else None

    def live(self, pod_id: str) -> tuple[KataSandbox, SandboxRecord, PodRecord]:
        pod = self.pods.get(pod_id)
        if pod is None:
            raise NotFound(f"sandbox_id {pod_id!r}: no such pod")
        entry = self.handler.entry(pod_id)
        if entry is None or not entry[0].alive() or pod.gone:
            raise FailedPrecondition(f"pod {pod_id}: {pod.gone or 'its VM is not running'}")
        return entry[0], entry[1], pod

    def find(self, container_id: str) -> tuple[PodRecord, ContainerRecord]:
        for pod in self.pods.values():
            c = pod.containers.get(container_id)
            if c is not None:
                return pod, c
        raise NotFound(f"container_id {container_id!r}: no such container")

    def process(self, container_id: str, exec_id: str) -> tuple[PodRecord, ContainerRecord, ProcessRecord]:
        pod, c = self.find(container_id)
        p = c.processes.get(exec_id)
        if p is None:
            raise NotFound(f"exec_id {exec_id!r}: no such process in container {container_id}")
        return pod, c, p

    def workdir(self, pod_id: str) -> Path:
        return self.handler.workdir(pod_id)

    def share(self, pod_id: str, name: str = "share", sandbox: KataSandbox | None = None) -> PodShare:
        """One of the pod's shared directories; with the pod's sandbox, the
        virtiofsd serving it, in whose mount namespace its binds are made."""
        server = sandbox.vm.virtiofsds.get(tag_of(name)) if sandbox is not None else None
        return PodShare(self.workdir(pod_id), name, server.identity if server is not None else None)

    def shares(self, pod_id: str, sandbox: KataSandbox | None = None) -> tuple[PodShare, PodShare]:
        return self.share(pod_id, sandbox=sandbox), self.share(pod_id, "live", sandbox)

    # -- a pod's end -----------------------------------------------------------------------

    def death_reason(self, pod_id: str, sandbox: KataSandbox | None) -> str:
        if sandbox is None:
            return f"the VM of pod {pod_id} was stopped"
        # The agent client says why it lost the guest ("QEMU exited with code -9").
        return f"the VM of pod {pod_id} is gone ({sandbox.vm.port.dead or 'QEMU exited'})"

    async def mark_gone(self, pod_id: str, reason: str) -> None:
        """Every process of the pod that had not exited is stopped with the
        VM's exit code and the reason, once; recorded (again, when an earlier
        write failed)."""
        pod = self.pods.get(pod_id)
        if pod is None or (pod.gone and pod_id not in self._unwritten):
            return
        pod.gone = pod.gone or reason
        now = time.time_ns()
        sandbox = self.sandbox(pod_id)
        # Killed by the host (its agent silent in a stop) as runc kills: SIGKILL's status.
        code = stop_bound.VM_KILLED_EXIT_CODE if sandbox is not None and sandbox.vm.unresponsive \
            else VM_GONE_EXIT_CODE
        for c in pod.containers.values():
            for p in c.processes.values():
                if p.pid and p.exit_code is None:
                    p.exit_code, p.exited_at_ns, p.reason = code, now, pod.gone
        if pod_id not in self._unwritten:
            log.warning("pod stopped", extra={"fields": {"sandbox": pod_id, "reason": reason}})
        self._unwritten.add(pod_id)
        await self.records.put(pod_id, pod)
        self._unwritten.discard(pod_id)
