"""The host-side invariants of tests/integration/test_hostile_input.py: the
host's mount table read with the test's own parser, loop devices, entries a
daemon may create in /etc or the scratch directory outside the test's root,
tracebacks in the daemons' logs, and the file faults planted where crust
reads a file. The hostile requests are in tests/harness/hostile_requests.py.

Nothing here touches the host except what the test planted: the symlinks
below the test root, a scratch directory outside it (`outside`), and
entries named `<token>*` in /etc that a daemon following the /etc symlink
may create (they are removed after every example).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from crust.sys import loop as sysloop
from tests.harness.hostile_requests import Place


def foreign(path: str, root: Path, outside: Path) -> bool:
    """Is path in another crust test's directory (/tmp/crust-*: other
    test runs' roots and scratch directories)? Not this test's business.
    Nor are sandboxes' network namespaces: they are named in /run/netns by
    design (crust.sys.netns), whichever test's handler made them, and
    tests/integration/test_handler_network.py checks that they go with their sandbox; nor
    /run/netns itself, which the first namespace made after the machine
    booted binds onto itself (iproute2's `ip netns add` does),
    whichever test beside this one made it. Nor are
    the ones CNI plugins name for the pods of a containerd running beside
    the test (cni-<uuid>): no daemon under test calls CNI. Nor is what the
    tests running beside this one (the suite runs in parallel workers) make
    in pytest's own temporary directories (tmp_path). Nor is crun's own
    binary, which every crun run on the host (the guest agent's tests, a
    CRI-O beside) binds read-only onto a file `crun.XXXXXX` for a moment
    (its guard against a container rewriting it): no daemon under test runs
    crun on the host."""
    if path == NETNS_DIR or path.startswith(NETNS_MOUNTS) or (path + "/").startswith(PYTEST_TEMP + "/"):
        return True
    if CRUN_CLONED_BINARY.fullmatch(os.path.basename(path)):
        return True
    tmp_crust = str(root.parent) + "/crust-"
    return path.startswith(tmp_crust) and not (path + "/").startswith((str(root) + "/", str(outside) + "/"))


def unreachable(backing: str) -> bool:
    """A loop device's file named by a path that leads nowhere here: sysfs
    names the file as its attacher reached it, so this is a file of another
    mount namespace, or of a file system unmounted lazily since (another
    test's), never one our daemons, which share this namespace, made
    outside the root. A file deleted since is named with " (deleted)": that
    one counts."""
    return not backing.endswith(" (deleted)") and not os.path.lexists(backing)


NETNS_DIR = "/run/netns"
# mkstemp's template of crun's cloned-binary guard (crun's cloned_binary.c).
CRUN_CLONED_BINARY = re.compile(r"crun\.[A-Za-z0-9]{6}")
NETNS_MOUNTS = (f"{NETNS_DIR}/crust-", f"{NETNS_DIR}/cni-")
# Where pytest makes every test's tmp_path (its rule: $PYTEST_DEBUG_TEMPROOT
# or the system's temporary directory, then pytest-of-<user>).
PYTEST_TEMP = os.path.join(os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir(),
                           f"pytest-of-{getpass.getuser()}")


def _unescape(field: bytes) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


@dataclass(frozen=True)
class Mount:
    mount_id: int
    mount_point: str
    fs_type: str
    source: str


def host_mounts() -> list[Mount]:
    """The host's mount table, read independently of crust.sys.mount: split
    on b"\\n" only (a mount point may hold \\r, \\x1c, \\x85 or \\u2028, which
    str.splitlines() and text-mode reads break lines at), names kept as
    bytes (os.fsdecode) so umount gets exactly the kernel's path."""
    with open("/proc/self/mountinfo", "rb") as f:
        data = f.read()
    found = []
    for line in data.split(b"\n"):
        left, sep, right = line.partition(b" - ")
        fields, rest = left.split(b" "), right.split(b" ")
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        found.append(Mount(int(fields[0]), _unescape(fields[4]), os.fsdecode(rest[0]), _unescape(rest[1])))
    return found


@dataclass
class HostState:
    mounts: set[tuple[int, str, str, str]]  # (mount id, mount point, fs type, source): ids are reused
    loops: dict[str, str]  # device -> backing file

    @classmethod
    def take(cls) -> "HostState":
        return cls({(m.mount_id, m.mount_point, m.fs_type, m.source) for m in host_mounts()}, sysloop.attached())

    def new_mounts_outside(self, now: "HostState", root: Path, outside: Path) -> list[tuple[str, str, str]]:
        mine = str(root) + "/"
        return sorted(m[1:] for m in now.mounts - self.mounts
                      if not (m[1] + "/").startswith(mine) and not foreign(m[1], root, outside))

    def new_loops_outside(self, now: "HostState", root: Path, outside: Path) -> list[tuple[str, str]]:
        mine = str(root) + "/"
        return sorted((d, b) for d, b in now.loops.items() if self.loops.get(d) != b
                      and not b.startswith(mine) and not foreign(b, root, outside) and not unreachable(b))


def unmount_ours_outside(place: Place) -> list[str]:
    """Unmount what a daemon mounted in the outside directory or on an
    /etc/<token>* entry (only the test's own names), deepest first."""
    prefixes = (str(place.outside) + "/", "/etc/" + place.token)
    done = []
    for _ in range(5):
        mine = [m for m in host_mounts() if (m.mount_point + "/").startswith(prefixes)
                or m.mount_point.startswith(prefixes[1])]
        if not mine:
            break
        for m in sorted(mine, key=lambda m: -len(m.mount_point)):
            subprocess.run(["umount", "-l", m.mount_point], capture_output=True)
            done.append(m.mount_point)
    return done


def unmount_under(root: Path) -> None:
    """Unmount (lazily, deepest first) every mount below root, its loop
    devices detached first (after the unmount of a tmpfs below root, sysfs
    names their files from that tmpfs's own root, outside root)."""
    prefix = str(root) + "/"
    detach_loops_of(prefix)
    for _ in range(5):
        mine = [m for m in host_mounts() if m.mount_point.startswith(prefix)]
        if not mine:
            return
        for m in sorted(mine, key=lambda m: -len(m.mount_point)):
            subprocess.run(["umount", "-l", m.mount_point], capture_output=True)


def remove_etc_entries(place: Place) -> list[str]:
    removed = []
    for name in place.etc_entries():
        path = os.path.join("/etc", name)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def detach_loops_of(prefix: str) -> None:
    for device, backing in sysloop.attached().items():
        if backing.startswith(prefix):
            subprocess.run(["losetup", "-d", device], capture_output=True)


class LogWatch:
    """New text in the daemons' log files since the last look."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        self.offsets = {p: p.stat().st_size if p.exists() else 0 for p in paths}

    def new_text(self) -> dict[Path, str]:
        found = {}
        for p in self.paths:
            if not p.exists():
                continue
            with open(p, "rb") as f:
                f.seek(self.offsets.get(p, 0))
                data = f.read()
            self.offsets[p] = self.offsets.get(p, 0) + len(data)
            if data:
                found[p] = data.decode(errors="replace")
        return found


TRACEBACK = re.compile(r"Traceback \(most recent call last\)")


def tracebacks(text: str) -> list[str]:
    """The tracebacks in a daemon log (JSON lines with an "exc" field, or
    raw text a crashing interpreter wrote), each cut to its deepest frames
    and its error, with the record's message and RPC."""
    found = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not TRACEBACK.search(line):
            continue
        try:
            entry = json.loads(line)
            exc, head = entry.get("exc", ""), f"{entry.get('rpc', '')} {entry.get('msg', '')}".strip()
        except ValueError:
            # Raw text: the traceback runs until a line that is not indented
            # after its error line.
            block = [line]
            while i < len(lines) and not lines[i].startswith("{"):
                block.append(lines[i])
                i += 1
            exc, head = "\n".join(block), "(raw stderr)"
        found.append(head + "\n" + shorten(exc))
    return found


def shorten(exc: str, frames: int = 3) -> str:
    lines = [line for line in exc.splitlines() if line.strip()]
    starts = [k for k, line in enumerate(lines) if line.lstrip().startswith("File ")]
    if len(starts) > frames:
        lines = lines[starts[-frames]:]
    return "\n".join(lines[-(frames * 2 + 4):])


def crust_frame(summary: str) -> str:
    """The deepest frame of crust's own code (where crust let the error out)."""
    frames = [line.strip() for line in summary.splitlines() if line.strip().startswith("File ") and "/crust/" in line]
    return frames[-1] if frames else deepest_frame(summary)


def deepest_frame(summary: str) -> str:
    frames = [line.strip() for line in summary.splitlines() if line.strip().startswith("File ")]
    return frames[-1] if frames else ""


def scratch_outside(next_to: Path) -> Path:
    """The directory the outside symlinks point to: next to the test root
    (so root/../<name> reaches it too), removed by the test."""
    return Path(tempfile.mkdtemp(prefix="crust-hostile-out-", dir=next_to.parent))


# -- file-level faults -------------------------------------------------------------------------------

# What a buggy root component can leave where crust reads a file.
FILE_FAULTS = ("not-json", "truncated", "wrong-types", "empty", "oversized", "directory", "symlink-to-file",
               "symlink-to-dir", "dangling-symlink", "fifo", "socket")
# And around an entry's directory.
ENTRY_FAULTS = ("subdirectory", "entry-is-a-file", "entry-is-a-link")


def remove_any(path: Path) -> None:
    """Remove whatever is at path (a directory with its content; never
    following a link)."""
    if path.is_symlink() or not path.exists():
        if os.path.lexists(path):
            path.unlink()
        return
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def plant_file_fault(path: Path, fault: str, outside: Path) -> list:
    """Replace the file at path (or, for ENTRY_FAULTS, its directory) by a
    damaged or planted one. Links lead to `outside`'s baseline file and
    directory, which must never change. Returns sockets to close after."""
    good = path.read_bytes() if path.is_file() and not path.is_symlink() else b'{"device": "/dev/null"}'
    keep: list = []
    if fault in ENTRY_FAULTS:
        entry = path.parent
        if fault == "subdirectory":
            entry.mkdir(parents=True, exist_ok=True)
            (entry / "sub" / "deeper").mkdir(parents=True, exist_ok=True)
            (entry / "sub" / "deeper" / "file").write_text("planted")
            (entry / "sub" / "out").symlink_to(outside / "dir")
            os.mkfifo(entry / "sub" / "fifo")
            return keep
        remove_any(entry)
        if fault == "entry-is-a-file":
            entry.write_text("planted")
        else:
            entry.symlink_to(outside / "dir")
        return keep
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_any(path)
    if fault == "not-json":
        path.write_bytes(b"{not json \xff")
    elif fault == "truncated":
        path.write_bytes(good[: max(1, len(good) // 2)])
    elif fault == "wrong-types":
        path.write_text(json.dumps({"device": 7, "fstype": ["ext4"], "target-path": 1, "options": "ro",
                                    "volume_id": [], "target_path": {}, "info": 3}))
    elif fault == "empty":
        path.write_bytes(b"")
    elif fault == "oversized":
        with open(path, "wb") as f:
            f.truncate(8 * 1024 * 1024)
    elif fault == "directory":
        (path / "inner").mkdir(parents=True)
        (path / "inner" / "file").write_text("planted")
    elif fault == "symlink-to-file":
        path.symlink_to(outside / "file")
    elif fault == "symlink-to-dir":
        path.symlink_to(outside / "dir")
    elif fault == "dangling-symlink":
        path.symlink_to(outside / "gone")
    elif fault == "fifo":
        os.mkfifo(path)
    elif fault == "socket":
        import socket
        sock = socket.socket(socket.AF_UNIX)
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sock.bind(f"/proc/self/fd/{dir_fd}/{path.name}")  # a short name for a long path
        finally:
            os.close(dir_fd)
        keep.append(sock)
    else:
        raise ValueError(fault)
    return keep
