"""Loop devices a test attaches itself: each let go on every path out of
the test, and a device that does not go fails the test naming what holds
it, never left attached in silence.

A detach of a device that something still holds open (a mount of it, in
this or in another mount namespace: a container or a daemon another test
starts copies the host's mounts into its new namespace) only marks it to
go at the last close (autoclear). That is waited for, up to LET_GO.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from crust.sys import loop as sysloop
from crust.sys import mount as sysmount

# How long a detached device may take to go once its holders let go.
LET_GO = 30.0


@contextlib.contextmanager
def attached(image: str | os.PathLike, **kw) -> Iterator[str]:
    """image attached to a loop device (sysloop.attach_sync's keywords),
    released (release()) however the block ends."""
    device = sysloop.attach_sync(image, **kw)
    try:
        yield device
    finally:
        release(device, image)


def release(device: str, image: str | os.PathLike, timeout: float = LET_GO) -> None:
    """The device's mounts in this namespace unmounted (deepest first), the
    device detached, and gone from image within timeout; AssertionError
    naming each step that failed and what still holds the device."""
    problems = []
    try:
        st = os.stat(device)
        mounted = sysmount.of_device(os.major(st.st_rdev), os.minor(st.st_rdev))
    except OSError as exc:
        mounted = []
        problems.append(f"its mounts cannot be listed: {exc}")
    for entry in sorted(mounted, key=lambda m: -len(m.mount_point)):
        try:
            sysmount.unmount_all(entry.mount_point)
        except OSError as exc:
            problems.append(str(exc))
    try:
        sysloop.detach_sync(device)
    except OSError as exc:
        problems.append(str(exc))
    deadline = time.monotonic() + timeout
    while sysloop.serves(device, image) and time.monotonic() < deadline:
        time.sleep(0.1)
    if sysloop.serves(device, image):
        held = "; ".join(holders(device)) or "nothing found"
        problems.append(f"still attached {timeout:g} s after its detach, held by: {held}")
    if problems:
        raise AssertionError(f"loop device {device} over {image} not released: {'; '.join(problems)}")


def release_each(devices: Iterable[tuple[str, str | os.PathLike]]) -> None:
    """release() of each (device, image), every one even when another
    fails; AssertionError naming each that failed."""
    failed = []
    for device, image in devices:
        try:
            release(device, image)
        except AssertionError as exc:
            failed.append(str(exc))
    if failed:
        raise AssertionError("; ".join(failed))


def release_all_under(path: str | os.PathLike) -> list[str]:
    """Every loop device over a file below path released (release()): what
    a test left attached. Their descriptions, for the caller to fail with;
    AssertionError when one of them cannot be released."""
    prefix = str(Path(path).resolve()) + "/"
    left = {d: b for d, b in sysloop.attached().items() if b.startswith(prefix)}
    release_each((device, backing.removesuffix(" (deleted)")) for device, backing in left.items())
    return [f"{device} over {backing}" for device, backing in left.items()]


def holders(device: str) -> list[str]:
    """What holds the device open: a mount of it in any process's mount
    namespace (one process named per namespace), a process with it open,
    a block device stacked on it."""
    try:
        rdev = os.stat(device).st_rdev
    except OSError:
        return []
    numbers = f"{os.major(rdev)}:{os.minor(rdev)}"
    found, namespaces = [], set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            namespace = os.readlink(f"/proc/{pid}/ns/mnt")
            if namespace not in namespaces:
                namespaces.add(namespace)
                with open(f"/proc/{pid}/mountinfo") as f:
                    points = [line.split()[4] for line in f if line.split()[2] == numbers]
                if points:
                    found.append(f"pid {pid} ({_comm(pid)}) in mount namespace {namespace} mounts it at "
                                 f"{', '.join(points)}")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == device:
                    found.append(f"pid {pid} ({_comm(pid)}) has it open")
                    break
        except OSError:
            continue   # gone meanwhile, or not ours to read
    stacked = Path("/sys/block") / os.path.basename(device) / "holders"
    found += [f"block device {h.name} is stacked on it" for h in (stacked.iterdir() if stacked.is_dir() else ())]
    return found


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
