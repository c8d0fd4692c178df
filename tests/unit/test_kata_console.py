"""What a guest can make the host write is bounded: its console (a file
of at most FILE_BYTES moved to .1 when full: the newest bytes always kept,
never more than twice the bound on disk), read the way QEMU's socket
chardev hands it over (a real unix socket written in bursts by another
process), and its words in the handler's log lines and errors."""

from __future__ import annotations

import asyncio
import random
import sys

from crust.common import ttrpc
from crust.kata.vmm import console
from crust.kata.agent.client import GUEST_TEXT_CHARS, guest_text, handler_error
from crust.kata.vmm.console import ConsoleLog, RotatingFile, previous


def on_disk(path) -> bytes:
    old = previous(path).read_bytes() if previous(path).exists() else b""
    return old + (path.read_bytes() if path.exists() else b"")


def test_the_console_file_keeps_the_newest_bytes_within_twice_its_bound(tmp_path):
    path = tmp_path / "console.log"
    limit = 1000
    file = RotatingFile(lambda: path, limit)
    rng = random.Random(7)
    written = b""
    for n in range(400):
        chunk = bytes([65 + n % 26]) * rng.choice([1, 17, 300, 999, 1000, 1001, 2500])
        file.write(chunk)
        written += chunk
        assert path.stat().st_size <= limit
        assert not previous(path).exists() or previous(path).stat().st_size <= limit
        kept = on_disk(path)
        assert written.endswith(kept), n
        assert len(kept) >= min(len(written), limit), (n, len(kept))
    file.close()
    assert file.rotations > 10


def test_the_console_file_opened_again_goes_on_from_its_size(tmp_path):
    path = tmp_path / "console.log"
    path.write_bytes(b"x" * 900)
    file = RotatingFile(lambda: path, 1000)
    file.write(b"y" * 50)
    assert path.read_bytes() == b"x" * 900 + b"y" * 50
    file.write(b"z" * 100)
    assert previous(path).read_bytes() == b"x" * 900 + b"y" * 50 and path.read_bytes() == b"z" * 100
    file.close()


# A process in QEMU's place: a socket chardev server that writes what the
# guest's UART sends, in bursts, as fast as its reader takes it.
FLOOD = """
import os, socket, sys
path, total = sys.argv[1], int(sys.argv[2])
server = socket.socket(socket.AF_UNIX)
server.bind(path)
server.listen(1)
print("listening", flush=True)
conn, _ = server.accept()
line = b"crust-flood " + b"x" * 100 + b"\\n"
sent = 0
while sent < total:
    conn.sendall(line * 64)
    sent += len(line) * 64
conn.sendall(b"the last line\\n")
conn.close()
"""


async def test_a_console_written_past_its_bound_over_a_socket_stays_within_it(tmp_path, monkeypatch):
    path = tmp_path / "console.log"
    sock = tmp_path / "console.sock"
    limit = 256 << 10
    total = 4 << 20   # sixteen times the bound
    writer = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOOD, str(sock), str(total),
                                                  stdout=asyncio.subprocess.PIPE)
    try:
        assert await writer.stdout.readline() == b"listening\n"
        log = ConsoleLog(sock, lambda: path, limit)
        assert await log.open(timeout=5)
        biggest = 0
        while writer.returncode is None:
            biggest = max(biggest, len(on_disk(path)))
            try:
                await asyncio.wait_for(writer.wait(), 0.01)
            except asyncio.TimeoutError:
                pass
        await asyncio.sleep(0.2)
        await log.close()
    finally:
        if writer.returncode is None:
            writer.kill()
        await writer.wait()
    assert biggest <= 2 * limit and path.stat().st_size <= limit and previous(path).stat().st_size <= limit
    assert log.file.rotations >= total // limit - 1
    assert on_disk(path).endswith(b"the last line\n")
    assert console.tail(path, 1) == "the last line"


def test_a_tail_of_an_endless_line_is_bounded(tmp_path):
    path = tmp_path / "console.log"
    path.write_bytes(b"a" * (3 * console.TAIL_BYTES))
    assert len(console.tail(path, 5)) == console.TAIL_BYTES
    assert console.tail(tmp_path / "none.log", 5) == ""


def test_the_guests_words_are_quoted_short_and_on_one_line():
    assert guest_text("no such file") == "no such file"
    long = "e" * (5 * GUEST_TEXT_CHARS)
    quoted = guest_text(long)
    assert len(quoted) < GUEST_TEXT_CHARS + 40 and quoted.endswith(f"({4 * GUEST_TEXT_CHARS} more characters)")
    assert guest_text("a\nforged\rline\x1b[2J") == "a forged line [2J"
    error = handler_error(ttrpc.TtrpcError(ttrpc.NOT_FOUND, "x" * (1 << 22)), "container c")
    assert len(error.message) < GUEST_TEXT_CHARS + 100 and error.message.startswith("container c: the guest's agent:")
