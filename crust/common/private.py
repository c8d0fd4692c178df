"""Directories and files crust makes for itself: 0700 and 0600, whatever the umask.

A daemon started under umask 000 (a careless unit file, a container image)
would otherwise make world-writable state: Path.mkdir(parents=True) gives
the parents it creates 0777 minus the umask, open() gives 0666 minus it. So
crust names the mode of everything it creates: its directories (state,
records, pools, run directories) are 0700 and its files (records, backing
images, logs) 0600; a file meant for other readers names its mode where it
is written (pool.json, status.json). mkdir and open apply the umask to the
mode given, which can only take bits away, so a created directory or file
is never looser than asked, not even for an instant; a chmod after it puts
back what a strict umask took.
"""

from __future__ import annotations

import os

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_dirs(path: str | os.PathLike, mode: int = DIR_MODE) -> None:
    """path and every missing parent, each created with exactly `mode`;
    directories that exist are left as their owner made them. (os.path
    only: the OCI runtime calls this in a process started for one call,
    where importing pathlib would cost more than the work.)"""
    current = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.lexists(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs, as it is
        os.chmod(directory, mode)


def open_new(path: str | os.PathLike, flags: int = os.O_WRONLY | os.O_CREAT | os.O_EXCL,
             mode: int = FILE_MODE, dir_fd: int | None = None) -> int:
    """os.open of one of crust's own files, which may be created: it gets
    exactly `mode`, also when it existed already."""
    fd = os.open(path, flags | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        if flags & os.O_CREAT:
            os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd
