"""A stop always ends, whatever the guest does: the deadlines of the calls
to the guest's agent (their arithmetic), a silent agent on a real unix
socket (a call of a stop fails within its bound and has the VM told, one
outside a stop only fails), a process sent SIGKILL that never exits, and a
VMM whose guest answered PowerOff and stayed up (a real process that
ignores QMP's quit): killed within the stated bounds."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.kata.agent import client as agent_client
from crust.kata.agent import stop_bound
from crust.kata.agent.client import AgentClient, call_timeout
from crust.kata.vmm.qemu import Vm, VmConfig
from crust.sys.run import rpc_deadline


def test_a_call_without_a_timeout_waits_the_default_and_a_long_wait_none():
    assert call_timeout("SignalProcess", None, 100.0) == agent_client.CALL_TIMEOUT
    assert call_timeout("SignalProcess", 7.0, 100.0) == 7.0
    for method in agent_client.LONG_WAITS:
        assert call_timeout(method, None, 100.0) is None
    assert call_timeout("WaitProcess", 3.0, 100.0) == 3.0


def test_a_call_never_outlives_the_rpc_nor_the_stop_that_caused_it():
    now = time.monotonic()
    token = rpc_deadline.set(now + 30.0)
    try:
        assert call_timeout("CreateContainer", None, now) == pytest.approx(30.0)
        assert call_timeout("CreateContainer", 5.0, now) == 5.0
        assert stop_bound.remaining(30.0) == 30.0
        with stop_bound.bounded(8.0):
            assert call_timeout("RemoveContainer", None, now) == pytest.approx(8.0, abs=0.1)
            assert 7.0 < stop_bound.remaining(30.0) <= 8.0   # a wait for the agent's port, too
            with stop_bound.bounded(60.0):   # an inner stop never extends the outer one
                assert call_timeout("RemoveContainer", None, now) == pytest.approx(8.0, abs=0.1)
        # A deadline that has passed leaves the least, never a negative or no timeout.
        assert call_timeout("PowerOff", None, now + 100.0) == agent_client.MIN_TIMEOUT
        # The watches of a process outlive the RPC that started them.
        assert call_timeout("WaitProcess", None, now + 100.0) is None
    finally:
        rpc_deadline.reset(token)
    assert not stop_bound.in_stop()


def test_the_stated_bound_of_a_pods_stop_adds_up():
    assert stop_bound.STOP_POD_BOUND == (stop_bound.POD_STOP + stop_bound.POWER_OFF_PORT_WAIT
                                         + stop_bound.POWER_OFF_EXIT + 2 * stop_bound.QEMU_QUIT
                                         + stop_bound.QEMU_KILL) == 95
    # kubelet's runtime request timeout (2 minutes) holds a pod's stop.
    assert stop_bound.STOP_POD_BOUND < 120
    assert stop_bound.VM_KILLED_EXIT_CODE == 128 + 9


async def silent_agent(tmp_path: Path):
    """A unix socket whose peer reads every request and answers none."""
    async def swallow(reader, writer):
        while await reader.read(65536):
            pass
        writer.close()

    path = str(tmp_path / "silent.sock")
    return path, await asyncio.start_unix_server(swallow, path)


async def test_a_silent_agent_fails_a_stops_call_in_its_bound_and_the_vm_is_told(tmp_path):
    path, server = await silent_agent(tmp_path)
    told = []

    async def on_silent(reason: str) -> None:
        told.append(reason)

    client = await AgentClient.connect(path)
    client.on_silent = on_silent
    try:
        started = time.monotonic()
        with stop_bound.bounded(0.5):
            with pytest.raises(ttrpc.TtrpcError) as refused:
                await client.call("SignalProcess", agent_pb2.SignalProcessRequest(container_id="c", signal=9))
        took = time.monotonic() - started
        assert refused.value.code == ttrpc.DEADLINE_EXCEEDED
        assert 0.4 < took < 2.0, took
        assert told and "SignalProcess" in told[0] and "did not answer" in told[0], told
        # Outside a stop the same silence is only the call's failure.
        told.clear()
        with pytest.raises(ttrpc.TtrpcError):
            await client.call("SignalProcess", agent_pb2.SignalProcessRequest(container_id="c", signal=15),
                              timeout=0.2)
        assert told == []
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_process_sent_sigkill_that_never_exits_is_reported_missing_once():
    kills = stop_bound.KillDeadlines(bound=0.3, look=0.05)
    missing = []

    async def never() -> bool:
        return False

    async def on_missing() -> None:
        missing.append(time.monotonic())

    started = time.monotonic()
    kills.expect(("c", ""), never, on_missing)
    kills.expect(("c", ""), never, on_missing)   # a second SIGKILL: one watch
    while kills.pending():
        await asyncio.sleep(0.05)
    assert len(missing) == 1 and 0.25 < missing[0] - started < 1.5, missing

    kills.expect(("c", "e1"), lambda: asyncio.sleep(0, result=True), on_missing)
    while kills.pending():
        await asyncio.sleep(0.05)
    assert len(missing) == 1, missing
    await kills.close()


class AnsweringPort:
    """A guest that answers PowerOff (and then stays up)."""

    dead = ""

    class Client:
        async def call(self, method, request, timeout=None):
            assert method == "PowerOff"
            return agent_pb2.PowerOffResponse(unmounted=3)

    async def ready(self, wait: float = 0.0):
        return self.Client()

    async def close(self, reason: str = "") -> None:
        self.dead = self.dead or reason


class DeafQmp:
    """A VMM that takes QMP's quit and does not go."""

    async def execute(self, command, arguments=None, timeout=30.0):
        return {}

    async def close(self) -> None:
        pass


async def test_a_guest_that_answers_power_off_and_stays_up_is_killed_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(stop_bound, "POWER_OFF_EXIT", 0.5)
    monkeypatch.setattr(stop_bound, "QEMU_QUIT", 0.5)
    vm = Vm("crust-stays-up", tmp_path, VmConfig(kernel=tmp_path / "k", initrd=tmp_path / "i"))
    vm.port, vm.qmp = AnsweringPort(), DeafQmp()
    # A process in QEMU's place that ignores everything but SIGKILL.
    vm._proc = await asyncio.create_subprocess_exec("sh", "-c", "trap '' TERM INT HUP; while :; do sleep 1; done")
    vm._exited = asyncio.create_task(vm._watch())
    try:
        started = time.monotonic()
        code = await vm.stop()
        took = time.monotonic() - started
    finally:
        if vm._proc.returncode is None:
            vm._proc.kill()
            await vm._proc.wait()
    assert code == -9, code
    assert took < stop_bound.POWER_OFF_EXIT + stop_bound.QEMU_QUIT * 2 + 2.0, took
    assert not vm.alive()
