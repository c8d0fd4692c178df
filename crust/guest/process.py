"""Processes the agent started: their output held by OutputStreams (in the
pipes themselves; a terminal's read into memory), their input fed from an
InputStream, their exit recorded once the output is complete, each kept
until the host removes it.

A process's life: RUNNING once started, EXITED once it exited *and* both
of its streams ended (every writer closed them, or LIMITS.output_grace
after the exit a descendant still held them and the agent closed its own
ends: output_complete is then false). WaitProcess answers only then, so a
host that reads each stream to its end has all of the output the exit
reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field

from crust.common import ttrpc
from crust.guest import enter, oci, spawn, terminal
from crust.guest.errors import AgentError
from crust.guest.oci import OciRuntime
from crust.guest.streams import InputStream, OutputStream

log = logging.getLogger("crust.guest")

CREATED, RUNNING, EXITED = 1, 2, 3  # ProcessInfo.State


# A terminal's output (read into memory: a master is no pipe to hold it
# in) is read in fuller reads when the process writes fast: after one of
# PUMP_BUSY_BYTES or more but below PUMP_FULL_BYTES the pump lets the
# terminal fill for PUMP_PAUSE. Under emulation a system call and a wakeup
# of the agent cost more than the bytes a read moves, and read at once a
# pipe gives little more than one write of the process. Small output is
# read at once.
PUMP_BUSY_BYTES = 16 << 10
PUMP_FULL_BYTES = 512 << 10
PUMP_PAUSE = 0.01


@dataclass(frozen=True)
class Limits:
    stream_buffer_bytes: int = 4 << 20
    stdin_buffer_bytes: int = 1 << 20
    output_grace: float = 2.0
    pipe_chunk: int = 1 << 20
    # Exited execs of a container the host has not removed: beyond this
    # many the oldest is forgotten (the host forgets its own well before:
    # this bounds the guest's memory when the host never says).
    exited_execs_kept: int = 256


@dataclass(frozen=True)
class ProcessSpec:
    """What the agent uses of an OCI process object."""

    args: tuple[str, ...]
    env: tuple[str, ...] = ()
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()
    terminal: bool = False


def parse_process(raw: bytes, field_name: str = "process") -> ProcessSpec:
    """An OCI process object (JSON), or INVALID_ARGUMENT naming the field."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}: not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}: not a JSON object")
    args = obj.get("args")
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.args: a non-empty list of strings is needed")
    env = obj.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.env: a list of NAME=value strings is needed")
    cwd = obj.get("cwd", "/")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.cwd: an absolute path is needed")
    user = obj.get("user", {})
    if not isinstance(user, dict):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.user: not a JSON object")
    ids = {}
    for key in ("uid", "gid"):
        value = user.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 32:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.user.{key}: not a 32-bit id")
        ids[key] = value
    extra = user.get("additionalGids", [])
    if not isinstance(extra, list) or not all(isinstance(g, int) and 0 <= g < 1 << 32 for g in extra):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.user.additionalGids: not a list of 32-bit ids")
    terminal = obj.get("terminal", False)
    if not isinstance(terminal, bool):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field_name}.terminal: not a boolean")
    return ProcessSpec(tuple(args), tuple(env), cwd, ids["uid"], ids["gid"], tuple(extra), terminal)


@dataclass
class ExitStatus:
    exit_code: int
    signal: int
    exited_at_ns: int
    output_complete: bool = True


@dataclass
class Process:
    container_id: str
    exec_id: str
    request: bytes  # what started it, for a retry's comparison
    stdout: OutputStream
    stderr: OutputStream
    stdin: InputStream | None
    pid: int = 0
    state: int = CREATED
    exit: ExitStatus | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    start_error: AgentError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)
    terminal: int | None = None   # its terminal's master, while it runs on one

    @property
    def key(self) -> tuple[str, str]:
        return self.container_id, self.exec_id

    def signal(self, number: int) -> int:
        """Signals sent: 0 once it exited. A container's process made and
        not started (crust.guest.containers) gets it with its process group."""
        if self.state not in (CREATED, RUNNING) or not self.pid:
            return 0
        try:
            if self.state == CREATED:
                os.killpg(self.pid, number)
            else:
                os.kill(self.pid, number)
        except ProcessLookupError:
            return 0
        return 1

    def unread(self) -> int:
        return self.stdout.drop() + self.stderr.drop()


def _record(process: Process | None) -> str:
    """What the agent knows of a process, in a few words (for an error)."""
    if process is None:
        return "none"
    state = {CREATED: "created", RUNNING: "running", EXITED: "exited"}.get(process.state, str(process.state))
    if process.exit is not None:
        state += f", exit {process.exit.exit_code}"
    return f"{state}, pid {process.pid}"


def _exit_status(returncode: int) -> tuple[int, int]:
    """(exit_code as a shell reports it, signal)."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, 0


class ProcessTable:
    """Every process the agent knows, by (container_id, exec_id)."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.processes: dict[tuple[str, str], Process] = {}

    def get(self, container_id: str, exec_id: str) -> Process:
        process = self.processes.get((container_id, exec_id))
        if process is None:
            what = f"exec {exec_id!r} of container {container_id!r}" if container_id else f"guest process {exec_id!r}"
            raise AgentError(ttrpc.NOT_FOUND, f"exec_id: no {what}")
        return process

    def _known(self, key: tuple[str, str], raw: bytes, stdin: bool) -> Process | None:
        known = self.processes.get(key)
        if known is not None and (known.request != raw or (known.stdin is not None) != stdin):
            raise AgentError(ttrpc.ALREADY_EXISTS, f"exec_id: {key[1]!r} runs another process")
        return known

    async def _answer_retry(self, known: Process) -> Process:
        await known.started.wait()
        if known.start_error is not None:
            raise known.start_error
        return known

    def _new(self, key: tuple[str, str], raw: bytes, stdin: bool) -> Process:
        process = Process(key[0], key[1], raw, OutputStream(self.limits.stream_buffer_bytes),
                          OutputStream(self.limits.stream_buffer_bytes),
                          InputStream(self.limits.stdin_buffer_bytes) if stdin else None)
        self.processes[key] = process
        return process

    def _failed(self, process: Process, error: AgentError) -> AgentError:
        self.processes.pop(process.key, None)
        process.start_error = error
        process.started.set()
        return error

    async def start_guest_process(self, exec_id: str, raw: bytes, spec: ProcessSpec, stdin: bool) -> Process:
        """A process of the guest itself (no container); a retry of the same
        request answers the process it started."""
        key = ("", exec_id)
        known = self._known(key, raw, stdin)
        if known is not None:
            return await self._answer_retry(known)
        if spec.terminal:
            raise AgentError(ttrpc.FAILED_PRECONDITION, "process.terminal: this agent runs no process on a terminal")
        process = self._new(key, raw, stdin)
        try:
            child = await spawn.start(
                list(spec.args), stdin=stdin, cwd=spec.cwd, env=dict(e.split("=", 1) for e in spec.env),
                user=spec.uid if spec.uid != os.getuid() else None,
                group=spec.gid if spec.gid != os.getgid() else None,
                extra_groups=list(spec.additional_gids) if spec.additional_gids else None)
        except OSError as exc:
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"process.args: {spec.args[0]!r} did "
                                                   f"not start: {exc.strerror or exc}")) from None
        exit_ = asyncio.ensure_future(spawn.exited(child.popen))
        process.pid, process.state = child.pid, RUNNING
        process.started.set()
        process.tasks.append(asyncio.ensure_future(self._watch(process, child, exit_)))
        return process

    async def start_container_exec(self, runtime: OciRuntime, container_id: str, exec_id: str, raw: bytes,
                                   spec: ProcessSpec, stdin: bool) -> Process:
        """A process in a running container, through the OCI runtime; a
        retry of the same request answers the process it started."""
        key = (container_id, exec_id)
        known = self._known(key, raw, stdin)
        if known is not None:
            return await self._answer_retry(known)
        status = "running" if runtime.runs(container_id) else await runtime.status(container_id)
        if status is None:
            init = self.processes.get((container_id, ""))
            raise AgentError(ttrpc.NOT_FOUND, f"container_id: no container {container_id!r} (the OCI runtime knows "
                                             f"none; the agent's record of its process: {_record(init)})")
        if status != "running":
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: container {container_id!r} is {status}, "
                                                       f"not running")
        try:
            entry = enter.prepare(runtime.enter_program, runtime.root, container_id, json.loads(raw))
        except enter.NotHere as reason:
            log.info("exec %s of container %s through the OCI runtime: %s", exec_id, container_id, reason)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # The runtime tells what is wrong with the container in its words.
            log.info("exec %s of container %s through the OCI runtime: its state read: %s", exec_id,
                     container_id, exc)
        else:
            return await self._start_entered(key, raw, stdin, entry, spec.terminal)
        if spec.terminal:
            return await self._start_on_terminal(runtime, key, raw, stdin)
        process = self._new(key, raw, stdin)
        process_file, pid_file = runtime.exec_files(container_id, exec_id)
        try:
            runtime.write_process(process_file, raw)
            pid_file.unlink(missing_ok=True)
            child = await spawn.start(
                runtime.command("exec", "--process", str(process_file), "--pid-file", str(pid_file), container_id),
                stdin=stdin, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        except OSError as exc:
            runtime.forget(container_id, exec_id)
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: the OCI runtime did "
                                                   f"not start: {exc.strerror or exc}")) from None
        exit_ = asyncio.ensure_future(spawn.exited(child.popen))
        return await self._running(runtime, process, child, exit_, pid_file)

    async def _running(self, runtime: OciRuntime, process: Process, child: spawn.Child, exit_: asyncio.Future,
                       pid_file) -> Process:
        """The exec watched, then running once crun wrote its pid; refused
        with crun's words when it did not start it."""
        process.tasks.append(asyncio.ensure_future(self._watch(process, child, exit_)))
        try:
            pid = await oci.wait_pid_file(pid_file, exit_)
        except AgentError as exc:
            child.popen.kill()
            raise self._failed(process, exc) from None
        finally:
            runtime.forget(process.container_id, process.exec_id)   # crun read the one and wrote the other
        if pid == 0:
            # The runtime refused the process: its words are on the exec's stderr.
            await process.done.wait()
            words = process.stderr.peek().decode(errors="replace").strip()[-2000:]
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"process: the OCI runtime refused "
                                                   f"it: {words or 'exit ' + str(process.exit.exit_code)}"))
        process.pid, process.state = pid, RUNNING
        process.started.set()
        return process

    async def _start_on_terminal(self, runtime: OciRuntime, key: tuple[str, str], raw: bytes,
                                 stdin: bool) -> Process:
        """An exec on a terminal the OCI runtime makes in the container and
        hands over (crust.guest.terminal)."""
        container_id, exec_id = key
        process = self._new(key, raw, stdin)
        process_file, pid_file = runtime.exec_files(container_id, exec_id)
        try:
            console = runtime.console_socket()
            runtime.write_process(process_file, raw)
            pid_file.unlink(missing_ok=True)
            listener = terminal.listen(console)
        except OSError as exc:
            runtime.forget(container_id, exec_id)
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"process.terminal: {exc}")) from None
        try:
            child = await spawn.start(
                runtime.command("exec", "--tty", "--console-socket", str(console), "--process", str(process_file),
                                "--pid-file", str(pid_file), container_id),
                stdin=False, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
            exit_ = asyncio.ensure_future(spawn.exited(child.popen))
            try:
                master = await terminal.receive_master(listener, exit_)
            except AgentError as exc:
                child.popen.kill()
                await exit_
                words = (await child.stderr.read()).decode(errors="replace").strip()[-2000:]
                child.close_pipes()
                raise self._failed(process, AgentError(exc.code, f"{exc.message}: {words}" if words else
                                                       exc.message)) from None
        except OSError as exc:
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: the OCI runtime did "
                                                   f"not start: {exc.strerror or exc}")) from None
        finally:
            listener.close()
            console.unlink(missing_ok=True)
        process.terminal = master
        child = await spawn.on_terminal(child, master, stdin)
        return await self._running(runtime, process, child, exit_, pid_file)

    async def _start_entered(self, key: tuple[str, str], raw: bytes, stdin: bool, entry: enter.Entry,
                             on_terminal: bool = False) -> Process:
        """The process started by the enter program, which clones it as the
        agent's own child and reports its pid (crust.guest.enter); on a
        terminal, the master comes over the console socket."""
        process = self._new(key, raw, stdin)
        report, report_end = os.pipe2(os.O_CLOEXEC)
        console = console_end = None
        try:
            argv = [entry.argv[0], f"report={report_end}"]
            fds = [*entry.fds, report_end]
            if on_terminal:
                console, console_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                argv.append(f"console={console_end.fileno()}")
                fds.append(console_end.fileno())
            child = await spawn.start([*argv, *entry.argv[1:]], stdin=stdin and not on_terminal, cwd="/",
                                      env=entry.env, pass_fds=tuple(fds))
        except OSError as exc:
            os.close(report)
            if console is not None:
                console.close()
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"process: {entry.argv[0]} did "
                                                   f"not start: {exc.strerror or exc}")) from None
        finally:
            os.close(report_end)
            if console_end is not None:
                console_end.close()
            entry.close()
        # The report ends once the process executed or failed; the enter
        # program itself exits once it cloned the process (the master, if
        # any, was sent before).
        pid, failure = await enter.report(report)
        code = await spawn.exited(child.popen)
        master = None
        if console is not None:
            with console:
                master = terminal.take_master(console)
        if not pid and not failure:
            failure = f"process: {entry.argv[0]} exited {code} without starting it"
        if pid and not failure and on_terminal and master is None:
            failure = "process.terminal: the enter program handed over no terminal"
            os.kill(pid, signal.SIGKILL)   # it runs, on no terminal the agent holds
        if failure or not pid:
            child.close_pipes()
            if master is not None:
                os.close(master)
            if pid:
                await spawn.exited_pid(pid)
            raise self._failed(process, AgentError(ttrpc.FAILED_PRECONDITION, f"{failure} "
                                                   f"(container {key[0]!r})"))
        if master is not None:
            process.terminal = master
            child = await spawn.on_terminal(child, master, stdin)
        exit_ = asyncio.ensure_future(spawn.exited_pid(pid))
        process.pid, process.state = pid, RUNNING
        process.started.set()
        process.tasks.append(asyncio.ensure_future(self._watch(process, child, exit_)))
        return process

    async def _watch(self, process: Process, child: spawn.Child, exit_: asyncio.Future) -> None:
        pumps = [_hold_output(child.stdout, process.stdout, self.limits.pipe_chunk),
                 _hold_output(child.stderr, process.stderr, self.limits.pipe_chunk)]
        feeder = asyncio.ensure_future(_pump_in(child.stdin, process.stdin)) if process.stdin else None
        returncode = await exit_
        exited_at = time.time_ns()
        _done, pending = await asyncio.wait(pumps, timeout=self.limits.output_grace)
        complete = not pending
        for pump in pending:
            pump.cancel()
        child.close_pipes()
        process.stdout.end()
        process.stderr.end()
        if feeder is not None:
            process.stdin.lose_reader()
            feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await feeder
        if process.terminal is not None:
            os.close(process.terminal)
            process.terminal = None
        code, number = _exit_status(returncode)
        process.exit = ExitStatus(code, number, exited_at, complete)
        process.state = EXITED
        process.done.set()
        if process.exec_id:
            self._bound_exited(process.container_id)

    def _bound_exited(self, container_id: str) -> None:
        exited = [p for p in self.processes.values()
                  if p.container_id == container_id and p.exec_id and p.state == EXITED]
        if len(exited) <= self.limits.exited_execs_kept:
            return
        exited.sort(key=lambda p: p.exit.exited_at_ns)
        for old in exited[:len(exited) - self.limits.exited_execs_kept]:
            log.info("exec %s of container %s forgotten: %d exited execs were never removed", old.exec_id,
                     container_id, len(exited))
            del self.processes[old.key]
            old.unread()

    async def wait(self, container_id: str, exec_id: str) -> Process:
        process = self.get(container_id, exec_id)
        await process.done.wait()
        return process

    def remove(self, container_id: str, exec_id: str) -> int:
        """Forget an exited process; unread bytes dropped."""
        process = self.processes.get((container_id, exec_id))
        if process is None:
            return 0
        if process.state != EXITED:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"exec_id: {exec_id!r} still runs (signal it first)")
        del self.processes[process.key]
        return process.unread()

    async def close(self) -> None:
        """Kill every process the agent started and what they left running
        (each guest process leads its own process group)."""
        for process in list(self.processes.values()):
            if process.pid and not process.container_id:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
            process.signal(signal.SIGKILL)
        tasks = [t for p in self.processes.values() for t in p.tasks]
        if tasks:
            await asyncio.wait(tasks, timeout=5)


def _hold_output(pipe: spawn.PipeReader, stream: OutputStream, chunk: int) -> asyncio.Future:
    """The process's output held until the host acknowledges it: a pipe's
    in the pipe itself (its own descriptor of it: the child's pipes close
    with the process), a terminal's (no pipe) read into memory; done once
    every writer closed it."""
    if not pipe.terminal:
        stream.hold_pipe(os.dup(pipe.fileno()))
        return asyncio.ensure_future(stream.until_hung_up())
    return asyncio.ensure_future(_pump_out(pipe, stream, chunk))


async def _pump_out(pipe: spawn.PipeReader, stream: OutputStream, chunk: int) -> None:
    while True:
        await stream.wait_for_room()
        try:
            data = await pipe.read(chunk)
        except OSError as exc:
            if exc.errno == errno.EIO:   # a terminal whose last process left
                return
            raise
        if not data:
            return
        stream.append(data)
        if PUMP_BUSY_BYTES <= len(data) < PUMP_FULL_BYTES:
            await asyncio.sleep(PUMP_PAUSE)


async def _pump_in(pipe: asyncio.StreamWriter, stream: InputStream) -> None:
    try:
        while (chunk := await stream.next_chunk()) is not None:
            pipe.write(chunk)
            await pipe.drain()
    except (BrokenPipeError, ConnectionResetError):
        stream.lose_reader()
    finally:
        with contextlib.suppress(OSError):
            pipe.close()
