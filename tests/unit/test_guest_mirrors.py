"""The guest's copies of atomic-writer volumes (crust/guest/mirrors.py):
a writer laid out as kubelet's publishes versions in its order while a
reader reads the copy; the reader always finds a whole version, the copy
follows every version, old ones go, and a stopped mirror leaves nothing."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from crust.common import ttrpc
from crust.guest.errors import AgentError
from crust.guest.mirrors import Mirrors


class Writer:
    """kubelet's atomic writer, step by step: a new version directory, the
    ..data link renamed over, the names linked, the old version removed."""

    def __init__(self, root: Path):
        self.root = root
        self.version = 0
        root.mkdir(mode=0o755, parents=True)

    def publish(self, files: dict[str, str]) -> None:
        old = os.readlink(self.root / "..data") if (self.root / "..data").is_symlink() else None
        self.version += 1
        new = f"..2026_11_28_{self.version:06d}"
        (self.root / new).mkdir()
        for name, text in files.items():
            (self.root / new / name).write_text(text)
        os.symlink(new, self.root / "..data_tmp")
        os.rename(self.root / "..data_tmp", self.root / "..data")
        for name in files:
            if not (self.root / name).is_symlink():
                os.symlink(f"..data/{name}", self.root / name)
        for link in self.root.iterdir():
            if link.is_symlink() and not link.name.startswith("..") and link.name not in files:
                link.unlink()
        if old is not None:
            for f in (self.root / old).iterdir():
                f.unlink()
            (self.root / old).rmdir()


def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.01)
    raise AssertionError("not in time")


def test_a_mirror_follows_every_version_and_a_reader_never_finds_one_half_gone(tmp_path):
    writer = Writer(tmp_path / "share" / "config")
    writer.publish({"greeting": "v1", "old-key": "x"})
    run = tmp_path / "run"
    failures: list[str] = []
    reads = [0]

    async def main():
        mirrors = Mirrors(run)
        point = Path(await mirrors.start("cfg", writer.root, 0.01))
        again = await mirrors.start("cfg", writer.root, 0.01)
        other = None
        try:
            await mirrors.start("cfg", tmp_path / "share", 0.01)
        except AgentError as exc:
            other = exc.code
        first = (point / "greeting").read_text()
        stop = threading.Event()

        def read():
            while not stop.is_set():
                try:
                    text = (point / "greeting").read_text()
                    if not text.startswith("v"):
                        failures.append(f"read {text!r}")
                    reads[0] += 1
                except OSError as exc:
                    failures.append(str(exc))

        reader = threading.Thread(target=read)
        reader.start()
        try:
            for n in range(2, 40):
                writer.publish({"greeting": f"v{n}", "new-key": str(n)})
                await asyncio.sleep(0.003)
            await asyncio.to_thread(_until, lambda: (point / "greeting").read_text() == "v39")
            await asyncio.to_thread(_until, lambda: len([p for p in point.iterdir() if p.name.startswith("..2026")])
                                    == 1)
        finally:
            stop.set()
            reader.join()
        names = sorted(p.name for p in point.iterdir())
        modes = oct(point.stat().st_mode & 0o7777)
        await mirrors.stop("cfg")
        await mirrors.stop("cfg")   # a retry
        return point, again, other, first, names, modes

    point, again, other, first, names, modes = asyncio.run(main())
    assert again == str(point) == str(run / "mirror" / "cfg") and other == ttrpc.ALREADY_EXISTS
    assert first == "v1" and reads[0] > 100 and failures == [], failures[:5]
    assert names == sorted(["..data", "..2026_11_28_000039", "greeting", "new-key"]), names
    assert modes == "0o755"
    assert not point.exists() and list((run / "mirror").iterdir()) == []


def test_a_directory_the_writer_did_not_lay_out_is_refused(tmp_path):
    (tmp_path / "plain").mkdir()

    async def main():
        with pytest.raises(AgentError) as caught:
            await Mirrors(tmp_path / "run").start("plain", tmp_path / "plain", 0.01)
        return caught.value

    refused = asyncio.run(main())
    assert refused.code == ttrpc.INVALID_ARGUMENT and "no ..data" in refused.message
    assert not (tmp_path / "run" / "mirror" / "plain").exists()
