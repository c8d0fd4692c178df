"""The host side of the guest agent's line protocol (guest/agent.sh).

The agent listens on the guest's second serial port, which QEMU exposes as a
unix socket on the host. A serial line has no framing, no connection state
and may carry noise (the guest echoes what arrives before the agent switched
the line to raw mode), so every request carries an id and the client only
accepts an answer `<id> ok|err ...` for an id it is waiting for; anything else
on the line is ignored. Ids start with a random per-client prefix, so an
answer meant for a previous client (a restarted handler) is never taken for
a new request's.

A dead guest must not leave callers waiting for their timeouts: when the
socket closes (QEMU exited) or the owner calls `mark_dead` (it saw the QEMU
process exit), every pending request fails at once with GuestGone.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
import secrets
import time
from dataclasses import dataclass, field

from crust.common.aio import first_done

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0
# A statfs answers in milliseconds; kubelet polls stats, a hung guest must not hold it long.
STATS_TIMEOUT = 5.0  # under the proxy's 10 s per handler call, so the answer is a condition, not a timeout
# The slowest a guest writes dm-integrity's tags over a new volume (about
# 14 MB/s was measured under software emulation): a luksopen's time allowed.
INTEGRITY_WIPE_BYTES_PER_SECOND = 4 * 1024 * 1024
# The longest line read from the guest (a readout answer is about 88 KiB).
LINE_LIMIT = 1024 * 1024
SHM_TMPFS = "dev_shm"   # the pod's /dev/shm, a pod_tmpfs (no emptyDir's name, a DNS label, has "_")
AGENT_REACH = 11     # the first agent with reach and a cstarted that waits in the guest
AGENT_WARM = 12      # the first agent with warm (a throwaway container through crun)
AGENT_SCSI = 13      # the first agent that finds (and rescans) disks on a virtio-scsi controller
AGENT_RESUME = 15    # the first agent with resume (a VM restored from a template: clock and entropy)
AGENT_SUBPATH = 16   # the first agent that binds a subPath from a descriptor (subpath, subpathdrop)
_WORD = re.compile(r"^[A-Za-z0-9_.,=:/+@-]+$")
# A path the agent takes as it is (its check_path's characters), not in base64.
_PLAIN_PATH = re.compile(r"^/[A-Za-z0-9/_.@:+,=-]*$")


class AgentError(Exception):
    """A request that did not succeed."""


class AgentRefused(AgentError):
    """The agent answered `err`."""

    def __init__(self, command: str, message: str):
        self.command = command
        self.message = message
        super().__init__(f"guest agent refused {command}: {message}")


class AgentTimeout(AgentError):
    pass


class GuestGone(AgentError):
    """The guest (or its serial line) is gone; nothing will answer."""


def b64(text: str | bytes) -> str:
    """An argument that may hold spaces: URL-safe base64, "-" when empty."""
    data = text.encode() if isinstance(text, str) else text
    return base64.urlsafe_b64encode(data).decode() if data else "-"


@dataclass
class Answer:
    id: str
    words: list[str]
    fields: dict[str, str] = field(default_factory=dict)   # the key=value words

    @classmethod
    def parse(cls, ident: str, text: str) -> Answer:
        words = text.split()
        return cls(ident, words, dict(w.split("=", 1) for w in words if "=" in w))

    def int(self, key: str) -> int:
        return int(self.fields[key])


@dataclass(frozen=True)
class ProcessLook:
    """A spawned process as the guest's poll saw it: its output files'
    sizes (None: no such file) and its state ("run", an exit code, "gone":
    ended without one, "none": no spawn started it)."""
    out: int | None
    err: int | None
    state: str

    @property
    def ended(self) -> bool:
        return self.state != "run"


class AgentClient:
    def __init__(self, socket_path: str, *, default_timeout: float = DEFAULT_TIMEOUT):
        self.socket_path = socket_path
        self.default_timeout = default_timeout
        self._prefix = secrets.token_hex(3)
        self._next = 0
        self._pending: dict[str, tuple[str, asyncio.Future]] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._write_lock = asyncio.Lock()
        self._announced: asyncio.Future | None = None   # the agent's "- ok ready ..." line
        self.dead: str | None = None     # why, once the guest is gone
        self.version = 0   # the agent's, from its announcement or a ping's answer (0: not known)
        self._tmpfs_tops: dict[tuple[str, str], str] = {}   # (name, size) -> the guest path pod_tmpfs answered

    # ------------------------------------------------------------ plumbing

    async def connect(self, timeout: float = 10.0) -> None:
        """Connect to QEMU's socket (it may not exist yet right after spawn)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(self.socket_path,
                                                                                limit=LINE_LIMIT)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline or self.dead:
                    raise GuestGone(f"agent socket {self.socket_path} did not come up"
                                    + (f" ({self.dead})" if self.dead else "")) from None
                await asyncio.sleep(0.02)
        self._announced = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._read_loop(), name=f"agent-reader {self.socket_path}")

    async def _read_loop(self) -> None:
        try:
            while True:
                try:
                    raw = await self._reader.readline()
                except ValueError:
                    # A line longer than LINE_LIMIT (noise: no answer is
                    # that long); the reader dropped it, the line goes on.
                    log.warning("agent line longer than %d bytes ignored", LINE_LIMIT)
                    continue
                if not raw:
                    break
                line = raw.decode(errors="replace").strip("\r\n")
                parts = line.split(" ", 2)
                if parts[:2] == ["-", "ok"] and len(parts) == 3 and parts[2].startswith("ready "):
                    if not self._announced.done():
                        self._announced.set_result(Answer.parse("-", parts[2]))
                    continue
                if len(parts) < 2 or parts[1] not in ("ok", "err") or parts[0] not in self._pending:
                    log.debug("agent line ignored: %r", line)
                    continue
                command, fut = self._pending.pop(parts[0])
                if fut.done():
                    continue
                rest = parts[2] if len(parts) > 2 else ""
                if parts[1] == "ok":
                    fut.set_result(Answer.parse(parts[0], rest))
                else:
                    fut.set_exception(AgentRefused(command, rest))
        except (ConnectionError, OSError) as exc:
            self.mark_dead(f"agent socket error: {exc}")
        self.mark_dead("the agent socket closed (QEMU exited?)")

    def mark_dead(self, reason: str) -> None:
        """Fail every pending and future request at once."""
        if self.dead is None:
            self.dead = reason
        for command, fut in self._pending.values():
            if not fut.done():
                fut.set_exception(GuestGone(f"{command}: {self.dead}"))
        self._pending.clear()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self.mark_dead("the client was closed")

    async def request(self, command: str, *args: str, timeout: float | None = None) -> Answer:
        """Send one request, wait for its answer. Raises AgentRefused on `err`,
        AgentTimeout, or GuestGone."""
        for word in (command, *args):
            if not _WORD.match(word):
                raise ValueError(f"agent argument {word!r} is not one plain word: encode it with b64()")
        if self.dead:
            raise GuestGone(f"{command}: {self.dead}")
        if self._writer is None:
            raise GuestGone(f"{command}: not connected")
        self._next += 1
        ident = f"{self._prefix}-{self._next}"
        fut = asyncio.get_running_loop().create_future()
        self._pending[ident] = (command, fut)
        line = " ".join((ident, command, *args)) + "\n"
        limit = timeout if timeout is not None else self.default_timeout
        sent = time.monotonic()
        try:
            async with self._write_lock:
                self._writer.write(line.encode())
                await self._writer.drain()
            answer = await asyncio.wait_for(fut, limit)
            # A request's round trip (the guest's shell included): where a
            # pod's start spends its time (bench/pod_start_microvm.py --agent-times).
            log.debug("agent request", extra={"fields": {"command": command,
                                                         "ms": round((time.monotonic() - sent) * 1e3, 1)}})
            return answer
        except asyncio.TimeoutError:
            raise AgentTimeout(f"guest agent: no answer to {command} within {limit:.1f}s") from None
        except (ConnectionError, OSError) as exc:
            self.mark_dead(f"agent socket error: {exc}")
            raise GuestGone(f"{command}: {self.dead}") from None
        finally:
            self._pending.pop(ident, None)

    async def wait_ready(self, timeout: float = 120.0, interval: float = 2.0) -> Answer:
        """Until the agent is up: its "ready" announcement, or the answer to a
        ping (a client that connects to a running guest). Pings are rare on
        purpose: those sent before the agent opened its port are delivered
        all at once when it does, and each costs a round in the guest."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AgentTimeout(f"the guest agent did not answer within {timeout:.0f}s")
            ping = asyncio.ensure_future(self.request("ping", timeout=min(interval, remaining)))
            done = await first_done(ping, self._announced)
            if ping in done:
                try:
                    return self._knows(ping.result())
                except AgentTimeout:
                    continue
            ping.cancel()
            try:
                await ping
            except (asyncio.CancelledError, AgentError):
                pass
            return self._knows(self._announced.result())

    def _knows(self, hello: Answer) -> Answer:
        """Keep the agent's version from its announcement or a ping's answer."""
        try:
            self.version = int(hello.fields.get("agent", "0"))
        except ValueError:
            self.version = 0
        return hello

    def _destination(self, path: str) -> str:
        """A destination inside a container as cbind takes it: plain when
        the agent reads plain paths (agent 10: decoding base64 costs the
        guest a pipeline of three processes) and it is one, else base64."""
        return path if self.version >= 10 and _PLAIN_PATH.match(path) else b64(path)

    # ------------------------------------------------------------ commands

    async def ping(self) -> Answer:
        return await self.request("ping")

    async def mount(self, serial: str, fs_type: str, options: list[str], readonly: bool, target: str,
                    timeout: float = 60.0) -> str:
        """Mount the virtio disk with this serial; returns its guest name (vda)."""
        answer = await self.request("mount", serial, fs_type, b64(",".join(options)),
                                    "ro" if readonly else "rw", target, timeout=timeout)
        return answer.fields["device"]

    async def fsgroup(self, target: str, gid: int, policy: str, timeout: float = 300.0) -> bool:
        """Kubernetes fsGroup semantics; returns whether the tree was walked."""
        answer = await self.request("fsgroup", target, str(gid), policy, timeout=timeout)
        return answer.fields.get("walked") == "1"

    async def stats(self, target: str, timeout: float = STATS_TIMEOUT) -> dict[str, int | str]:
        """total/free/avail bytes, inodes/ifree, mode (ro|rw), fstype, device,
        errors (ext4 errors_count), devsize (bytes)."""
        answer = await self.request("stats", target, timeout=timeout)
        return {k: (int(v) if v.isdigit() else v) for k, v in answer.fields.items()}

    async def grow(self, target: str, timeout: float = 120.0) -> dict[str, int]:
        answer = await self.request("grow", target, timeout=timeout)
        return {k: int(v) for k, v in answer.fields.items() if v.isdigit()}

    async def umount(self, target: str, timeout: float = 60.0) -> bool:
        """Returns whether something was unmounted (already unmounted is fine)."""
        answer = await self.request("umount", target, timeout=timeout)
        return answer.fields.get("unmounted") == "1"

    async def exec(self, command_line: str) -> int:
        """Start `sh -c command_line` in the guest (output to the console);
        returns its pid for wait()."""
        return (await self.request("exec", b64(command_line))).int("pid")

    async def wait(self, pid: int) -> int | None:
        """The exit code, or None while it runs (never blocks in the guest)."""
        answer = await self.request("wait", str(pid))
        return int(answer.fields["code"]) if answer.fields.get("state") == "exited" else None

    async def wait_exit(self, pid: int, timeout: float = 60.0, interval: float = 0.1) -> int:
        deadline = time.monotonic() + timeout
        while (code := await self.wait(pid)) is None:
            if time.monotonic() > deadline:
                raise AgentTimeout(f"guest process {pid} still running after {timeout:.0f}s")
            await asyncio.sleep(interval)
        return code

    async def bind(self, source: str, target: str, readonly: bool) -> None:
        """A container's view of a mounted volume (or a subpath of it)."""
        await self.request("bind", source, target, "ro" if readonly else "rw")

    async def subpath(self, root: str, subpath: str, container_id: str, index: int, strict: bool) -> str:
        """subpath below root bound at a place of the agent's own for the
        container (index: the mount's), from a descriptor opened without
        leaving root; its guest path. strict: it must exist and pass no
        symlink. Refused (AgentRefused) when it leads out of root."""
        words = ["strict"] if strict else []
        answer = await self.request("subpath", *words, root, b64(subpath), container_id, str(index))
        return answer.fields["path"]

    async def subpath_drop(self, container_id: str) -> None:
        """The container's subPath binds unmounted (none is success)."""
        await self.request("subpathdrop", container_id)

    async def checkpath(self, root: str, subpath: str) -> None:
        """Refused (AgentRefused) when the subpath leaves the volume: '..' or a symlink."""
        await self.request("checkpath", root, b64(subpath))

    async def luksopen(self, serial: str, fs_type: str, name: str, passphrase: bytearray, *,
                       integrity: str = "", size_bytes: int = 0, timeout: float = 180.0) -> bool:
        """Open the LUKS2 volume on the disk with this serial as /dev/mapper/name;
        a blank disk is luksFormatted and formatted with fs_type inside first
        (returns True then); any other header than crust's is refused. The
        passphrase is one word of this request on the VM's private serial
        line, nowhere else; the encoded copy is wiped. With integrity, a
        first format writes every sector's tag: the timeout grows with
        size_bytes at INTEGRITY_WIPE_BYTES_PER_SECOND."""
        if integrity:
            timeout += size_bytes / INTEGRITY_WIPE_BYTES_PER_SECOND
        encoded = bytearray(base64.urlsafe_b64encode(passphrase))
        try:
            # The request line is built from str words: its copies are freed, not wiped.
            answer = await self.request("luksopen", serial, fs_type, name, encoded.decode(), integrity or "none",
                                        timeout=timeout)
        finally:
            for i in range(len(encoded)):
                encoded[i] = 0
        return answer.fields.get("formatted") == "1"

    async def luksresize(self, target: str, timeout: float = 60.0) -> bool:
        """Grow the opened LUKS2 volume mounted at target to its grown disk
        (False: target is no encrypted volume, nothing to do)."""
        return (await self.request("luksresize", target, timeout=timeout)).fields.get("resized") == "1"

    async def luksclose(self, name: str, timeout: float = 60.0) -> None:
        await self.request("luksclose", name, timeout=timeout)

    async def kill(self, pid: int) -> None:
        await self.request("kill", str(pid))

    async def poweroff(self, timeout: float = 60.0) -> Answer:
        """Kill the guest's processes, unmount everything, power off."""
        return await self.request("poweroff", timeout=timeout)

    # ------------------------------------------------ containers of a pod (agent 2)

    async def spawn(self, name: str, command_line: str) -> int:
        """Start `sh -c command_line` in the guest with its stdout and stderr
        written to the guest files named by name (a plain word, used once);
        returns its pid for wait(), signal() and readout()."""
        return (await self.request("spawn", name, b64(command_line))).int("pid")

    async def readout(self, name: str, stream: str, offset: int, limit: int) -> tuple[bytes, int]:
        """Up to limit bytes of a spawned process's stdout ("out") or stderr
        ("err") from offset, and the file's size when read."""
        answer = await self.request("readout", name, stream, str(offset), str(limit))
        data = answer.fields.get("data", "-")
        return (b"" if data == "-" else base64.urlsafe_b64decode(data)), answer.int("size")

    async def signal(self, pid: int, signal: int) -> int:
        """Signal the process a spawn runs; returns how many were signalled
        (0 once it exited)."""
        return (await self.request("signal", str(pid), str(signal))).int("signalled")

    async def signal_root(self, root: str, signal: int) -> int:
        """Signal every guest process whose root directory is root."""
        return (await self.request("signalroot", root, str(signal))).int("signalled")

    async def container_signal(self, container_id: str, signal: int) -> int:
        """Signal every process in the container's cgroup (agent 5; signal 0
        counts them); how many were signalled."""
        answer = await self.request("csignal", container_id, str(signal))
        return int(answer.fields["signalled"])

    async def container_started(self, container_id: str, pid: int, wait: float = 0.0) -> tuple[bool, bool]:
        """(started, exited): crun has started the container, the spawn pid
        (its `crun run`) has ended; without running crun (agent 9). wait:
        seconds the guest waits for either before it answers (agent 11;
        an older agent answers at once)."""
        ms = int(wait * 1000) if self.version >= AGENT_REACH else 0
        answer = await self.request("cstarted", container_id, str(pid), *((str(ms),) if ms else ()))
        return answer.fields.get("started") == "1", answer.fields.get("exited") == "1"

    async def poll(self, processes: list[tuple[str, int]]) -> dict[str, ProcessLook]:
        """Each spawned process's state and output sizes, by its output
        name, in one request (agent 9); processes: (name, spawn pid)."""
        answer = await self.request("poll", *(f"{name}:{pid}" for name, pid in processes))
        looks = {}
        for name, _ in processes:
            out, err, state = answer.fields.get(name, "-,-,none").split(",", 2)
            looks[name] = ProcessLook(out=None if out == "-" else int(out), err=None if err == "-" else int(err),
                                      state=state)
        return looks

    async def container_state(self, container_id: str) -> str:
        """crun's state of the container: created, running, stopped, or absent (agent 5)."""
        return (await self.request("cstate", container_id)).fields["state"]

    async def pod_pid_namespace(self) -> str:
        """The pod's shared PID namespace (made on first use; agent 5), as a
        path for an OCI spec's linux.namespaces."""
        answer = await self.request("podpid")
        return f"/proc/{int(answer.fields['pid'])}/ns/pid"

    async def container_forget(self, container_id: str) -> None:
        """crun's state of a deleted container and its bundle, gone (agent 5)."""
        await self.request("cforget", container_id)

    async def container_stats(self, container_id: str) -> dict[str, int]:
        """The container's cgroup v2 numbers ("-": all of the pod's containers;
        agent 6): "cpu.usage_usec", "memory.anon", "memory.events.oom_kill",
        "memory.current", "memory.max" (0: no limit), "pids.current", ..."""
        answer = await self.request("cstats", container_id)
        numbers = {}
        for key, value in answer.fields.items():
            if value == "max":
                numbers[key] = 0
            elif value.isdigit():
                numbers[key] = int(value)
        return numbers

    async def network(self, mac: str, mtu: int, addresses: list[str], routes: list[str]) -> None:
        """Give the NIC with that MAC address the pod's addresses ("ip/prefix"),
        MTU and routes ("destination,gateway"), as eth0 (agent 6)."""
        await self.request("netconf", mac, str(mtu), b64(" ".join(addresses)), b64(" ".join(routes)))

    async def terminal_size(self, pid: int, columns: int, rows: int) -> None:
        """Resize the terminal of a process spawned with one (agent 6)."""
        await self.request("ttysize", str(pid), str(columns), str(rows))

    async def container_setup(self, root: str) -> None:
        """/proc and a small /dev (null, zero, full, random, urandom, tty,
        shm) in a container's mounted root."""
        await self.request("ctrsetup", root)

    async def umount_all(self, root: str, timeout: float = 60.0) -> int:
        """Unmount root and everything below it, the last mounted first."""
        return (await self.request("umountall", root, timeout=timeout)).int("unmounted")

    async def forget_output(self, name: str) -> None:
        """Remove a spawned process's output files from the guest."""
        await self.request("forget", name)

    async def remount_readonly(self, target: str) -> None:
        """Make this one mount read-only (a container's read-only root)."""
        await self.request("readonly", target)

    # ------------------------------------------------ a pod's shared directories (agent 3, crust-live 4)

    async def share_mount(self, target: str, tag: str = "crust", timeout: float = 60.0) -> None:
        """Mount a shared directory of the VM (virtio-fs, by its tag; the
        tag crust-live needs agent 4) at target; already mounted there is success."""
        await self.request("sharemount", target, tag, timeout=timeout)

    async def container_bind(self, root: str, source: str, destination: str, readonly: bool) -> str:
        """Bind the guest path source at destination inside the container
        whose root is mounted at root; the destination is resolved inside
        root (its links never lead out of it). Returns the guest path bound."""
        answer = await self.request("cbind", root, source, self._destination(destination),
                                    "ro" if readonly else "rw")
        return answer.fields["target"]

    async def container_binds(self, root: str, binds: list[tuple[str, str, bool]]) -> list[str]:
        """container_bind for each (source, destination, readonly), in order,
        in one request (agent 8; a later bind may land inside an earlier
        one). Returns the guest paths bound, in the same order. A failure
        leaves the binds before it in place."""
        words = []
        for source, destination, readonly in binds:
            words += [source, self._destination(destination), "ro" if readonly else "rw"]
        answer = await self.request("cbinds", root, *words)
        return [answer.fields[f"target{n}"] for n in range(1, len(binds) + 1)]

    async def pod_tmpfs(self, name: str, size: str = "") -> str:
        """The pod's guest tmpfs of that name (made on first use, of at most
        size, e.g. "16384k"; the kernel's default otherwise); returns its
        guest path (a subPath in it: subpath()). A tmpfs stays mounted for
        the guest's life: its top is asked of the guest once."""
        known = self._tmpfs_tops.get((name, size))
        if known is not None:
            return known
        path = (await self.request("podtmpfs", name, b64(""), size or "-")).fields["path"]
        self._tmpfs_tops[(name, size)] = path
        return path

    async def warm(self, timeout: float = 60.0) -> None:
        """Run one throwaway container through crun in the guest (agent 12):
        a VM that waits for a pod pays now for its first container start
        (code translated once under emulation), not the pod. Nothing stays."""
        await self.request("warm", timeout=timeout)

    async def resume(self, realtime_ns: int, seed: bytes, timeout: float = 30.0) -> None:
        """A VM restored from a template made its own (agent 15): its wall
        clock set to realtime_ns, seed credited to the kernel's input pool
        and the random number generator reseeded from it."""
        seconds, nanoseconds = divmod(realtime_ns, 1_000_000_000)
        await self.request("resume", str(seconds), str(nanoseconds), seed.hex(), timeout=timeout)

    async def reach(self, paths: list[str]) -> None:
        """Look each guest path up in the agent's mount namespace (agent
        11): a share's submount is mounted there once, and every container
        that binds it later binds that one mount."""
        await self.request("reach", *paths)

    async def mirror(self, name: str, source: str) -> str:
        """A copy in the guest's memory of the volume kubelet's atomic writer
        updates, bound in a share at source, kept in step with it by the
        agent (agent 7); returns the copy's guest path. Again for the same
        name: the same copy."""
        return (await self.request("mirror", name, source)).fields["path"]

    async def spawn_file(self, name: str, script: str) -> int:
        """As spawn, the command being the shell script at the guest path
        script (in the pod's share): any size the kernel takes."""
        return (await self.request("spawnfile", name, script)).int("pid")
