"""The end of a microVM pod's exec in the handler (crust.kata.pod.processes):
exited execs nobody deletes are forgotten beyond a count and after a time,
a Delete forgets one at once, and one still running is refused. The guest
is absent here (its removal is the VM tests')."""

from __future__ import annotations

import asyncio

import pytest

from crust.common.errors import FailedPrecondition, InvalidArgument, NotFound
from crust.kata.pod import processes as pod_processes
from crust.kata.pod.processes import Processes
from crust.kata.pod.records import ContainerRecord, PodRecord, ProcessRecord


class _Sandbox:
    """A VM that runs (nothing is asked of its guest here)."""

    def alive(self) -> bool:
        return True


class _Registry:
    """What Processes asks of the PodRegistry, around a VM that runs."""

    def __init__(self, pod: PodRecord):
        self.pods = {pod.sandbox_id: pod}

    def sandbox(self, pod_id):
        return _Sandbox()

    def find(self, container_id):
        for pod in self.pods.values():
            if container_id in pod.containers:
                return pod, pod.containers[container_id]
        raise NotFound(f"container_id {container_id!r}: no such container")

    def process(self, container_id, exec_id):
        pod, c = self.find(container_id)
        if exec_id not in c.processes:
            raise NotFound(f"exec_id {exec_id!r}: no such process in container {container_id}")
        return pod, c, c.processes[exec_id]


def _processes(pod: PodRecord) -> Processes:
    processes = Processes(_Registry(pod))
    processes.all_taken_back()
    return processes


def _pod() -> tuple[PodRecord, ContainerRecord]:
    c = ContainerRecord(container_id="app", bundle="/b", processes={"": ProcessRecord(pid=1)})
    # Gone: the forgetting asks no guest (its removal there is the VM tests').
    return PodRecord(sandbox_id="pod", containers={"app": c}, gone="stopped"), c


async def test_exited_execs_beyond_the_bound_are_forgotten_oldest_first(monkeypatch):
    monkeypatch.setattr(pod_processes, "EXITED_EXECS_KEPT", 3)
    pod, c = _pod()
    pods = _processes(pod)
    for n in range(5):
        p = c.processes[f"e{n}"] = ProcessRecord(exec_id=f"e{n}", pid=10 + n, exit_code=0, exited_at_ns=100 + n,
                                                 on_port=True)
        pods._bound_exited(pod, c, p)
    await asyncio.gather(*pods._forgets)
    assert sorted(c.processes) == ["", "e2", "e3", "e4"]
    assert sorted(k[1] for k in pods._expiries) == ["e2", "e3", "e4"]   # their own forgetting still due


async def test_an_exited_exec_nobody_deletes_is_forgotten_after_its_time(monkeypatch):
    monkeypatch.setattr(pod_processes, "EXITED_EXEC_SECONDS", 0.05)
    pod, c = _pod()
    pods = _processes(pod)
    p = c.processes["e"] = ProcessRecord(exec_id="e", pid=10, exit_code=0, on_port=True)
    pods._bound_exited(pod, c, p)
    await asyncio.sleep(0.2)
    await asyncio.gather(*pods._forgets)
    assert list(c.processes) == [""] and pods._expiries == {}


async def test_a_delete_forgets_an_exited_exec_once_and_refuses_a_running_one():
    pod, c = _pod()
    pods = _processes(pod)
    done = c.processes["done"] = ProcessRecord(exec_id="done", pid=10, exit_code=3, exited_at_ns=5, on_port=True)
    pods._bound_exited(pod, c, done)
    state = await pods.delete_process("app", "done")
    assert state.exit_code == 3 and "done" not in c.processes and pods._expiries == {}
    with pytest.raises(NotFound):
        await pods.delete_process("app", "done")
    with pytest.raises(NotFound):
        await pods.get_process("app", "done", wait=False)
    with pytest.raises(InvalidArgument):
        await pods.delete_process("app", "")
    pod.gone = ""
    c.processes["runs"] = ProcessRecord(exec_id="runs", pid=11, on_port=True)
    pods.exits._tasks[("app", "runs")] = asyncio.ensure_future(asyncio.sleep(10))   # its exit watched
    with pytest.raises(FailedPrecondition):
        await pods.delete_process("app", "runs")
    assert "runs" in c.processes
    pods.exits._tasks.pop(("app", "runs")).cancel()
