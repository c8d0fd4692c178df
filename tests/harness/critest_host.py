"""What critest's specs leave on the host, and its removal after each run
(tests/harness/critest.py):

- System V shared memory: the HostIpc specs make a segment on the host
  (`ipcmk -M 1048576`) and never remove it;
- mounts and directories: the specs that bind a host directory into a
  container make it with Go's os.MkdirTemp, below TMPDIR. The mount
  propagation specs mount on the host below it, and in the 'rshared' spec
  the container's own bind mount propagates back to the host, where the
  spec's cleanup does not look; a spec that fails half-way leaves its
  mounts too, and a directory with a mount below it is not removed. Each
  run gets a TMPDIR of its own (HostTraces.tmpdir), released whole
  afterwards, so nothing outside it is ever touched.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from crust.sys.sweep import release_under

SHM = Path("/proc/sysvipc/shm")
# The HostIpc specs' segment size.
CRITEST_SHM_BYTES = 1048576


def shm_segments() -> dict[int, dict[str, int]]:
    """The host's System V shared memory segments, by id."""
    lines = SHM.read_text().splitlines()
    header = lines[0].split()
    return {int(row["shmid"]): row for row in (dict(zip(header, map(int, line.split()))) for line in lines[1:])}


def remove_critest_segments(before: dict[int, dict[str, int]], since: float) -> list[str]:
    """The segments critest's HostIpc specs made on the host during a run:
    new since `before`, critest's size, made at or after `since`, attached
    to nothing, their creator gone."""
    removed = []
    for shmid, row in shm_segments().items():
        if (shmid in before or row["size"] != CRITEST_SHM_BYTES or row["nattch"] != 0
                or row["ctime"] < int(since) or Path(f"/proc/{row['cpid']}").exists()):
            continue
        if subprocess.run(["ipcrm", "-m", str(shmid)], capture_output=True).returncode == 0:
            removed.append(f"shm {shmid}")
    return removed


class HostTraces:
    """Around one critest run (or several at once, see
    run_critest_sharded): `with HostTraces(directory) as traces:` gives
    critest the TMPDIR traces.tmpdir; at the end its segments are removed,
    every mount below tmpdir released (deepest first) and tmpdir removed.
    traces.removed says what had to go (the mounts only: segments and
    directories are left by specs that pass too)."""

    def __init__(self, directory: Path) -> None:
        self.tmpdir = directory / "tmp"
        self.removed: list[str] = []

    def __enter__(self) -> HostTraces:
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self._segments, self._since = shm_segments(), time.time()
        return self

    def __exit__(self, *exc) -> None:
        remove_critest_segments(self._segments, self._since)
        self.removed = release_under(self.tmpdir)
        # Nothing is mounted below it any more: rmtree stays on its file system.
        shutil.rmtree(self.tmpdir, ignore_errors=True)
