"""A container's own process, made by CreateContainer and started by
StartContainer.

The process is `crun run` in the foreground, as the agent's child: its
exit is the container's, and it forwards the signals it gets to the
container. Between the two calls crun is held by a hook the agent adds to
the spec: a createRuntime hook (crun runs it once the container's
namespaces, cgroup and mounts are made, before the process's pivot_root
and exec) that tells the agent the container is made and then waits for
a line from it; a poststart hook tells the agent the process was
executed. So CreateContainer carries crun's start and the container's
making, and StartContainer only what comes after the hook: the hooks talk
over fifos the agent holds open for reading and writing, so neither side
ever blocks in an open. A signal to a container made and not started goes
to crun's process group (crun and its hook: neither waits for a start
that never comes).

The container's mount namespace is held (a descriptor of it, and its
nsfs file bound below HOLDS_DIR) from its making (or, when crun gives the process its own mount
namespace only after the hook, from its start) until RemoveContainer: a container's processes
mount the share's submounts they reach first in their own namespace, and
its last exit would unmount them, maybe with a file's release still in
flight, which stops the guest's 6.1 kernel at a BUG. Held, the namespace
ends at the removal, long after the exit.

The spec comes with every source in place (root.path a directory of the
guest, each bind's source a guest path: the host's, or crust.guest.places'
from the request's sources); the agent adds its hooks and keeps the rest
as the host wrote it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from crust.common import ttrpc
from crust.guest import spawn, terminal
from crust.guest.cgroups import POD_CGROUP
from crust.guest.errors import AgentError
from crust.guest.oci import DEFAULT_PERSONALITY, OciRuntime
from crust.guest.process import CREATED, RUNNING, Process, ProcessTable
from crust.sys import mount as sysmount

log = logging.getLogger("crust.guest")

CONTAINERS_DIR = "/run/crust/agent/containers"
# Where a container's mount namespace is held (a bind of its nsfs file).
HOLDS_DIR = "/run/crust/ns"
# How long RemoveContainer waits for the container's processes after its
# SIGKILL when the call names no time.
REMOVE_WAIT = 30.0
HUGEPAGES = Path("/sys/kernel/mm/hugepages")
CGROUP_CONTROLLERS = Path("/sys/fs/cgroup/cgroup.controllers")
HOOK_SHELL = "/bin/sh"
# What the hooks run: the first tells that the container is made (the
# container's state crun gives a hook, one line of JSON without its end,
# read by the shell itself: a program more is a fork and exec more) and
# waits for the start's line (a failed read, the agent gone, fails the
# hook and with it crun's create); the second reads its state to the end,
# then tells the process started. crun writes a hook's state into a pipe
# after starting the hook, and fails it, and with it the container
# ("writing to pipe: Broken pipe"), when the hook exited before the write:
# each hook reads its state before it can end.
_MADE_HOOK = 'IFS= read -r state; printf \'%s\\n\' "$state" > "$1" && read -r line < "$2"'
_STARTED_HOOK = 'while IFS= read -r _; do :; done; echo started > "$1"'


class Gate:
    """The fifos between the agent and a container's hooks, each held
    open by the agent for reading and writing."""

    def __init__(self, directory: Path):
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(mode=0o700, parents=True)
        self.fds: dict[str, int] = {}
        for name in ("made", "start", "started"):
            os.mkfifo(directory / name, 0o600)
            self.fds[name] = os.open(directory / name, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)

    def hooks(self) -> dict[str, list[dict]]:
        d = self.directory
        return {"createRuntime": [{"path": HOOK_SHELL, "args": ["sh", "-c", _MADE_HOOK, "gate", str(d / "made"),
                                                                 str(d / "start")]}],
                "poststart": [{"path": HOOK_SHELL, "args": ["sh", "-c", _STARTED_HOOK, "gate",
                                                             str(d / "started")]}]}

    async def signalled(self, name: str, runtime_exited: asyncio.Future) -> bytes | None:
        """The line the hook wrote to fifo name, once whole; None when crun
        exited first."""
        loop = asyncio.get_running_loop()
        fd = self.fds[name]
        data = b""
        while b"\n" not in data:
            readable = loop.create_future()
            loop.add_reader(fd, _set, readable)
            try:
                await asyncio.wait([readable, runtime_exited], return_when=asyncio.FIRST_COMPLETED)
            finally:
                loop.remove_reader(fd)
            if not readable.done():
                return None
            with contextlib.suppress(BlockingIOError):
                data += os.read(fd, 1 << 16)
        return data

    def release(self) -> None:
        os.write(self.fds["start"], b"go\n")

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}
        shutil.rmtree(self.directory, ignore_errors=True)


def _set(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def huge_page_sizes(hugepages: Path = HUGEPAGES, controllers: Path = CGROUP_CONTROLLERS) -> set[str]:
    """The huge page sizes this kernel has a hugetlb cgroup limit for, named
    as the OCI spec names them ("2MB", "1GB")."""
    try:
        if "hugetlb" not in controllers.read_text().split():
            return set()
        entries = [e.name for e in hugepages.iterdir()]
    except OSError:
        return set()
    sizes = set()
    for name in entries:
        kib = name.removeprefix("hugepages-").removesuffix("kB")
        if kib.isdigit():
            n = int(kib)
            sizes.add(f"{n >> 20}GB" if n % (1 << 20) == 0 else f"{n >> 10}MB" if n % (1 << 10) == 0 else f"{n}KB")
    return sizes


def guest_bundle(spec_json: bytes, gate: Gate, page_sizes=huge_page_sizes) -> dict:
    """The host's spec with the agent's hooks, or INVALID_ARGUMENT naming
    the field. Huge page limits of a size this kernel does not have are
    dropped: the host's runtime writes one per size of the host (CRI-O, as
    kubelet asks), crun fails on a limit it finds no cgroup file for, and
    no process can take pages of a size the kernel does not have."""
    try:
        spec = json.loads(spec_json)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"oci_spec: not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec: not a JSON object")
    root = (spec.get("root") or {}).get("path")
    if not isinstance(root, str) or not root.startswith("/"):
        raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec.root.path: an absolute path of the guest is needed")
    process = spec.get("process")
    if not isinstance(process, dict):
        raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec.process: not a JSON object")
    if not isinstance(process.get("terminal", False), bool):
        raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec.process.terminal: not a boolean")
    hooks = spec.get("hooks") or {}
    if not isinstance(hooks, dict):
        raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec.hooks: not a JSON object")
    for stage, own in gate.hooks().items():
        hooks[stage] = [*own, *(hooks.get(stage) or [])] if stage == "createRuntime" else \
            [*(hooks.get(stage) or []), *own]
    spec["hooks"] = hooks
    linux = spec.setdefault("linux", {})
    if not isinstance(linux, dict):
        raise AgentError(ttrpc.INVALID_ARGUMENT, "oci_spec.linux: not a JSON object")
    linux.setdefault("personality", dict(DEFAULT_PERSONALITY))
    resources = linux.get("resources")
    if isinstance(resources, dict) and isinstance(resources.get("hugepageLimits"), list):
        sizes = page_sizes()
        resources["hugepageLimits"] = [limit for limit in resources["hugepageLimits"]
                                       if not isinstance(limit, dict) or limit.get("pageSize") in sizes]
    return spec


class Containers:
    """The containers' own processes, in the agent's process table under
    (container id, "")."""

    def __init__(self, table: ProcessTable, runtime: OciRuntime, directory: str = CONTAINERS_DIR,
                 pod_cgroup: str = POD_CGROUP, holds: str = HOLDS_DIR):
        self.table = table
        self.runtime = runtime
        self.pod_cgroup = pod_cgroup
        self.holds = Path(holds)
        self.held: dict[str, int] = {}   # container id -> a descriptor of its mount namespace
        self.made: dict[str, bytes] = {}   # container id -> the state crun gave the hook (its process)
        self.started: set[str] = set()   # containers whose process was started (a retry answers it)
        self.directory = Path(directory)
        self.gates: dict[str, Gate] = {}
        self.exits: dict[str, asyncio.Future] = {}
        self.starts: dict[str, asyncio.Future] = {}

    def known(self, container_id: str, raw: bytes, stdin: bool):
        """The answer to a retried CreateContainer (awaitable: the process
        once made), or None for a new one; ALREADY_EXISTS for the id with
        another request."""
        known = self.table._known((container_id, ""), raw, stdin)
        return None if known is None else self.table._answer_retry(known)

    async def create(self, container_id: str, raw: bytes, spec_json: bytes, stdin: bool) -> Process:
        key = (container_id, "")
        known = self.table._known(key, raw, stdin)
        if known is not None:
            return await self.table._answer_retry(known)
        if (Path(self.runtime.root) / container_id).exists():
            raise AgentError(ttrpc.ALREADY_EXISTS, f"container_id: {container_id!r} exists in the OCI runtime")
        # An id used again: nothing of an earlier container's hold counts.
        with contextlib.suppress(OSError):
            self._release_namespace(container_id)
        gate = Gate(self.directory / container_id)
        try:
            spec = guest_bundle(spec_json, gate)
            (gate.directory / "config.json").write_text(json.dumps(spec, separators=(",", ":")))
        except BaseException:
            gate.close()
            raise
        process = self.table._new(key, raw, stdin)
        on_terminal = bool(spec["process"].get("terminal"))
        console = listener = None
        try:
            command = ["run", "--bundle", str(gate.directory)]
            if on_terminal:
                console = self.runtime.console_socket()
                listener = terminal.listen(console)
                command += ["--console-socket", str(console)]
            # crun at the addresses of its last run (its translations kept
            # under emulation); the spec's personality gives the process
            # its randomization back.
            child = await spawn.start(self.runtime.command(*command, container_id), stdin=stdin and not on_terminal,
                                      cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                      fixed_addresses=True)
        except OSError as exc:
            gate.close()
            _close_console(listener, console)
            raise self.table._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: the OCI "
                                                         f"runtime did not start: {exc.strerror or exc}")) from None
        exit_ = asyncio.ensure_future(spawn.exited(child.popen))
        process.pid, process.state = child.pid, CREATED
        watch = self.table._watch(process, child, exit_) if listener is None else \
            self._watch_on_terminal(process, child, listener, console, exit_, stdin)
        process.tasks.append(asyncio.ensure_future(watch))
        process.tasks.append(asyncio.ensure_future(self._closed_at_exit(container_id, process, gate)))
        self.gates[container_id], self.exits[container_id] = gate, exit_
        made = await gate.signalled("made", exit_)
        if made is None:
            await process.done.wait()
            with contextlib.suppress(OSError):
                self._drop_cgroup(container_id)
            words = process.stderr.peek().decode(errors="replace").strip()[-2000:]
            raise self.table._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"oci_spec: the OCI runtime "
                                                         f"refused it: {words or 'exit ' + str(process.exit.exit_code)}"))
        self.made[container_id] = made
        self._hold_namespace(container_id, made)
        process.started.set()
        return process

    async def _watch_on_terminal(self, process: Process, child: spawn.Child, listener, console: Path,
                                 exit_: asyncio.Future, stdin: bool) -> None:
        """The process's output and input on its terminal, once crun handed
        over the master: at the start, when the process is made (crun's own
        refusals before it are on its stderr)."""
        try:
            master = await terminal.receive_master(listener, exit_, timeout=None)
        except AgentError as exc:
            log.info("container %s: no terminal from the OCI runtime: %s", process.container_id, exc.message)
        else:
            process.terminal = master
            child = await spawn.on_terminal(child, master, stdin)
        finally:
            _close_console(listener, console)
        await self.table._watch(process, child, exit_)

    def _hold_namespace(self, container_id: str, state: bytes) -> None:
        """The container's mount namespace held, from its process (the pid
        of the state crun gave the hook) once that has a namespace of its
        own: by a descriptor of it, the hold itself, and by a bind of it at
        HOLDS_DIR/<id>, which shows in the guest's mount table (some
        kernels refuse that bind; the descriptor holds all the same)."""
        try:
            pid = int(json.loads(state)["pid"])
            fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("container %s: its mount namespace not held: %s", container_id, exc)
            return
        if os.fstat(fd).st_ino == os.stat("/proc/self/ns/mnt").st_ino:
            os.close(fd)   # the agent's own: the container has none of its own yet
            return
        self.held[container_id] = fd
        hold = self.holds / container_id
        try:
            self.holds.mkdir(mode=0o700, parents=True, exist_ok=True)
            hold.touch(mode=0o600)
            sysmount.mount_path(f"/proc/self/fd/{fd}", str(hold), "", ["bind"])
        except OSError as exc:
            log.info("container %s: its mount namespace held by a descriptor only: %s", container_id, exc)
            hold.unlink(missing_ok=True)

    def _release_namespace(self, container_id: str) -> None:
        """What _hold_namespace held: the container's mounts go now."""
        self.made.pop(container_id, None)
        self.started.discard(container_id)
        fd = self.held.pop(container_id, None)
        if fd is not None:
            os.close(fd)
        hold = self.holds / container_id
        if not hold.exists():
            return
        directory = os.open(self.holds, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sysmount.unmount_beneath(directory, container_id)
        finally:
            os.close(directory)
        hold.unlink(missing_ok=True)

    async def _closed_at_exit(self, container_id: str, process: Process, gate: Gate) -> None:
        await process.done.wait()
        if self.gates.get(container_id) is gate:
            del self.gates[container_id]
            self.exits.pop(container_id, None)
        gate.close()

    async def start(self, container_id: str) -> Process:
        process = self.table.get(container_id, "")
        if process.state != CREATED:
            if container_id not in self.started:
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: {container_id!r} exited before it "
                                                           f"started (its exit is in WaitProcess)")
            return process   # started already (a retry), also once it exited
        start = self.starts.get(container_id)
        if start is None:
            start = self.starts[container_id] = asyncio.ensure_future(self._start(container_id, process))
            start.add_done_callback(lambda _: self.starts.pop(container_id, None))
        await asyncio.shield(start)
        return process

    async def _start(self, container_id: str, process: Process) -> None:
        gate, exit_ = self.gates[container_id], self.exits[container_id]
        gate.release()
        if await gate.signalled("started", exit_) is None:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: {container_id!r} exited before it started "
                                                       f"(its exit is in WaitProcess)")
        if container_id not in self.held:
            # crun gives the process a mount namespace of its own after the
            # hook when it joins other namespaces by path (the pod's).
            self._hold_namespace(container_id, self.made.get(container_id, b""))
        self.started.add(container_id)
        if process.state == CREATED:
            process.state = RUNNING

    async def remove(self, container_id: str, timeout: float) -> int:
        """Kill every process of the container (its cgroup's cgroup.kill,
        crun's group while it is not started), wait for them all, delete it
        in crun, remove its cgroup and forget its processes: their unread
        output bytes. An unknown container answers 0."""
        cgroup = Path(self.pod_cgroup) / container_id
        processes = [p for p in self.table.processes.values() if p.container_id == container_id]
        for process in processes:
            if process.state == CREATED:
                process.signal(9)
        if cgroup.is_dir():
            with contextlib.suppress(FileNotFoundError):
                (cgroup / "cgroup.kill").write_text("1")
        deadline = asyncio.get_running_loop().time() + timeout
        waits = [asyncio.ensure_future(p.done.wait()) for p in processes]
        if waits:
            _done, pending = await asyncio.wait(waits, timeout=timeout)
            for wait in pending:
                wait.cancel()
            if pending:
                raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"container_id: processes of {container_id!r} outlived "
                                                         f"their SIGKILL by {timeout:g} s")
        while _populated(cgroup):
            if asyncio.get_running_loop().time() > deadline:
                raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"container_id: processes of {container_id!r} stay in its "
                                                         f"cgroup {timeout:g} s after their SIGKILL")
            await asyncio.sleep(0.01)
        try:
            self._release_namespace(container_id)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: the hold of {container_id!r}'s mount "
                                                       f"namespace: {exc.strerror}") from None
        if (Path(self.runtime.root) / container_id).exists():
            proc = await asyncio.create_subprocess_exec(
                *self.runtime.command("delete", "--force", container_id), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode != 0 and (Path(self.runtime.root) / container_id).exists():
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: crun delete {container_id}: "
                                                           f"{err.decode(errors='replace').strip()[-1000:]}")
        try:
            self._drop_cgroup(container_id)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: its cgroup {exc.filename}: "
                                                       f"{exc.strerror}") from None
        return sum(self.table.remove(p.container_id, p.exec_id) for p in processes)

    def _drop_cgroup(self, container_id: str) -> None:
        """The container's cgroup and crun's below it, once empty (gone is
        done)."""
        cgroup = Path(self.pod_cgroup) / container_id
        for directory in (cgroup / "ctr", cgroup):
            with contextlib.suppress(FileNotFoundError):
                directory.rmdir()


def _close_console(listener, console: Path | None) -> None:
    if listener is not None:
        listener.close()
    if console is not None:
        console.unlink(missing_ok=True)


def _populated(cgroup: Path) -> bool:
    """Whether processes are left in the cgroup or below it."""
    try:
        return "populated 1" in (cgroup / "cgroup.events").read_text()
    except FileNotFoundError:
        return False
