"""An ext4 image file made from a host directory, without mounting anything.

`mkfs.ext4 -d DIR` (e2fsprogs) writes the directory's tree into a new file
system in a regular file; `debugfs -w` adds more files afterwards. The host
kernel never mounts the image: only the program that wrote it parses it.
The image is sparse: its size is the room it offers, not what it costs.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from crust.common.private import open_new
from crust.sys.run import CommandError, run

MIB = 1024 * 1024
HEADROOM = 256 * MIB        # room for the container's own writes
MIN_INODES = 16384


@dataclass
class Content:
    bytes: int = 0
    inodes: int = 0

    def add(self, path: Path) -> None:
        """What copying path (a file or a whole tree, symlinks not followed) costs."""
        st = os.lstat(path)
        self.bytes += st.st_blocks * 512 + 4096
        self.inodes += 1
        if stat.S_ISDIR(st.st_mode):
            for dirpath, dirnames, filenames in os.walk(path):
                for name in dirnames + filenames:
                    try:
                        sub = os.lstat(os.path.join(dirpath, name))
                    except OSError:
                        continue
                    self.bytes += sub.st_blocks * 512 + (4096 if stat.S_ISDIR(sub.st_mode) else 0)
                    self.inodes += 1


def image_size(content: Content) -> int:
    """Content plus a quarter (metadata, journal) plus HEADROOM, in MiB."""
    size = content.bytes + content.bytes // 4 + HEADROOM
    return (size + MIB - 1) // MIB * MIB


async def make_ext4(image: Path, source: Path, content: Content, label: str = "") -> int:
    """A new ext4 image at image holding source's tree; returns its size."""
    size = image_size(content)
    fd = open_new(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)
    inodes = max(MIN_INODES, content.inodes * 2)
    argv = ["mkfs.ext4", "-q", "-F", "-N", str(inodes), "-E", "root_owner=0:0", "-d", str(source)]
    if label:
        argv += ["-L", label[:16]]
    await run([*argv, str(image)], timeout=600)
    return size


def _quoted(path: str) -> str:
    if '"' in path or "\n" in path or "\\" in path:
        raise ValueError(f"{path!r}: a path debugfs cannot be told (a quote, a backslash or a newline)")
    return f'"{path}"'


def debugfs_copy_commands(source: Path, dest: str) -> list[str]:
    """debugfs commands that copy source (a file or a tree) to dest in the
    image, with modes and owners; devices, FIFOs and sockets are skipped."""
    commands: list[str] = []

    def one(src: str, dst: str) -> None:
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            commands.append(f"symlink {_quoted(dst)} {_quoted(os.readlink(src))}")
        elif stat.S_ISDIR(st.st_mode):
            commands.append(f"mkdir {_quoted(dst)}")
            for name in sorted(os.listdir(src)):
                one(os.path.join(src, name), f"{dst}/{name}")
        elif stat.S_ISREG(st.st_mode):
            commands.append(f"write {_quoted(src)} {_quoted(dst)}")
        else:
            return
        if not stat.S_ISLNK(st.st_mode):
            commands.extend([f"sif {_quoted(dst)} mode 0{st.st_mode:o}",
                             f"sif {_quoted(dst)} uid {st.st_uid}", f"sif {_quoted(dst)} gid {st.st_gid}"])

    one(str(source), dest)
    return commands


async def debugfs_write(image: Path, commands: list[str], script: Path) -> None:
    """Run debugfs -w with these commands on image. debugfs exits 0 whatever
    its commands did: any line on stderr but its banner is a failure."""
    fd = open_new(script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(commands) + "\n")
    try:
        result = await run(["debugfs", "-w", "-f", str(script), str(image)], timeout=600)
    finally:
        script.unlink(missing_ok=True)
    errors = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("debugfs ")]
    if errors:
        raise CommandError(result.argv, result.returncode, "\n".join(errors[:5]))
