"""virtiofsd: the vhost-user file server that gives a pod's VM its shared directory.

Debian 12's qemu-system-common (QEMU 7.2) ships the C virtiofsd at
/usr/lib/qemu/virtiofsd. One daemon per VM, started before QEMU (QEMU
connects to its socket at start) and ended with it: the daemon serves one
connection and exits when QEMU closes it; stop() makes sure.

The options and why:
- `-o source=<share>`: the pod's read-only shared directory (crust.kata.vmm.share);
- `-o sandbox=namespace` (its default, named): new mount, pid and network
  namespaces, its mounts made slaves of the host's and pivot_root into the
  source, so it reaches nothing else of the host, and binds the handler
  adds under the share later still reach it by propagation. The C daemon
  always installs its seccomp filter (no option turns it off);
- `-o cache=`: a VM has two daemons, one per cache mode (qemu.SharedDir).
  `always` with `-o timeout=1` for the pod's share (container roots,
  kubelet's directory of the pod): the guest keeps a file's pages across
  opens, so a container's programs are read once, not at each exec (with
  `auto` every open drops the file's pages: no keep_cache), and looks at a
  lookup and a file's attributes again after a second, as `auto` does; a
  file whose size or modification time changed then loses its pages
  (FUSE's automatic invalidation, which virtiofsd negotiates).
  `none` for the live share (the volumes kubelet's atomic writer updates:
  configMap, secret, projected, downward API): every lookup asks the host,
  so a renamed `..data` is followed at once, never into the version the
  writer has just removed. `none` for everything would cost 2 to 3 times
  the lookups of a root (bench/runtime/pod_share.py, docs/performance.md);
- `-o announce_submounts`: the share holds bind mounts (each container's
  rootfs, each volume); the guest sees each as a mount of its own (its own
  st_dev), as a container would on the host. The guest mounts each on its
  first lookup, in the namespace that looks; crust.kata.pod.containers keeps a
  container's exit from unmounting the last of those (a guest kernel BUG);
- `-o no_xattr`, `-o no_posix_lock`, `-o no_flock`: nothing a pod's files
  need, and less of the host's kernel reachable from the guest;
- `--rlimit-nofile=0`: the handler raised its own limit at start (a
  daemon's children inherit it); virtiofsd keeps that one.
- `--thread-pool-size=0`: requests served by the queue's thread; a pool
  adds threads without gain on a one-CPU guest.

The daemon runs in its own session (a VM outlives a restarted handler, and
so must its file server); its pid and start time are recorded beside the
VM's, so a restarted handler stops exactly that process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

from crust.common.private import open_new
from crust.sys import proc

log = logging.getLogger(__name__)

VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
SOCKET_WAIT = 10.0   # seconds until the daemon must listen on its socket


class VirtiofsdError(Exception):
    pass


CACHE_MODES = ("auto", "none", "always")
# How long the guest trusts a lookup or a file's attributes under
# cache=always (virtiofsd's own default there is a day: a host's change
# would never be seen).
ALWAYS_REVALIDATE_SECONDS = 1


def argv(socket: Path, source: Path, binary: str = VIRTIOFSD, cache: str = "auto") -> list[str]:
    if cache not in CACHE_MODES:
        raise ValueError(f"virtiofsd cache mode {cache!r}: one of {', '.join(CACHE_MODES)}")
    return [binary, f"--socket-path={socket}", "-o", f"source={source}", "-o", "sandbox=namespace",
            "-o", f"cache={cache}", *(["-o", f"timeout={ALWAYS_REVALIDATE_SECONDS}"] if cache == "always" else []),
            "-o", "announce_submounts", "-o", "no_xattr", "-o", "no_posix_lock",
            "-o", "no_flock", "--rlimit-nofile=0", "--thread-pool-size=0"]


def is_virtiofsd_of(pid: int, socket: Path) -> bool:
    """Whether pid runs a virtiofsd serving this socket."""
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(words) and words[0].endswith(b"virtiofsd") and f"--socket-path={socket}".encode() in words


def pids_under(*dirs: Path) -> list[int]:
    """virtiofsd processes whose socket lies below one of dirs (leftovers
    a test or a crashed handler may find)."""
    needles = [f"--socket-path={Path(d).resolve()}/".encode() for d in dirs]
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if words and words[0].endswith(b"virtiofsd") and any(w.startswith(n) for w in words for n in needles):
            found.append(int(entry.name))
    return found


def listens(pid: int, socket: Path) -> bool:
    """Whether process pid listens on a unix socket bound at that path: a
    listening socket of that path in the kernel's table of this network
    namespace's unix sockets (virtiofsd binds and listens before it enters
    namespaces of its own), held by pid (another process's socket bound at
    the path before, its file since removed, does not count)."""
    want = str(socket)
    inodes = set()
    with open("/proc/net/unix") as table:
        next(table)   # the header
        for line in table:
            # Num RefCount Protocol Flags Type St Inode Path; Flags has
            # __SO_ACCEPTCON (0x10000) once listen(2) was called.
            fields = line.rstrip("\n").split(None, 7)
            if len(fields) == 8 and fields[7] == want and int(fields[3], 16) & 0x10000:
                inodes.add(f"socket:[{fields[6]}]")
    if not inodes:
        return False
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            pass
    return False


class Virtiofsd:
    """One daemon; name names its log and record in workdir (a VM has one per share)."""

    def __init__(self, workdir: Path, socket: Path, source: Path, binary: str = VIRTIOFSD, cache: str = "auto",
                 name: str = "virtiofsd"):
        self.socket = socket
        self.source = source
        self.binary = binary
        self.cache = cache
        self.name = name
        self.relocate(workdir)
        self._proc: asyncio.subprocess.Process | None = None
        self.identity: proc.ProcessId | None = None

    def relocate(self, workdir: Path) -> None:
        """Its log and record are in workdir (the VM's work directory,
        renamed when a pod takes a pooled VM; the daemon keeps its files)."""
        self.log_path = workdir / f"{self.name}.log"
        self.record = workdir / f"{self.name}.json"

    async def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        if not os.access(self.binary, os.X_OK):
            raise VirtiofsdError(f"{self.binary} not found: apt-get install qemu-system-common")
        with os.fdopen(open_new(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as out:
            self._proc = await asyncio.create_subprocess_exec(
                *argv(self.socket, self.source, self.binary, self.cache), stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=out, start_new_session=True, umask=0o077)
        self.identity = proc.identify(self._proc.pid)
        if self.identity is not None:
            self.record.write_text(json.dumps({"pid": self.identity.pid, "start": self.identity.start}))
        # The socket's file is made by bind(2), before the daemon listens: a
        # connection (QEMU's) made in between is refused. Ready is listening.
        deadline = time.monotonic() + SOCKET_WAIT
        while not listens(self._proc.pid, self.socket):
            if self._proc.returncode is not None or time.monotonic() > deadline:
                await self.stop()
                raise VirtiofsdError(f"virtiofsd did not listen on {self.socket} within {SOCKET_WAIT:.0f} s "
                                     f"(exit code {self._proc.returncode}); its log: {self._log_tail()}")
            await asyncio.sleep(0.02)
        log.info("virtiofsd serving", extra={"fields": {
            "source": str(self.source), "cache": self.cache, "pid": self._proc.pid}})

    def adopt(self) -> bool:
        """A daemon an earlier handler process started, from its record."""
        try:
            data = json.loads(self.record.read_text())
            identity = proc.ProcessId(int(data["pid"]), int(data["start"]))
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if proc.alive(identity) and is_virtiofsd_of(identity.pid, self.socket):
            self.identity = identity
            return True
        return False

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.returncode is None
        return self.identity is not None and proc.alive(self.identity) and is_virtiofsd_of(
            self.identity.pid, self.socket)

    def ending(self) -> str:
        """How the daemon ended, in words ("was killed by signal 9")."""
        code = self._proc.returncode if self._proc is not None else None
        if code is None:
            return "exited"
        if code < 0:
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    async def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL; only the recorded process serving our socket. Idempotent."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if not self.alive():
                break
            if self._proc is not None:   # our child: its pid is its own until reaped
                try:
                    self._proc.send_signal(sig)
                except ProcessLookupError:
                    pass
                try:
                    await asyncio.wait_for(self._proc.wait(), wait)
                except asyncio.TimeoutError:
                    pass
                continue
            identity = self.identity
            proc.signal_if(identity.pid, lambda: is_virtiofsd_of(identity.pid, self.socket), sig)
            deadline = time.monotonic() + wait
            while self.alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        if self._proc is not None and self._proc.returncode is None:
            await self._proc.wait()
        self.record.unlink(missing_ok=True)
        self.socket.unlink(missing_ok=True)

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
        except OSError:
            return "(none)"
