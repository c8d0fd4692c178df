"""Release every mount and loop device that lives under one directory.

Used by `crust demo` (and the tests) to clean up after themselves even when a
step failed half-way: only mounts whose mount point is below `root` and loop
devices whose backing file is below `root` are touched, never anything else.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from crust.sys import loop, mount


def release_under(root: str | Path) -> list[str]:
    """Detach and unmount (deepest first) what lives under root; returns what
    was released.

    Loop devices are let go first: once a file system under root is
    unmounted (lazily, when busy), sysfs names the files on it from that
    file system's own root, no longer under root, and a device over one of
    them would be left attached. A device still mounted is detached by the
    kernel when its last mount goes (losetup -d sets autoclear)."""
    prefix = str(Path(root).resolve()) + "/"
    released = []

    def detach() -> None:
        for device, backing in loop.attached().items():
            if backing.startswith(prefix) and device not in released:
                subprocess.run(["losetup", "--detach", device], capture_output=True, timeout=30)
                released.append(device)

    detach()
    for _ in range(3):
        below = [m for m in mount.mounts() if (m.mount_point + "/").startswith(prefix)]
        if not below:
            break
        for entry in sorted(below, key=lambda m: -len(m.mount_point)):
            subprocess.run(["umount", "-l", "--", entry.mount_point], capture_output=True, timeout=30)
            released.append(entry.mount_point)
    detach()
    return released
