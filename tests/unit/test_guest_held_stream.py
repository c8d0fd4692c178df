"""crust.guest.streams' OutputStream holding a process's output in its
pipe (crust.guest.held_pipe): real pipes, a writer that is this test."""

from __future__ import annotations

import asyncio
import os

import pytest

from crust.common import ttrpc
from crust.guest.errors import AgentError
from crust.guest.held_pipe import PipedBytes
from crust.guest.streams import OutputStream
from crust.sys import pipes

LIMIT = 256 << 10


def held() -> tuple[OutputStream, int]:
    """(a stream holding its pipe, the pipe's non-blocking write end)."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    stream = OutputStream(LIMIT)
    stream.hold_pipe(read_end)
    return stream, write_end


def fill(write_end: int, data: bytes) -> int:
    """As much of data as the pipe takes now; the count."""
    written = 0
    while written < len(data):
        try:
            written += os.write(write_end, data[written:])
        except BlockingIOError:
            break
    return written


def as_bytes(data) -> bytes:
    return data.take() if isinstance(data, PipedBytes) else data


def test_a_writer_faster_than_the_reader_waits_once_the_limit_is_held_and_every_byte_arrives_in_order():
    async def main():
        stream, write_end = held()
        data = os.urandom(3 * LIMIT + 12345)
        taken = fill(write_end, data)
        # The pipe is the bound: the writer's next write would wait.
        assert taken == LIMIT and stream.length == LIMIT and stream.held == LIMIT
        with pytest.raises(BlockingIOError):
            os.write(write_end, b"x")
        got, offset = bytearray(), 0
        hang_up = asyncio.ensure_future(stream.until_hung_up())
        while True:
            taken += fill(write_end, data[taken:])
            if taken == len(data) and write_end >= 0:
                os.close(write_end)
                write_end = -1
            answer_offset, answer, eof = await stream.read(offset, 100_000, piped=True)
            assert answer_offset == offset and stream.held <= LIMIT
            got += as_bytes(answer)
            offset += len(answer)
            if eof:
                break
        await asyncio.wait_for(hang_up, 5)
        assert bytes(got) == data and stream.ended and stream.length == len(data)
        # Everything acknowledged after the end: the stream lets its pipe go.
        assert await stream.read(len(data), 10) == (len(data), b"", True)
        assert stream._pipe is None and stream.state() == (len(data), len(data), True)

    asyncio.run(main())


def test_a_resend_at_the_held_offset_answers_the_same_bytes_and_below_it_is_data_loss():
    async def main():
        stream, write_end = held()
        data = os.urandom(100_000)
        fill(write_end, data)
        first = as_bytes((await stream.read(0, 60_000, piped=True))[1])
        again = as_bytes((await stream.read(0, 60_000, piped=True))[1])
        offset, onward, _eof = await stream.read(40_000, 1 << 20)
        assert first == again == data[:60_000] and onward == data[40_000:] and offset == 40_000
        # What was acknowledged left the pipe.
        assert pipes.queued(stream._pipe.fd) == len(data) - 40_000 and stream.held_from == 40_000
        with pytest.raises(AgentError) as lost:
            await stream.read(39_999, 10)
        assert lost.value.code == ttrpc.DATA_LOSS and "offset" in lost.value.message
        assert stream.peek() == data[40_000:] and stream.held == len(data) - 40_000   # a look keeps it
        os.close(write_end)
        await asyncio.wait_for(stream.until_hung_up(), 5)
        assert stream.drop() == len(data) - 40_000 and stream.held == 0

    asyncio.run(main())


def test_a_read_waits_for_bytes_and_a_pipe_still_open_at_the_end_is_read_into_memory_and_closed():
    """A descendant of the process keeps the pipe open: ending the stream
    keeps what it held and closes the agent's end (the descendant's next
    write fails)."""
    async def main():
        stream, write_end = held()
        waiting = asyncio.ensure_future(stream.read(0, 1 << 20))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        os.write(write_end, b"hello ")
        offset, data, eof = await asyncio.wait_for(waiting, 5)
        assert (offset, data, eof) == (0, b"hello ", False)
        os.write(write_end, b"world")
        stream.end()
        assert (await stream.read(6, 100)) == (6, b"world", True)
        with pytest.raises(BrokenPipeError):
            os.write(write_end, b"more")
        os.close(write_end)

    asyncio.run(main())
