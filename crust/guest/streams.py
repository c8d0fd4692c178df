"""A process's output and input as the agent holds them between the pipe
and the host: byte offsets for the life of the process, acknowledged by
reading further, bounded in memory, never dropped silently.

An OutputStream is fed by one pump (the process's pipe) and read by one
reader (the host's ReadStdout/ReadStderr calls). Reading at an offset
acknowledges every byte below it, which the stream then drops; the bytes
not acknowledged are held up to `limit`, beyond which the pump stops
reading the pipe and the process blocks on its write: the guest's memory
is bounded and nothing is lost. A stream given the process's pipe itself
(hold_pipe) keeps what it holds there instead (crust.guest.held_pipe):
the pipe's capacity is the limit, and its answers are the pipe's pages.
An InputStream is the reverse: the host's
WriteStdin calls append at an offset (a resend of bytes already taken
writes only what is new), one pump writes them to the process's pipe.
"""

from __future__ import annotations

import asyncio
from collections import deque

from crust.common import ttrpc
from crust.guest.errors import AgentError
from crust.guest.held_pipe import HeldPipe, PipedBytes


def head(pieces, limit: int):
    """Up to limit bytes from the start of pieces (bytes or memoryviews, in
    order): the first piece (cut to limit) when it is enough or alone, else
    one join of at most limit bytes."""
    first = pieces[0] if pieces else b""
    if len(first) >= limit or len(pieces) <= 1:
        return first[:limit]
    parts, size = [], 0
    for piece in pieces:
        parts.append(piece[:limit - size])
        size += len(parts[-1])
        if size >= limit:
            break
    return b"".join(parts)


def drop_head(pieces: deque, count: int) -> None:
    """The first count bytes of pieces dropped (a piece cut where they end)."""
    while count and pieces:
        first = pieces[0]
        if len(first) <= count:
            pieces.popleft()
            count -= len(first)
        else:
            pieces[0] = first[count:]
            count = 0


# A stream held in its pipe, read while a process writes fast, is answered
# in fuller answers: holding FILL_BUSY_BYTES or more (more than a prompt or
# a line) but less than the read asks for, the read waits FILL_PAUSE at a
# time, as long as the pipe grows meanwhile, up to FILL_WAIT. Each answer
# costs the guest's one vCPU a round of the agent, which the writer would
# rather have; the pipe holds what it writes meanwhile.
FILL_BUSY_BYTES = 16 << 10
FILL_PAUSE = 0.005
FILL_WAIT = 0.05


class _Signal:
    """Wakes every waiter once per change (an Event that re-arms itself)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class OutputStream:
    def __init__(self, limit: int):
        self.limit = limit
        self._length = 0  # bytes written so far (while held in memory)
        self.held_from = 0  # the lowest offset still held
        self.ended = False
        # What is held, as the pipe gave it: chunks in order, the first
        # starting at held_from. Appending and dropping copy nothing.
        self._chunks: deque[bytes] = deque()
        # Or the process's pipe, holding it all from held_from.
        self._pipe: HeldPipe | None = None
        self._changed = _Signal()

    @property
    def length(self) -> int:
        """Bytes written so far."""
        if self._pipe is not None:
            return self.held_from + self._pipe.queued()
        return self._length

    @property
    def held(self) -> int:
        return self.length - self.held_from

    @property
    def has_room(self) -> bool:
        return self.held < self.limit

    def hold_pipe(self, fd: int) -> None:
        """What the process writes to the pipe fd (its read end, owned from
        now on) is held there until acknowledged; until_hung_up() ends the
        stream once every writer closed it."""
        if self._pipe is not None or self.ended or self._length:
            raise RuntimeError("a stream holds one pipe, from its start")
        self._pipe = HeldPipe(fd, self.limit)

    async def until_hung_up(self) -> None:
        await self._pipe.until_hung_up()
        self.end()

    def append(self, data: bytes) -> None:
        if self.ended:
            raise RuntimeError("append to an ended stream")
        if self._pipe is not None:
            raise RuntimeError("append to a stream held in its pipe")
        if data:
            self._chunks.append(bytes(data))
            self._length += len(data)
            self._changed.fire()

    def end(self) -> None:
        """No more bytes: a pipe some writer still holds open (a descendant
        of the process) is read into memory and closed."""
        if self._pipe is not None and not self._pipe.hung_up:
            data = self._pipe.take_all()
            self._pipe.close()
            self._pipe = None
            self._length = self.held_from + len(data)
            if data:
                self._chunks.append(data)
        if not self.ended:
            self.ended = True
            self._changed.fire()
        self._release_pipe()

    def _release_pipe(self) -> None:
        """An ended stream whose pipe holds nothing more lets it go (an
        exited process keeps no descriptor for output already read)."""
        if self._pipe is not None and self.ended and self._pipe.hung_up and not self.held:
            self._forget_pipe()

    def _forget_pipe(self) -> None:
        self._length = self.length
        self._pipe.close()
        self._pipe = None

    async def wait_for_room(self) -> None:
        while not self.has_room:
            await self._changed.wait()

    def _acknowledge(self, offset: int) -> None:
        if offset > self.held_from:
            if self._pipe is not None:
                self._pipe.discard(offset - self.held_from)
            else:
                drop_head(self._chunks, offset - self.held_from)
            self.held_from = offset
            self._release_pipe()
            self._changed.fire()

    def _take(self, max_bytes: int, piped: bool) -> bytes | PipedBytes:
        """Up to max_bytes from held_from, acknowledging nothing."""
        if self._pipe is not None:
            return self._pipe.answer(min(max_bytes, self.held), piped)
        return head(self._chunks, max_bytes)

    async def read(self, offset: int, max_bytes: int, accept_loss: bool = False,
                   piped: bool = False) -> tuple[int, bytes | PipedBytes, bool]:
        """(offset, data, eof) from offset, once there is a byte there or
        the stream ended; bytes below offset are acknowledged (dropped).
        piped: a stream held in its pipe may answer PipedBytes (for a
        writer that splices them)."""
        length = self.length
        if offset > length:
            raise AgentError(ttrpc.OUT_OF_RANGE,
                             f"offset: {offset} is past the stream's length {length}")
        if offset < self.held_from:
            if not accept_loss:
                raise AgentError(ttrpc.DATA_LOSS, f"offset: {offset} was acknowledged and dropped; "
                                                 f"the stream holds bytes from {self.held_from}")
            offset = self.held_from
        self._acknowledge(offset)
        while self.length == offset and not self.ended:
            if self._pipe is not None:
                self._pipe.wake_on_bytes(self._changed.fire)
            await self._changed.wait()
            if offset < self.held_from:  # another reader acknowledged past us
                raise AgentError(ttrpc.DATA_LOSS, f"offset: {offset} was acknowledged by another reader")
        if self._pipe is not None:
            await self._let_fill(offset, max_bytes)
        data = self._take(max_bytes, piped)
        return offset, data, self.ended and offset + len(data) == self.length

    async def _let_fill(self, offset: int, wanted: int) -> None:
        """Until the pipe holds wanted bytes from offset, stops growing, or
        FILL_WAIT passed (see FILL_BUSY_BYTES)."""
        held, waited = self.length - offset, 0.0
        while FILL_BUSY_BYTES <= held < wanted and waited < FILL_WAIT and not self.ended:
            await asyncio.sleep(FILL_PAUSE)
            waited += FILL_PAUSE
            if self._pipe is None or offset < self.held_from:
                break
            grown = self.length - offset
            if grown == held:
                break
            held = grown
        if offset < self.held_from:
            raise AgentError(ttrpc.DATA_LOSS, f"offset: {offset} was acknowledged by another reader")

    def drop(self) -> int:
        """Forget what is held; the count of bytes never read."""
        unread = self.held
        if self._pipe is not None:
            self._forget_pipe()
        self._chunks.clear()
        self.held_from = self._length
        self.end()
        return unread

    def peek(self) -> bytes:
        """What is held, not acknowledged by the look."""
        if self._pipe is not None:
            return self._pipe.peek()
        return b"".join(self._chunks)

    def state(self) -> tuple[int, int, bool]:
        return self.length, self.held_from, self.ended


class InputStream:
    def __init__(self, limit: int):
        self.limit = limit
        self.length = 0  # bytes the host has written
        self.closed = False  # the host closed it (CloseStdin)
        self.reader_gone = False  # the process no longer reads it
        self._pending = bytearray()  # taken, not yet in the pipe
        self._changed = _Signal()

    async def write(self, offset: int, data: bytes) -> tuple[int, bool]:
        """(the input's length, reader gone) once data (past what was
        already taken) is held; waits while the buffer is full."""
        if self.closed:
            raise AgentError(ttrpc.FAILED_PRECONDITION, "stdin: the process's input was closed")
        if offset > self.length:
            raise AgentError(ttrpc.OUT_OF_RANGE, f"offset: {offset} is past the input's length {self.length}")
        new = data[self.length - offset:]
        while new:
            if self.reader_gone:
                self.length += len(new)
                break
            if self.closed:
                raise AgentError(ttrpc.FAILED_PRECONDITION, "stdin: the process's input was closed")
            room = self.limit - len(self._pending)
            if room <= 0:
                await self._changed.wait()
                continue
            self._pending += new[:room]
            self.length += min(room, len(new))
            new = new[room:]
            self._changed.fire()
        return self.length, self.reader_gone

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._changed.fire()

    def lose_reader(self) -> None:
        self.reader_gone = True
        self._pending.clear()
        self._changed.fire()

    async def next_chunk(self) -> bytes | None:
        """What the pump writes next; None once closed and all written."""
        while not self._pending:
            if self.closed or self.reader_gone:
                return None
            await self._changed.wait()
        chunk = bytes(self._pending)
        self._pending.clear()
        self._changed.fire()
        return chunk
