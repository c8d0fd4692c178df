"""One rule for the identity of a deferred volume's device.

What a sandbox mounts is the device the CSI plugin returned for that target:
a path and its major:minor. Names of block devices are reused (a loop
device detached and attached again to another file keeps its name), and a
file on disk can be rewritten, so at every hand-over (plugin -> proxy,
Runtime API -> proxy, proxy -> handler through the claim, handler -> the
device it opens) the numbers are compared with what the path is now. Any
disagreement is refused with FAILED_PRECONDITION and logged, naming both.
"""

from __future__ import annotations

import logging
import os
import stat

from crust.common.errors import FailedPrecondition
from crust.contract.mountinfo import MountInfo

log = logging.getLogger(__name__)


def numbers_at(path: str) -> tuple[int, int] | None:
    """major:minor of the block device at path now; None when nothing is
    there; ValueError when something else is (a file, a character device)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISBLK(st.st_mode):
        raise ValueError(f"{path} is not a block device")
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def refuse(message: str, **fields) -> FailedPrecondition:
    log.error("device identity refused", extra={"fields": {"error": message, **fields}})
    return FailedPrecondition(message)


def handed_over(device: str, major: int, minor: int, *, target_path: str, source: str) -> tuple[int, int]:
    """The numbers of a device handed to the proxy (by the plugin or the
    Runtime API): the given ones when the path is that device or is not on
    this host (a runtime's own device, checked again where it is mounted);
    the path's own when none were given. A path that is another device, or
    no block device, is refused."""
    try:
        found = numbers_at(device)
    except (ValueError, OSError) as exc:
        raise refuse(f"{source}: device {device} of {target_path}: {exc}", target_path=target_path) from None
    if found is None:
        return major, minor
    if (major, minor) == (0, 0):
        return found
    if found != (major, minor):
        raise refuse(f"{source}: device {device} of {target_path} is {found[0]}:{found[1]}, not the "
                     f"{major}:{minor} it was described with", target_path=target_path, device=device)
    return found


def agree(entry: MountInfo, claimed: MountInfo) -> MountInfo:
    """The description the handler mounts: the one the proxy answered the
    claim with (its record), which must be the volume the handler found in
    the watched directory (same target, same device numbers)."""
    if claimed.target_path != entry.target_path:
        raise refuse(f"the claim of {entry.target_path} was answered for {claimed.target_path}",
                     target_path=entry.target_path)
    if (claimed.device_major, claimed.device_minor) == (0, 0):
        raise refuse(f"the proxy's description of {entry.target_path} carries no device number; "
                     "its device cannot be told from another", target_path=entry.target_path)
    if (entry.device_major, entry.device_minor) != (claimed.device_major, claimed.device_minor):
        raise refuse(f"the watched directory's entry of {entry.target_path} names device {entry.device} "
                     f"({entry.device_major}:{entry.device_minor}), the proxy's claim {claimed.device} "
                     f"({claimed.device_major}:{claimed.device_minor}); nothing is mounted",
                     target_path=entry.target_path, entry_device=entry.device, claimed_device=claimed.device)
    return claimed
