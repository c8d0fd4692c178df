"""The kernel state bench/csi/driver_lifecycle.py builds up, and releases.

- the run attaches hundreds of loop devices, and loop device nodes stay in
  /sys/block after a detach: LoopNodes remembers which nodes the run made
  the kernel create and removes them at the end;
- force_cleanup() releases whatever the driver left below the run's root.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from pathlib import Path

from crust.sys import loop as sysloop
from crust.sys import mount as sysmount

SYS_BLOCK = Path("/sys/block")
LOOP_CTL_REMOVE = 0x4C81


def loop_names() -> set[str]:
    """The loop device nodes in /sys/block (attached or not)."""
    return {p.name for p in SYS_BLOCK.glob("loop*")}


def loops_below(root: Path) -> dict[str, str]:
    """The attached loop devices whose backing file is below root, with that file."""
    prefix = str(root) + "/"
    return {dev: b for dev, b in sysloop.attached().items() if b.startswith(prefix)}


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (VmRSS), MiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class LoopNodes:
    """The loop device nodes a run made the kernel create: those it saw
    attached below its root or named in its driver's log, less those that
    existed when it started."""

    def __init__(self, root: Path):
        self.root = root
        self.before = loop_names()
        self.seen: set[str] = set()

    def note(self) -> None:
        """Remember the loop devices attached below the root now."""
        self.seen |= {d.removeprefix("/dev/") for d in loops_below(self.root)}

    def note_logged(self, log_path: Path) -> None:
        """Remember every loop device the driver logged (it logs the device it attaches and stages)."""
        try:
            text = log_path.read_text(errors="replace")
        except OSError:
            return
        self.seen |= set(re.findall(r'"/dev/(loop[0-9]+)"', text))

    def remove(self) -> int:
        """Remove the free ones again (LOOP_CTL_REMOVE), so that the next run
        starts from the same /sys/block; busy ones stay. Returns how many went."""
        removed = 0
        try:
            fd = os.open("/dev/loop-control", os.O_RDWR)
        except OSError:
            return 0
        try:
            for name in sorted(self.seen - self.before):
                if not name.startswith("loop") or not name[4:].isdigit():
                    continue
                if (SYS_BLOCK / name / "loop" / "backing_file").exists():
                    continue  # attached again (by someone else): leave it
                try:
                    fcntl.ioctl(fd, LOOP_CTL_REMOVE, int(name[4:]))
                    removed += 1
                except OSError:
                    pass
        finally:
            os.close(fd)
        return removed


def force_cleanup(root: Path) -> tuple[int, int]:
    """Unmount whatever is mounted below root (deepest first), detach every
    loop device whose backing file is below root; returns how many of each."""
    prefix = str(root) + "/"
    unmounted = detached = 0
    for _ in range(5):
        found = [m for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]
        if not found:
            break
        for m in sorted(found, key=lambda m: -len(m.mount_point)):
            if subprocess.run(["umount", "-l", "--", m.mount_point], capture_output=True).returncode == 0:
                unmounted += 1
    for dev in loops_below(root):
        if subprocess.run(["losetup", "--detach", dev], capture_output=True).returncode == 0:
            detached += 1
    return unmounted, detached
