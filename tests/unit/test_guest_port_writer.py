"""crust.guest.port_writer: the agent's writes to its port, here through a
pipe of one page that a reader empties at its own pace."""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket

import pytest

from crust.guest.held_pipe import PipedBytes
from crust.guest.port_writer import PORT_WRITE_MAX, PortWriter
from crust.sys import pipes

PAGE = 4096


def small_pipe() -> tuple[int, int]:
    """(read end, non-blocking write end) of a pipe holding one page."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PAGE)
    os.set_blocking(write_end, False)
    return read_end, write_end


def pipe_writer(loop: asyncio.AbstractEventLoop, **options) -> tuple[int, PortWriter]:
    """(read end, a PortWriter on the write end) of a small_pipe()."""
    read_end, write_end = small_pipe()
    return read_end, PortWriter(write_end, loop, **options)


def read_to_end(fd: int) -> bytes:
    data = bytearray()
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    os.close(fd)
    return bytes(data)


def test_writes_arrive_whole_and_in_order_and_drain_holds_the_writer_back():
    async def main():
        loop = asyncio.get_running_loop()
        read_end, writer = pipe_writer(loop, high_water=2 * PAGE)
        reading = loop.run_in_executor(None, read_to_end, read_end)
        sent = bytearray()
        most_pending_after_drain = 0
        for i in range(200):
            data = bytes([i % 251]) * (1 + i * 97 % 20000)
            writer.write(data)
            sent += data
            await writer.drain()
            most_pending_after_drain = max(most_pending_after_drain, writer.get_write_buffer_size())
        writer.close()
        await writer.wait_closed()
        assert writer.get_write_buffer_size() == 0
        assert await reading == bytes(sent)
        assert most_pending_after_drain <= 2 * PAGE

    asyncio.run(main())


def test_a_write_takes_what_the_port_takes_now_and_close_writes_the_rest_before_closing():
    async def main():
        loop = asyncio.get_running_loop()
        read_end, writer = pipe_writer(loop)
        data = os.urandom(10 * PAGE)
        writer.write(data)
        assert writer.get_write_buffer_size() == len(data) - PAGE   # the pipe took its page at once
        writer.close()
        assert writer.is_closing()
        writer.write(b"after close")   # dropped, as a closing transport drops it
        assert writer.get_write_buffer_size() == len(data) - PAGE
        got = await loop.run_in_executor(None, read_to_end, read_end)
        await writer.wait_closed()
        assert got == data

    asyncio.run(main())


def test_abort_drops_what_is_pending_and_closes_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        read_end, writer = pipe_writer(loop)
        data = os.urandom(5 * PAGE)
        writer.write(data)
        writer.abort()
        await asyncio.wait_for(writer.wait_closed(), 5)
        assert writer.get_write_buffer_size() == 0
        assert read_to_end(read_end) == data[:PAGE]   # then the end of the stream: the writer's end is closed

    asyncio.run(main())


def test_a_failed_write_ends_the_writer_and_drain_says_the_connection_is_gone():
    async def main():
        loop = asyncio.get_running_loop()
        read_end, writer = pipe_writer(loop, high_water=PAGE)
        writer.write(os.urandom(3 * PAGE))
        os.close(read_end)   # the next write fails (EPIPE)
        draining = asyncio.ensure_future(writer.drain())
        with pytest.raises(ConnectionResetError, match="the port"):
            await asyncio.wait_for(draining, 5)
        assert writer.is_closing() and writer.get_write_buffer_size() == 0
        await asyncio.wait_for(writer.wait_closed(), 5)
        writer.write(b"more")   # dropped: nothing raises, nothing is held
        assert writer.get_write_buffer_size() == 0

    asyncio.run(main())


def test_a_short_piece_goes_out_in_one_write_with_what_follows_it():
    """Given together (writelines), as a ttrpc frame's header and its
    payload: one buffer on the port's queue, the rest in writes the port
    takes whole. A packet socket keeps each write(2) apart for the reader."""
    async def main():
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        writer = PortWriter(os.dup(ours.fileno()), loop)
        ours.close()
        header, payload, small = b"h" * 10, os.urandom(3 * PORT_WRITE_MAX), b"s" * 100
        writer.writelines((header, payload))
        writer.writelines((header, small))
        writer.write(header)
        writer.close()
        await writer.wait_closed()
        packets = []
        while packet := theirs.recv(1 << 20):
            packets.append(packet)
        theirs.close()
        assert b"".join(packets) == header + payload + header + small + header
        # No write offers more than the port takes (its driver's most).
        tail = len(header) + len(payload) - 3 * PORT_WRITE_MAX
        assert [len(p) for p in packets] == [PORT_WRITE_MAX] * 3 + [tail, len(header) + len(small), len(header)]

    asyncio.run(main())


def piped(data: bytes) -> PipedBytes:
    """data waiting in a pipe of its own, as an answer of a held stream."""
    read_end, write_end = pipes.make(1 << 20)
    os.write(write_end, data)
    os.close(write_end)
    return PipedBytes(read_end, len(data))


def test_piped_bytes_go_out_spliced_in_their_place_whole_though_the_port_takes_them_in_parts():
    """A frame's header, its bytes left in a pipe, its trailer, then the
    next frame: the port (one page at a time) gets them in that order,
    nothing of a later piece inside an earlier one."""
    async def main():
        loop = asyncio.get_running_loop()
        read_end, writer = pipe_writer(loop, high_water=PAGE)
        reading = loop.run_in_executor(None, read_to_end, read_end)
        frames, answers = [], []
        for i in range(6):
            header, body, trailer = b"H%d" % i, os.urandom(PAGE * (i + 3) + 17 * i), b"T%d" % i
            answers.append(piped(body))
            writer.writelines((header, answers[-1], trailer))
            frames.append(header + body + trailer)
            if i % 2:
                await writer.drain()
        assert all(len(a) == len(f) - 4 for a, f in zip(answers, frames))
        writer.close()
        await writer.wait_closed()
        assert await reading == b"".join(frames)
        assert all(answer.fd is None for answer in answers), "a spliced answer's pipe stayed open"

    asyncio.run(main())


def test_abort_closes_the_pipes_of_answers_not_spliced():
    async def main():
        loop = asyncio.get_running_loop()
        read_end, writer = pipe_writer(loop)
        first, second = piped(os.urandom(3 * PAGE)), piped(os.urandom(PAGE))
        writer.writelines((first, second))
        assert writer.get_write_buffer_size() == 4 * PAGE - PAGE   # the port took a page of the first
        writer.abort()
        await asyncio.wait_for(writer.wait_closed(), 5)
        os.close(read_end)
        assert first.fd is None and second.fd is None and writer.get_write_buffer_size() == 0

    asyncio.run(main())


def test_a_port_that_cannot_splice_gets_an_answers_bytes_written_in_their_place(tmp_path):
    """A target splice(2) refuses (EINVAL: a file opened for appending)."""
    async def main(path):
        loop = asyncio.get_running_loop()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC)
        writer = PortWriter(fd, loop)
        body = os.urandom(5 * PAGE)
        answer = piped(body)
        writer.writelines((b"head", answer, b"tail"))
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 5)
        return body, answer

    body, answer = asyncio.run(main(tmp_path / "port"))
    assert (tmp_path / "port").read_bytes() == b"head" + body + b"tail" and answer.fd is None
