"""Files replaced whole or not at all (crust.common.atomicfile), even across
a SIGKILL, and never written through what was planted beside them.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crust.common import atomicfile
from crust.common.errors import (
    NoSpace,
)


def _temporaries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_write_atomic_replaces_whole_file(tmp_path):
    target = tmp_path / "rec.json"
    target.write_bytes(b"x" * 10000)
    os.chmod(target, 0o644)
    atomicfile.write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _temporaries(tmp_path) == []
    atomicfile.write_atomic(target, b"other", mode=0o644)
    assert target.read_bytes() == b"other"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


@pytest.mark.parametrize("failing", ["rename", "fsync"])
def test_write_atomic_failure_keeps_old_content(tmp_path, monkeypatch, failing):
    target = tmp_path / "rec.json"
    atomicfile.write_atomic(target, b"old content")
    real = getattr(os, failing)
    calls = []

    def boom(*args, **kw):
        calls.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    # A full disk is the caller's RESOURCE_EXHAUSTED, naming the directory.
    with pytest.raises(NoSpace, match=str(tmp_path)):
        atomicfile.write_atomic(target, b"new content that must not appear")
    monkeypatch.setattr(os, failing, real)
    assert calls, f"os.{failing} was never called: the failure was not simulated"
    assert target.read_bytes() == b"old content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


def test_clean_temporaries_and_remove_durably(tmp_path):
    (tmp_path / ".a.json.k3j4.tmp").write_bytes(b"partial")
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "keep.tmp").write_bytes(b"not ours: no leading dot")
    assert atomicfile.clean_temporaries(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "keep.tmp"]
    assert atomicfile.remove_durably(tmp_path / "a.json") is True
    assert atomicfile.remove_durably(tmp_path / "a.json") is False


def test_write_atomic_reuse_fills_the_replaced_inode(tmp_path):
    target, spare = tmp_path / "rec.json", tmp_path / ".rec.json.spare.tmp"
    atomicfile.write_atomic(target, b"first, and longer than what follows", reuse=True)
    first = target.stat().st_ino
    assert not spare.exists()  # nothing replaced yet
    atomicfile.write_atomic(target, b"second", reuse=True)
    assert target.read_bytes() == b"second"
    assert spare.stat().st_ino == first and spare.read_bytes() == b"first, and longer than what follows"
    second = target.stat().st_ino
    atomicfile.write_atomic(target, b"third", reuse=True)
    # No inode was made: the record is now the first one, cut at its new length.
    assert target.stat().st_ino == first and target.read_bytes() == b"third"
    assert spare.stat().st_ino == second
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert atomicfile.remove_durably(target, spare=True) is True
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo", "directory"])
def test_write_atomic_reuse_never_writes_through_a_planted_spare(tmp_path, planted):
    target, spare = tmp_path / "rec.json", tmp_path / ".rec.json.spare.tmp"
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a record")
    atomicfile.write_atomic(target, b"old", reuse=True)
    if planted == "symlink":
        spare.symlink_to(victim)
    elif planted == "hardlink":
        os.link(victim, spare)
    elif planted == "fifo":
        os.mkfifo(spare)
    else:
        spare.mkdir()
    atomicfile.write_atomic(target, b"new", reuse=True)
    assert target.read_bytes() == b"new" and victim.read_bytes() == b"not a record"
    # The planted thing is gone or set aside under a temporary's name; the spare is the old record.
    assert spare.read_bytes() == b"old"


_REWRITER = """
import sys
from crust.common import atomicfile
versions = [b"A" * 5000, b"B" * 300, b'{"c": 1}']
i = 0
while True:
    atomicfile.write_atomic(sys.argv[1], versions[i % 3], reuse=True)
    i += 1
    if i == 3:
        print("ready", flush=True)
"""


def test_write_atomic_reuse_survives_sigkill(tmp_path):
    """A writer killed at any instant leaves the record whole, old or new."""
    target = tmp_path / "rec.json"
    for delay in (0.0, 0.003, 0.007, 0.013, 0.021, 0.034, 0.055, 0.089):
        proc = subprocess.Popen([sys.executable, "-c", _REWRITER, str(target)], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"ready\n"
            time.sleep(delay)
        finally:
            proc.kill()
            proc.wait()
        assert target.read_bytes() in (b"A" * 5000, b"B" * 300, b'{"c": 1}')
        assert atomicfile.clean_temporaries(tmp_path) <= 2  # the spare, and a temporary cut short
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]
