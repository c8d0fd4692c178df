"""The asyncio helpers (crust.common.aio) under cancellation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from crust.common.aio import KeyedLocks, cancel_all, first_done, in_thread


async def test_in_thread_outlives_a_cancelled_caller():
    # A cancelled caller goes on only once the thread has ended, and its
    # then() has run: memory matches the disk before any cleanup or retry.
    release, steps = threading.Event(), []

    def work():
        release.wait(10)
        steps.append("thread")

    waiter = asyncio.ensure_future(in_thread(work, then=lambda: steps.append("then")))
    await asyncio.sleep(0.05)
    waiter.cancel()
    await asyncio.sleep(0.05)
    waiter.cancel()  # a second cancellation does not cut the wait short either
    await asyncio.sleep(0.05)
    assert not waiter.done() and steps == []
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert steps == ["thread", "then"]
    # A failing thread skips then() and raises its own error.
    with pytest.raises(ZeroDivisionError):
        await in_thread(lambda: 1 / 0, then=lambda: steps.append("no"))
    assert await in_thread(sum, [1, 2]) == 3 and steps == ["thread", "then"]


async def test_keyed_locks_exclude_per_key_and_keep_no_key_nobody_uses():
    locks, order = KeyedLocks(), []

    async def hold(key: str, name: str, seconds: float) -> None:
        async with locks[key]:
            order.append(f"{name} in")
            await asyncio.sleep(seconds)
            order.append(f"{name} out")

    # Two users of one key take turns; another key is not held up by them.
    first = asyncio.ensure_future(hold("pod-a", "a1", 0.05))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(hold("pod-a", "a2", 0))
    other = asyncio.ensure_future(hold("pod-b", "b", 0))
    await asyncio.gather(first, second, other)
    assert order.index("a1 out") < order.index("a2 in") and order.index("b out") < order.index("a1 out")
    assert len(locks) == 0
    # A waiter cancelled before its turn leaves the lock to the holder alone,
    # then nothing at all.
    holder = asyncio.ensure_future(hold("pod-a", "h", 0.05))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(hold("pod-a", "w", 0))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(locks) == 1
    await holder
    assert len(locks) == 0 and "w in" not in order
    # A user that fails inside lets go too.
    with pytest.raises(ZeroDivisionError):
        async with locks["pod-c"]:
            raise ZeroDivisionError
    assert len(locks) == 0


async def test_first_done_takes_its_own_task_down_with_a_cancelled_caller():
    owned = asyncio.ensure_future(asyncio.sleep(60))
    shared = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(first_done(owned, shared))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert owned.cancelled() and not shared.done()
    # Not cancelled, it returns what completed first.
    quick = asyncio.ensure_future(asyncio.sleep(0, "x"))
    assert await first_done(quick, shared) == {quick} and quick.result() == "x"
    shared.cancel()


async def test_cancel_all_ends_every_task_and_raises_nothing_of_theirs():
    async def failing():
        raise RuntimeError("its own")

    forever = asyncio.create_task(asyncio.sleep(3600))
    failed = asyncio.create_task(failing())
    await asyncio.sleep(0)
    await cancel_all([forever, failed])
    assert forever.cancelled() and failed.done() and isinstance(failed.exception(), RuntimeError)
    await cancel_all([])
