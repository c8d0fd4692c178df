"""crust.guest.spawn: a child's output read as it is (PipeReader) and its
exit learned from a pidfd, with real children, pipes and terminals."""

from __future__ import annotations

import asyncio
import errno
import os
import pty

import pytest

from crust.guest import spawn


def test_a_childs_output_is_read_whole_and_its_exit_learned():
    async def main():
        child = await spawn.start(["/bin/sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; echo err >&2; exit 3"],
                                  stdin=False, cwd="/", env={"PATH": "/usr/bin:/bin"})
        try:
            out = bytearray()
            while chunk := await child.stdout.read(1 << 20):
                assert len(chunk) <= 1 << 20
                out += chunk
            assert await child.stdout.read(10) == b""   # the end stays the end
            assert await child.stderr.read() == b"err\n"
            assert await spawn.exited(child.popen) == 3
        finally:
            child.close_pipes()
        assert bytes(out) == b"x" * 3000000

    asyncio.run(main())


def test_a_read_waits_for_the_pipe_and_a_close_meanwhile_fails_it():
    async def main():
        read_end, write_end = os.pipe()
        reader = spawn.PipeReader(os.fdopen(read_end, "rb", buffering=0))
        waiting = asyncio.ensure_future(reader.read(100))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        os.write(write_end, b"late")
        assert await asyncio.wait_for(waiting, 5) == b"late"
        waiting = asyncio.ensure_future(reader.read(100))
        await asyncio.sleep(0.05)
        reader.close()
        with pytest.raises(OSError) as raised:
            await asyncio.wait_for(waiting, 5)
        assert raised.value.errno == errno.EBADF
        reader.close()   # once closed, closing again is nothing
        os.close(write_end)

    asyncio.run(main())


def test_a_terminals_eio_is_its_end_after_its_last_output():
    async def main():
        master, slave = pty.openpty()
        reader = spawn.PipeReader(os.fdopen(master, "rb", buffering=0), terminal=True)
        os.write(slave, b"last words\n")
        os.close(slave)   # the terminal's last process left: reads fail with EIO
        got = bytearray()
        while chunk := await asyncio.wait_for(reader.read(1 << 16), 5):
            got += chunk
        assert bytes(got) == b"last words\r\n"
        reader.close()

    asyncio.run(main())
