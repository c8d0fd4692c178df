"""Release every mount and loop device that lives under one directory.

Used by `crust demo` (and the tests) to clean up after themselves even when a
step failed half-way: only mounts whose mount point is below `root` and loop
devices whose backing file is below `root` are touched, never anything else.
A mount that will not go is an error (StillMounted): whoever removes the
directory next would remove through it, into the file system mounted there.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from crust.sys import loop, mount

# Unmounting one mount can uncover another stacked below it: rounds go on
# while each releases something, up to this many.
MAX_ROUNDS = 10


class StillMounted(Exception):
    """A mount under the root that would not unmount: the directory must not
    be removed."""


def release_under(root: str | Path) -> list[str]:
    """Detach and unmount (deepest first) what lives under root; returns what
    was released. StillMounted when a mount under root would not go.

    Loop devices are let go first: once a file system under root is
    unmounted (lazily, when busy), sysfs names the files on it from that
    file system's own root, no longer under root, and a device over one of
    them would be left attached. A device still mounted is detached by the
    kernel when its last mount goes (losetup -d sets autoclear)."""
    prefix = str(Path(root).resolve()) + "/"
    released: list[str] = []

    def detach() -> None:
        for device, backing in loop.attached().items():
            if backing.startswith(prefix) and device not in released:
                done = subprocess.run(["losetup", "--detach", device], capture_output=True, timeout=30)
                if done.returncode == 0:
                    released.append(device)

    detach()
    refused: dict[str, str] = {}
    for _ in range(MAX_ROUNDS):
        below = [m for m in mount.mounts() if (m.mount_point + "/").startswith(prefix)]
        if not below:
            break
        refused = {}
        for entry in sorted(below, key=lambda m: -len(m.mount_point)):
            done = subprocess.run(["umount", "-l", "--", entry.mount_point], capture_output=True, text=True,
                                  timeout=30)
            if done.returncode == 0:
                released.append(entry.mount_point)
            else:
                refused[entry.mount_point] = done.stderr.strip() or f"umount exited {done.returncode}"
        if len(refused) == len(below):
            break   # nothing went this round: the next would fare no better
    detach()
    left = [m.mount_point for m in mount.mounts() if (m.mount_point + "/").startswith(prefix)]
    if left:
        why = "; ".join(f"{point}: {refused.get(point, 'still mounted')}" for point in left)
        raise StillMounted(f"{root}: {len(left)} mount(s) under it would not go: {why}")
    return released
