"""An exec into a running container done by the agent, as the OCI runtime
would do it, without starting the runtime.

`crun exec` costs the guest's one vCPU much under emulation (loading its
libraries, parsing the container's spec), and so does a fork of the
agent's Python (its memory copied). So the agent reads
what the exec needs here (crun's state of the container: its first
process, its cgroup, the seccomp filter crun kept compiled in
seccomp.bpf) and vforks the guest's small `enter` program
(crust/guest/files/enter.c) with it: that program enters the container by
its first process's pidfd and clones the process as the agent's own
child, confined (ids, capabilities, no_new_privs, seccomp, rlimits, OOM
score, umask, directory; HOME from the container's /etc/passwd when the
environment has none). The OOM score is the process's oomScoreAdj, as
runc gives an exec (crun leaves its exec with its parent's score).

A process on a terminal gets one of the container's own: the enter program
makes it in the container's devpts and hands its master back over a
socket (the `console` argument), as crun's console socket would.

What this path does not do is left to crun (prepare raises NotHere with
the reason): a container with a seccomp filter
crun did not keep compiled or that hands its notifications to a listener,
one with a personality other than the default (LINUX, which the agent
names in every guest spec), a user or time namespace of its own, a process
that asks for an I/O priority, a scheduler, CPU affinity or an LSM label,
or one that names no capabilities; and every exec when the image has no
`enter`.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crust.guest.oci import DEFAULT_PERSONALITY, start_time

# The namespace types of /proc/PID/ns and their clone flags.
NAMESPACE_FLAGS = {"mnt": 0x00020000, "uts": 0x04000000, "ipc": 0x08000000, "net": 0x40000000,
                   "cgroup": 0x02000000}

# capabilities(7): the names OCI uses, in the kernel's order.
CAPABILITIES = {name: number for number, name in enumerate((
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG",
    "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"))}

# setrlimit(2): the names OCI uses, in the kernel's (generic) order.
RLIMITS = {name: number for number, name in enumerate((
    "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_DATA", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_RSS", "RLIMIT_NPROC",
    "RLIMIT_NOFILE", "RLIMIT_MEMLOCK", "RLIMIT_AS", "RLIMIT_LOCKS", "RLIMIT_SIGPENDING", "RLIMIT_MSGQUEUE",
    "RLIMIT_NICE", "RLIMIT_RTPRIO", "RLIMIT_RTTIME"))}

# seccomp(2)'s filter flags, by the names OCI uses.
SECCOMP_FLAGS = {"SECCOMP_FILTER_FLAG_TSYNC": 1, "SECCOMP_FILTER_FLAG_LOG": 2,
                 "SECCOMP_FILTER_FLAG_SPEC_ALLOW": 4, "SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV": 32}

_FOR_CRUN = ("apparmorProfile", "selinuxLabel", "ioPriority", "scheduler", "execCPUAffinity")
_DEFAULT_UMASK = 0o022


class NotHere(Exception):
    """The exec is one for crun: the reason."""


@dataclass
class Entry:
    """The enter program's command and the descriptors it is handed, all
    opened before the fork; closed in the agent once it started."""

    argv: list[str]
    env: dict[str, str]
    fds: list[int] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _namespace(pid: int | str, kind: str) -> tuple[int, int]:
    st = os.stat(f"/proc/{pid}/ns/{kind}")
    return st.st_dev, st.st_ino


def _mask(process: dict[str, Any], key: str) -> str:
    names = (process["capabilities"].get(key) or [])
    if not isinstance(names, list):
        raise NotHere(f"process.capabilities.{key}: not a list")
    unknown = [n for n in names if n not in CAPABILITIES]
    if unknown:
        raise NotHere(f"process.capabilities.{key}: {unknown[0]!r} is no capability the agent knows")
    return format(sum(1 << CAPABILITIES[n] for n in names), "x")


def _rlimits(process: dict[str, Any]) -> list[str]:
    limits = []
    for limit in process.get("rlimits") or []:
        number = RLIMITS.get(limit.get("type"))
        if number is None:
            raise NotHere(f"process.rlimits: {limit.get('type')!r} is no limit the agent knows")
        limits.append(f"rlimit={number}:{int(limit.get('soft', 0))}:{int(limit.get('hard', 0))}")
    return limits


def _seccomp_flags(seccomp: dict[str, Any]) -> int:
    if seccomp.get("listenerPath"):
        raise NotHere("linux.seccomp.listenerPath: notifications go to a listener")
    flags = 0
    for name in seccomp.get("flags") or []:
        if name not in SECCOMP_FLAGS:
            raise NotHere(f"linux.seccomp.flags: {name!r} is no flag the agent knows")
        flags |= SECCOMP_FLAGS[name]
    return flags


def _console_size(size: Any) -> list[str]:
    rows, columns = (size.get(k) if isinstance(size, dict) else None for k in ("height", "width"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 0xFFFF for v in (rows, columns)):
        raise NotHere(f"process.consoleSize: {size!r} is no size the agent sets")
    return [f"rows={rows}", f"columns={columns}"]


def _last_capability() -> int:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        return int(f.read())


def prepare(program: str, runtime_root: str, container_id: str, process: dict[str, Any]) -> Entry:
    """The entry into a running container for process (an OCI process
    object, checked by process.parse_process), or NotHere with the reason
    crun must do it. OSError when the container's state is unreadable or
    its first process is gone."""
    if not os.access(program, os.X_OK):
        raise NotHere(f"no {program} in the image")
    for key in _FOR_CRUN:
        if process.get(key):
            raise NotHere(f"process.{key}: not applied by the agent")
    if not isinstance(process.get("capabilities"), dict):
        raise NotHere("process.capabilities: none named")
    state = Path(runtime_root) / container_id
    status = json.loads((state / "status").read_bytes())
    config = json.loads((state / "config.json").read_bytes())
    linux = config.get("linux") or {}
    if linux.get("personality") not in (None, {}, DEFAULT_PERSONALITY):
        raise NotHere("linux.personality: not applied by the agent")
    seccomp = linux.get("seccomp") or {}
    seccomp_flags = _seccomp_flags(seccomp) if seccomp else 0
    pid, started = int(status["pid"]), int(status["process-start-time"])
    for kind in ("user", "time"):
        if _namespace(pid, kind) != _namespace("self", kind):
            raise NotHere(f"linux.namespaces: a {kind} namespace of the container's own")
    user = process.get("user") or {}
    argv = [program, f"lastcap={_last_capability()}", *(f"{key}={_mask(process, key)}" for key in (
        "bounding", "effective", "permitted", "inheritable", "ambient"))]
    argv += [f"uid={int(user.get('uid', 0))}", f"gid={int(user.get('gid', 0))}",
             f"umask={int(user.get('umask', _DEFAULT_UMASK))}", f"cwd={process.get('cwd') or '/'}",
             f"nnp={1 if process.get('noNewPrivileges') else 0}", *_rlimits(process)]
    groups = [str(int(g)) for g in user.get("additionalGids") or []]
    if groups:
        argv.append(f"groups={','.join(groups)}")
    if process.get("oomScoreAdj") is not None:
        argv.append(f"oom={int(process['oomScoreAdj'])}")
    if process.get("terminal") and process.get("consoleSize"):
        argv += _console_size(process["consoleSize"])
    entry = Entry(argv, dict(e.split("=", 1) for e in process.get("env") or []))
    try:
        pidfd = os.pidfd_open(pid)
        entry.fds.append(pidfd)
        # The pidfd names the process only if it is still the one crun
        # started (its pid may have been reused before the open).
        if start_time(pid) != started:
            raise ProcessLookupError(f"container {container_id!r}: its first process is gone")
        flags = sum(flag for kind, flag in NAMESPACE_FLAGS.items() if _namespace(pid, kind) != _namespace("self", kind))
        argv += [f"pidfd={pidfd}", f"ns={flags}"]
        cgroup = status.get("cgroup-path") or ""
        if cgroup:
            fd = os.open(f"/sys/fs/cgroup/{cgroup.strip('/')}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            entry.fds.append(fd)
            argv.append(f"cgroup={fd}")
        if seccomp:
            try:
                fd = os.open(state / "seccomp.bpf", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise NotHere("linux.seccomp: the runtime kept no compiled filter") from None
            entry.fds.append(fd)
            argv += [f"seccomp={fd}", f"seccomp_flags={seccomp_flags}"]
    except BaseException:
        entry.close()
        raise
    argv += ["--", *process["args"]]
    return entry


async def report(fd: int) -> tuple[int, str]:
    """(the process's pid or 0, the failure or "") from the enter
    program's report, read to its end (the process executed or failed)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(fd, "rb", 0))
    try:
        text = (await reader.read(1 << 16)).decode(errors="replace")
        while chunk := await reader.read(1 << 16):
            text += chunk.decode(errors="replace")
    finally:
        transport.close()
    pid, failure = 0, ""
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "pid" and rest.isdigit():
            pid = int(rest)
        elif word == "error":
            failure = rest
    return pid, failure
