"""The shim's snapshot freezes (crust.csi_shim.freeze) against a runtime
client that records its calls: which volumes are frozen, in which order,
and that each is thawed whatever the block does."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from crust.api import runtime_pb2
from crust.common.errors import FailedPrecondition, Forwarded, InvalidArgument, Unavailable
from crust.csi_shim import freeze


class Runtime:
    def __init__(self, in_sandbox=(), failing=(), thawed_early=(), slow: float = 0.0, refused=(), not_frozen=()):
        self.in_sandbox, self.failing, self.thawed_early, self.slow = set(in_sandbox), set(failing), \
            set(thawed_early), slow
        self.refused, self.not_frozen = set(refused), set(not_frozen)
        self.calls: list[tuple[str, str]] = []

    async def freeze(self, volume_id, timeout_seconds, policy, call_timeout):
        self.calls.append(("freeze", volume_id))
        await asyncio.sleep(self.slow)
        if volume_id in self.failing:
            raise Unavailable(f"the crust proxy is unreachable for {volume_id}")
        if volume_id in self.refused:
            raise Forwarded(grpc.StatusCode.FAILED_PRECONDITION, f"{volume_id}: this file system cannot be frozen")
        if volume_id in self.not_frozen:
            return [runtime_pb2.FrozenTarget(volume_target_path=f"/t/{volume_id}", error="the agent did not answer")]
        if volume_id not in self.in_sandbox:
            return []
        return [runtime_pb2.FrozenTarget(volume_target_path=f"/t/{volume_id}", sandbox_id="sb", depth=1,
                                         frozen=True)]

    async def thaw(self, volume_id, targets, call_timeout):
        assert targets in ([], [f"/t/{volume_id}"])
        self.calls.append(("thaw", volume_id))
        return [runtime_pb2.FrozenTarget(volume_target_path=f"/t/{volume_id}",
                                         was_frozen=volume_id not in self.thawed_early)]


def counted(outcome: str) -> float:
    return freeze.FREEZES.labels(outcome)._value.get()


def test_the_mode_is_the_volumes_unless_named_and_a_bad_one_is_refused_naming_the_parameter():
    assert freeze.mode_of({}) == ""
    assert freeze.mode_of({"crust.dev/freeze": "never"}) == "never"
    with pytest.raises(InvalidArgument) as caught:
        freeze.mode_of({"crust.dev/freeze": "Required"})
    assert 'parameters["crust.dev/freeze"]' in caught.value.message


def test_members_are_frozen_in_sorted_order_and_thawed_after_whatever_the_block_did():
    runtime = Runtime(in_sandbox={"a", "b", "c"})
    freezer = freeze.SnapshotFreezer(runtime, 60)

    async def failing_block():
        async with freezer.frozen(["c", "a", "b", "a"], "best-effort", "g1") as held:
            assert held == ["a", "b", "c"]
            raise RuntimeError("the driver failed")

    with pytest.raises(RuntimeError):
        asyncio.run(failing_block())
    assert runtime.calls == [("freeze", "a"), ("freeze", "b"), ("freeze", "c"),
                             ("thaw", "c"), ("thaw", "b"), ("thaw", "a")]


def test_a_cancelled_call_thaws_even_a_freeze_it_was_still_waiting_for():
    runtime = Runtime(in_sandbox={"a"}, slow=0.2)
    freezer = freeze.SnapshotFreezer(runtime, 60)

    async def scenario():
        async def snapshot():
            async with freezer.frozen(["a"], "best-effort", "s1"):
                await asyncio.sleep(10)
        task = asyncio.create_task(snapshot())
        await asyncio.sleep(0.05)   # inside the freeze call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert runtime.calls == [("freeze", "a"), ("thaw", "a")]


def test_best_effort_goes_on_required_refuses_and_never_asks():
    failed_before = counted("failed")
    runtime = Runtime(in_sandbox={"a", "b"}, failing={"b"})
    freezer = freeze.SnapshotFreezer(runtime, 60)

    async def take(mode):
        async with freezer.frozen(["a", "b"], mode, "s") as held:
            return held

    assert asyncio.run(take("best-effort")) == ["a"]
    assert runtime.calls == [("freeze", "a"), ("freeze", "b"), ("thaw", "a")]
    runtime.calls.clear()
    with pytest.raises(FailedPrecondition) as caught:
        asyncio.run(take("required"))
    assert "volume b" in caught.value.message and "required" in caught.value.message
    assert runtime.calls == [("freeze", "a"), ("freeze", "b"), ("thaw", "a")]
    runtime.calls.clear()
    assert asyncio.run(take("never")) == [] and runtime.calls == []
    assert counted("failed") == failed_before + 2


def test_a_volume_in_no_sandbox_is_not_thawed_and_a_freeze_that_ended_early_is_counted_timed_out():
    timed_out_before = counted("timed_out")
    runtime = Runtime(in_sandbox={"a"}, thawed_early={"a"})
    freezer = freeze.SnapshotFreezer(runtime, 60)

    async def take():
        async with freezer.frozen(["a", "z"], "best-effort", "s") as held:
            return held

    assert asyncio.run(take()) == ["a"]
    assert runtime.calls == [("freeze", "a"), ("freeze", "z"), ("thaw", "a")]
    assert counted("timed_out") == timed_out_before + 1


def test_the_proxys_refusal_under_the_volumes_required_fails_and_a_target_it_could_not_freeze_is_not_thawed():
    failed_before = counted("failed")
    runtime = Runtime(in_sandbox={"a"}, refused={"r"}, not_frozen={"n"})
    freezer = freeze.SnapshotFreezer(runtime, 60)

    async def take(ids):
        async with freezer.frozen(ids, "", "s") as held:
            return held

    assert asyncio.run(take(["a", "n"])) == ["a"]
    assert runtime.calls == [("freeze", "a"), ("freeze", "n"), ("thaw", "a")]
    runtime.calls.clear()
    with pytest.raises(FailedPrecondition) as caught:
        asyncio.run(take(["a", "r"]))
    assert "cannot be frozen" in caught.value.message
    assert runtime.calls == [("freeze", "a"), ("freeze", "r"), ("thaw", "a")]
    assert counted("failed") == failed_before + 2
