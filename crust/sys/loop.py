"""Loop devices over backing files (losetup and /sys/block/loopN).

Which loop device serves a backing file is always read back from the kernel,
never remembered, so a daemon killed between attach and its next record write
finds the device again on restart instead of attaching a second one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from crust.sys.run import run

SYS_BLOCK = Path("/sys/block")


def _backing_file(dev_name: str) -> str | None:
    try:
        text = (SYS_BLOCK / dev_name / "loop" / "backing_file").read_text().strip()
    except (FileNotFoundError, NotADirectoryError, OSError):
        return None
    # The kernel appends " (deleted)" when the file was unlinked underneath.
    return text


def devices_for(backing_file: str | os.PathLike) -> list[str]:
    """Every loop device currently attached to backing_file (normally 0 or 1)."""
    wanted = os.path.realpath(backing_file)
    found = []
    for entry in SYS_BLOCK.glob("loop*"):
        if _backing_file(entry.name) == wanted:
            found.append(f"/dev/{entry.name}")
    return sorted(found)


def attached() -> dict[str, str]:
    """Map of /dev/loopN -> backing file for every attached loop device."""
    result = {}
    for entry in SYS_BLOCK.glob("loop*"):
        backing = _backing_file(entry.name)
        if backing:
            result[f"/dev/{entry.name}"] = backing
    return result


def read_only(device: str) -> bool:
    """Is the loop device read-only (attached with --read-only)?"""
    try:
        return (SYS_BLOCK / os.path.basename(device) / "ro").read_text().strip() == "1"
    except OSError:
        return False


async def attach(backing_file: str | os.PathLike, *, direct_io: bool = False, read_only: bool = False) -> str:
    """Attach backing_file to a free loop device and return its path.

    read_only attaches a second, read-only device beside the writable one
    (--nooverlap would hand back the writable device instead).
    """
    argv = ["losetup", "--find", "--show", "--read-only" if read_only else "--nooverlap"]
    if direct_io:
        argv.append("--direct-io=on")
    argv.append(os.path.realpath(backing_file))
    result = await run(argv)
    return result.stdout.strip()


async def refresh_capacity(device: str) -> None:
    """Make the loop device pick up the new size of its grown backing file."""
    await run(["losetup", "--set-capacity", device])


async def detach(device: str) -> None:
    await run(["losetup", "--detach", device])


def detach_sync(device: str) -> None:
    """Detach at start-up, before the event loop serves anything."""
    subprocess.run(["losetup", "--detach", device], check=True, capture_output=True, timeout=30)


async def list_json() -> list[dict]:
    result = await run(["losetup", "--json", "--list"])
    if not result.stdout.strip():
        return []
    return json.loads(result.stdout).get("loopdevices", [])
