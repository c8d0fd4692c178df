"""The runtime handler's own bookkeeping (crust.runtime_handler.handler):
work directories and a delete that meets the reaper's teardown.
"""

from __future__ import annotations

import asyncio


def test_a_sandbox_work_directory_is_short_and_an_earlier_releases_is_kept(tmp_path):
    """CRI's 64-character ids get a hashed work directory (the VM's sockets
    must fit a unix socket path); a directory an earlier release named by
    the id itself is still the sandbox's."""
    from crust.runtime_handler.handler import WORKDIR_NAME_MAX, RuntimeHandler

    handler = RuntimeHandler.__new__(RuntimeHandler)
    handler.state_dir = tmp_path
    short, long_id, old_id = "pod-1", "a" * 64, "b" * 64
    assert handler.workdir(short) == tmp_path / "run" / short
    hashed = handler.workdir(long_id)
    assert hashed.parent == tmp_path / "run" and len(hashed.name) == WORKDIR_NAME_MAX
    assert handler.workdir(long_id) == hashed and handler.workdir("c" * 64) != hashed
    (tmp_path / "run" / old_id).mkdir(parents=True)
    assert handler.workdir(old_id) == tmp_path / "run" / old_id


def test_a_delete_while_the_reaper_tears_a_dead_sandbox_down_waits_for_it(tmp_path):
    """The reaper's own teardown of a dead sandbox is housekeeping: a
    DeleteSandbox (or a pod's DeleteContainer) that comes meanwhile waits
    for it and succeeds, instead of being told ABORTED."""
    from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord

    class Registration:
        on_register = None

    class DeadSandbox:
        def __init__(self) -> None:
            self.stopping, self.release = asyncio.Event(), asyncio.Event()
            self.stops = 0

        def alive(self) -> bool:
            return False

        async def stop_process(self) -> None:
            self.stopping.set()
            await self.release.wait()

        async def stop(self) -> None:
            self.stops += 1

    async def scenario() -> None:
        handler = RuntimeHandler(name="h", volumes_dir=tmp_path / "volumes", state_dir=tmp_path / "state",
                                 registration=Registration(), make_sandbox=None)
        sandbox, record = DeadSandbox(), SandboxRecord(sandbox_id="pod-1", bundle="")
        await handler.adopt(sandbox, record)
        reaper = asyncio.create_task(handler.reap_once())
        await asyncio.wait_for(sandbox.stopping.wait(), 5)
        deleting = asyncio.create_task(handler.delete_sandbox("pod-1"))
        await asyncio.sleep(0.05)
        assert not deleting.done(), "the delete did not wait for the reaper's teardown"
        sandbox.release.set()
        await asyncio.wait_for(asyncio.gather(reaper, deleting), 5)
        assert handler.sandboxes == {} and sandbox.stops == 1
        assert [key for key, _ in handler.records.load_all()] == []

    asyncio.run(scenario())
