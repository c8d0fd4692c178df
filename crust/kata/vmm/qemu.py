"""One QEMU microVM per sandbox: start, hot-plug disks, resize, stop.

The guest is the image from image.py: a Debian kernel and an initramfs
whose agent (crust.guest) answers on a virtio-serial port. Volumes reach the
guest as virtio-blk disks backed by a host block device (a loop device); the
host never mounts them. QMP adds and removes disks while the guest runs and
tells the guest when a disk grew (block_resize), so the agent can grow the
mounted file system online with the guest's own kernel. What QEMU is asked
to run (VmConfig, the guest kernel's command line) is crust.kata.vmm.config's.

Choices worth knowing:
- `-nodefaults -display none` instead of `-nographic`: no monitor or serial
  port on QEMU's stdio, every channel is explicit (the console to the
  handler, which keeps a bounded file of it: crust.kata.vmm.console; the
  agent's port and QMP on unix sockets in the VM's work directory).
- `-machine pc`: its ACPI PCI hotplug works with Debian's kernels out of
  the box (device_add / device_del of virtio-blk-pci).
- The disks' bus is a setting (VmConfig.disk_bus). virtio-blk, the
  default: a PCI device per disk, hot-plugged through ACPI; under software
  emulation the guest spends a while per device evaluating the pc
  machine's interrupt routing (`_PRT`, an AML loop) before the driver
  binds. virtio-scsi (Kata's default): one controller at boot, each disk a
  LUN on it; adding one is a SCSI event and a scan of that one LUN, a
  fraction of that, nothing on the PCI bus. The guest's kernel scans nothing at boot
  (scsi_mod.scan=none) and finds each LUN when QEMU announces it.
- The accelerator is a setting. KVM is the one to use where it works; on the
  development machines `-accel kvm` aborts ("failed to set MSR 0x10a") or
  hangs, so VmConfig's default is tcg (software emulation, a few seconds to
  boot). The handler's `auto` (accel.py) probes KVM once and picks.
- QEMU runs in its own session: a sandbox outlives a restarted handler, as
  containers outlive a restarted runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.aio import first_done
from crust.common.atomicfile import write_atomic
from crust.common.private import make_dirs, open_new
from crust.kata.agent import stop_bound
from crust.kata.vmm import console, saved_ram
from crust.kata.vmm.console import ConsoleLog
from crust.kata.agent.client import PORT_CHARDEV, guest_text
from crust.kata.vmm.agent_port import PortAgent
from crust.kata.vmm.devices import (
    SCSI_CONTROLLER,
    SHARE_TAGS,
    Disk,
    GuestSilent,
    SharedDir,
    VmDevices,
    VmError,
    VmHung,
)
from crust.kata.vmm.qmp import QmpClient, QmpError, QmpGone, QmpTimeout
from crust.kata.vmm.virtiofsd import Virtiofsd, VirtiofsdError
from crust.kata.vmm.config import (
    ACCELERATORS,
    BALLOON_ARGS,
    DISK_BUSES,
    MIB,
    SCSI_CMDLINE,
    VmConfig,
    accel_args,
    memory_arg,
    root_args,
)
from crust.kata.vmm.saving import VmSaving
from crust.sys import proc

log = logging.getLogger(__name__)

# The guest agent's virtio-serial port (specs/agent.proto): the guest finds
# it by this name in /sys/class/virtio-ports.
AGENT_PORT_NAME = "crust.agent"
# sun_path is 108 bytes, NUL included.
MAX_SOCKET_PATH = 107
# Where a VM's sockets go when its work directory is too deep for them (a
# sun_path holds 107 bytes): one directory per work directory, named by a
# hash of its path, so a restarted handler finds the same sockets.
SHORT_SOCKET_ROOT = Path("/run/crust-vm-sockets")
CONSOLE_CHARDEV = "console"
# The console lines a failure quotes: a kernel panic's message, trace and end marker.
CONSOLE_LINES = 40


def socket_dir_for(workdir: Path) -> Path:
    """The work directory itself when the longest of a VM's socket names
    fits in it, else a short directory of its own."""
    longest = max((f"fs{SharedDir(tag, Path('.')).suffix}.sock" for tag in SHARE_TAGS), key=len)
    if len(str(workdir / longest)) <= MAX_SOCKET_PATH:
        return workdir
    return SHORT_SOCKET_ROOT / hashlib.sha256(str(workdir.absolute()).encode()).hexdigest()[:24]


def qemu_pids_under(*dirs: Path) -> list[int]:
    """QEMU processes whose command line names a path below one of dirs
    (a VM's sockets and logs live in its work directory): the microVMs made
    under those directories, and only those."""
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and is_qemu_under(int(entry.name), *dirs)]


def is_qemu_under(pid: int, *dirs: Path) -> bool:
    """Whether the process under pid is a QEMU whose command line names a
    path below one of dirs (see qemu_pids_under)."""
    needles = [(str(Path(d).resolve()) + "/").encode() for d in dirs]
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].endswith(b"qemu-system-x86_64") and any(n in a for a in argv for n in needles)


# A VM's name and socket directory, kept in its work directory: a VM booted
# ahead of its pod (crust.kata.supply.pool) moves into the pod's directory under a
# name and with sockets of its own, which a restarted handler reads here.
IDENTITY_FILE = "vm.json"


def _set_autogroup_nice(pid: int, value: int) -> None:
    """The nice value of the scheduling group of pid's session (kernels
    without autogroups have no such file: nothing to do)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(value))
    except (FileNotFoundError, ProcessLookupError):
        pass


def read_identity(workdir: Path) -> tuple[str, Path] | None:
    """(name, socket directory) a VM recorded in workdir, or None."""
    try:
        data = json.loads((workdir / IDENTITY_FILE).read_text())
        name, sockets = data["name"], Path(data["socket_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str) or not name.startswith("crust-") or not sockets.is_absolute():
        return None
    if sockets != workdir and sockets.parent != SHORT_SOCKET_ROOT:
        return None
    return name, sockets


class Vm(VmDevices, VmSaving):
    def __init__(self, name: str, workdir: Path, config: VmConfig, socket_dir: Path | None = None):
        if config.accel not in ACCELERATORS:
            raise ValueError(f"accelerator {config.accel!r}: one of {', '.join(ACCELERATORS)}")
        if config.disk_bus not in DISK_BUSES:
            raise ValueError(f"disk bus {config.disk_bus!r}: one of {', '.join(DISK_BUSES)}")
        if config.cpus < 1:
            raise ValueError(f"cpus {config.cpus}: a VM needs at least one")
        self.name = name
        self.config = config
        self._place(workdir)
        self.socket_dir = socket_dir or socket_dir_for(workdir)
        # The guest agent's virtio-serial port (specs/agent.proto).
        self.port_socket = self.socket_dir / "port.sock"
        self.qmp_socket = self.socket_dir / "qmp.sock"
        self.console_socket = self.socket_dir / "console.sock"
        # The guest's serial console, read into console.log with a bound.
        self.console = ConsoleLog(self.console_socket, lambda: self.console_log)
        self.virtiofsds: dict[str, Virtiofsd] = {}   # by tag
        self.disks: dict[str, Disk] = {}
        # The next LUN to try on the SCSI controller: LUNs only grow while
        # this object lives, so a LUN just unplugged (whose removal the guest
        # may not have handled yet) is not announced again at once.
        self._next_lun = 0
        self.boot_seconds: float | None = None
        self.qmp = QmpClient(str(self.qmp_socket))
        self.port = PortAgent(str(self.port_socket), self.qmp, name)
        self.port.on_silent = self.kill_unresponsive
        # Why the host killed this VM's QEMU (its agent left a stop's call
        # unanswered), "" while it did not.
        self.unresponsive = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._adopted: proc.ProcessId | None = None  # a VM started by an earlier handler process (adopt())
        self._exited: asyncio.Task | None = None
        self.stopping = False   # stop() has begun: its file servers end with QEMU
        # A saved VM's state QEMU reads instead of booting (start(saved=)):
        # our descriptor until QEMU runs, then its number in QEMU.
        self._incoming_fd: int | None = None
        self._incoming_number: int | None = None
        # The memfd of guest RAM kept apart (config.ram_apart): its number,
        # which QEMU inherited, and our descriptor until QEMU runs.
        self.ram_fd: int | None = None
        self._ram_open: int | None = None
        # Memory hot-plugged for the pod beyond config.memory_mib (crust.kata.pod.guest_memory).
        self.plugged_mib = 0

    def _place(self, workdir: Path) -> None:
        self.workdir = workdir
        self.console_log = workdir / "console.log"
        self.qemu_log = workdir / "qemu.log"
        self.pidfile = workdir / "qemu.pid"

    def renice(self, value: int) -> None:
        """Every thread of QEMU at nice value (Linux sets it per thread),
        and QEMU's session's scheduling group: QEMU runs in a session of its
        own, and with autogroups (the kernel's default) a session's share of
        the CPU against other sessions follows its group's nice value, not
        its threads'."""
        pid = self.pid
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), value)
            except ProcessLookupError:
                pass   # a thread that ended meanwhile
        _set_autogroup_nice(pid, value)
        self.config.nice = value

    def relocate(self, workdir: Path) -> None:
        """The VM's work directory was renamed to workdir (a pooled VM taken
        by a pod): QEMU keeps its open files; its sockets are elsewhere."""
        if self.socket_dir == self.workdir:
            raise VmError(f"vm {self.name}: its sockets are in its work directory; it cannot move")
        self._place(workdir)
        for daemon in self.virtiofsds.values():
            daemon.relocate(workdir)

    # -------------------------------------------------------------- process

    def argv(self) -> list[str]:
        c = self.config
        try:
            root_size = os.stat(c.root_image).st_size
        except OSError:
            root_size = 0   # start() refuses a VM without its root; QEMU would too
        niced = ["nice", "-n", str(c.nice)] if c.nice else []   # nice execs QEMU: the pid is QEMU's
        return [
            *niced, c.qemu_binary, "-name", self.name, "-machine", "pc", *accel_args(c),
            "-m", memory_arg(c.memory_mib, c.max_memory_mib, root_size), *root_args(c, root_size),
            "-smp", str(c.cpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(c.kernel), "-initrd", str(c.initrd), "-append", self.cmdline(),
            # ttyS0, the console: read by the handler into a bounded file (crust.kata.vmm.console).
            "-chardev", f"socket,id={CONSOLE_CHARDEV},path={self.console_socket},server=on,wait=off",
            "-serial", f"chardev:{CONSOLE_CHARDEV}",
            "-device", "virtio-serial-pci,id=ports",
            "-chardev", f"socket,id={PORT_CHARDEV},path={self.port_socket},server=on,wait=off",
            "-device", f"virtserialport,bus=ports.0,chardev={PORT_CHARDEV},name={AGENT_PORT_NAME}",
            *BALLOON_ARGS,
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
            "-pidfile", str(self.pidfile),
            *self._shared_dir_args(),
            *self._nic_args(),
            *self._disk_bus_args(),
            *self._incoming_args(),
            *c.extra_args,
        ]

    def cmdline(self) -> str:
        c = self.config
        return f"{c.cmdline} {SCSI_CMDLINE}" if c.disk_bus == "virtio-scsi" else c.cmdline

    def _disk_bus_args(self) -> list[str]:
        if self.config.disk_bus != "virtio-scsi":
            return []
        return ["-device", f"virtio-scsi-pci,id={SCSI_CONTROLLER}"]

    def _nic_args(self) -> list[str]:
        """romfile= empty: no iPXE option ROM to load (the kernel boots
        directly, and the ROM costs boot time under emulation)."""
        nic = self.config.nic
        if nic is None:
            return []
        return ["-netdev", f"tap,id=pod,fd={nic.tap_fd},vhost=off",
                "-device", f"virtio-net-pci,netdev=pod,mac={nic.mac},romfile="]

    @property
    def memory_mib(self) -> int:
        """The guest's memory now: what it booted with and what was plugged."""
        return self.config.memory_mib + self.plugged_mib

    @property
    def pid(self) -> int:
        if self._proc is not None:
            return self._proc.pid
        return self._adopted.pid if self._adopted is not None else 0

    @property
    def identity(self) -> proc.ProcessId | None:
        """QEMU's pid and start time (None before it starts)."""
        if self._proc is not None:
            return proc.identify(self._proc.pid) if self._proc.returncode is None else None
        return self._adopted

    def is_this_vm(self, qemu: proc.ProcessId) -> bool:
        """Whether that process is alive and runs this VM's QEMU: the same
        process (pid and start time) and this VM's name on its command line."""
        if not proc.alive(qemu):
            return False
        try:
            argv = Path(f"/proc/{qemu.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return self.name.encode() in argv

    def alive(self) -> bool:
        if self._proc is not None:
            return self._proc.returncode is None
        return self._adopted is not None and self.is_this_vm(self._adopted)

    def console_tail(self, lines: int = 20) -> str:
        return console.tail(self.console_log, lines)

    async def _watch(self) -> int:
        if self._proc is None:  # adopted: not our child, poll for its end
            while self.alive():
                await asyncio.sleep(0.2)
            code = -1
        else:
            code = await self._proc.wait()
        reason = f"QEMU exited with code {code}"
        log.info("vm %s: %s", self.name, reason)
        await self.port.close(reason)
        return code

    async def _guarded(self, coro, what: str):
        """Await coro, but fail at once (with QEMU's and the guest's last
        words) if QEMU exits meanwhile."""
        task = asyncio.ensure_future(coro)
        done = await first_done(task, self._exited)
        if task in done:
            exc = task.exception()
            if exc is None:
                return task.result()
            if not isinstance(exc, (QmpGone, ConnectionError)):
                raise exc
            # A closed socket (or one reset while read: QEMU exiting between
            # the accept and its greeting) usually means QEMU is exiting: say why.
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), 2)
            except asyncio.TimeoutError:
                raise exc from None
        else:
            task.cancel()
            try:
                await task
            except BaseException:
                pass
        raise VmError(f"vm {self.name}: QEMU exited ({self._exited.result()}) during {what}; "
                      f"qemu: {self._qemu_log_text() or '-'}; console: {self.console_tail(CONSOLE_LINES) or '-'}")

    async def _monitor(self, coro):
        """A QMP step of start or adopt: its failures are the VM's (VmError)."""
        try:
            return await coro
        except QmpTimeout as exc:
            raise VmHung(f"vm {self.name}: {exc}; qemu: {self._qemu_log_text() or '-'}") from None
        except (QmpGone, QmpError) as exc:
            raise VmError(f"vm {self.name}: {exc}") from None

    def _qemu_log_text(self) -> str:
        return self.qemu_log.read_text(errors="replace").strip() if self.qemu_log.exists() else ""

    async def start(self, ready_timeout: float = 120.0, *, saved: Path | None = None) -> float:
        """Boot and wait until the agent answers; returns the boot time (s).

        saved: a VM's state that save() wrote (crust.kata.supply.template), which
        QEMU loads instead of booting: this VM's config must be the saved
        one's, devices included (no shares, no NIC: they are plugged after).
        The guest is then made this VM's own before anyone uses it: the
        agent sets its clock and reseeds its random number generator
        (Resume), or the start fails."""
        for sock in (self.port_socket, self.qmp_socket, self.console_socket):
            if len(str(sock)) > MAX_SOCKET_PATH:
                raise VmError(f"socket path too long for a unix socket: {sock}")
        if not self.config.root_image.is_file():
            raise VmError(f"vm {self.name}: its guest root {self.config.root_image} is not a file "
                          f"(python -m crust.kata.image build makes it)")
        make_dirs(self.workdir)
        make_dirs(self.socket_dir)
        for stale in (self.port_socket, self.qmp_socket, self.console_socket, self.pidfile, self.console_log,
                      console.previous(self.console_log)):
            stale.unlink(missing_ok=True)
        write_atomic(self.workdir / IDENTITY_FILE, json.dumps(
            {"name": self.name, "socket_dir": str(self.socket_dir)}).encode(), mode=0o600)
        started = time.monotonic()
        for shared in self.config.shared_dirs:
            daemon = self.virtiofsds[shared.tag] = self._daemon(shared)
            try:
                await daemon.start()
            except (VirtiofsdError, OSError) as exc:
                await self._stop_virtiofsd()
                raise VmError(f"vm {self.name}: its shared directory {shared.tag}: {exc}") from None
        if saved is not None:
            try:
                self._incoming_fd = os.open(saved, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError as exc:
                await self._stop_virtiofsd()
                raise VmError(f"vm {self.name}: its saved state {saved}: {exc.strerror}") from None
        if self.config.ram_apart:
            try:
                self.ram_fd = self._ram_open = await asyncio.to_thread(
                    saved_ram.new_ram, self.name, self.config.memory_mib * saved_ram.MIB,
                    saved_ram.ram_path(saved) if saved is not None else None)
            except (saved_ram.RamFileError, OSError) as exc:
                self._close_passed()
                await self._stop_virtiofsd()
                raise VmError(f"vm {self.name}: {exc}") from None
        with os.fdopen(open_new(self.qemu_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as out:
            try:
                # QEMU makes its console log, pid file and sockets in the
                # work directory: they are 0600, whatever our umask.
                passed = ((self.config.nic.tap_fd,) if self.config.nic else ()) + tuple(
                    fd for fd in (self._incoming_fd, self._ram_open) if fd is not None)
                self._proc = await asyncio.create_subprocess_exec(
                    *self.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                    start_new_session=True, umask=0o077, pass_fds=passed)
            except FileNotFoundError:
                await self._stop_virtiofsd()
                raise VmError(f"{self.config.qemu_binary} not found: apt-get install qemu-system-x86") from None
            finally:
                self._close_passed()   # QEMU's copies are used
        if self.config.nice:
            _set_autogroup_nice(self._proc.pid, self.config.nice)
        self._exited = asyncio.create_task(self._watch(), name=f"vm-watch {self.name}")
        try:
            await self._monitor(self._guarded(self.qmp.connect(), "QMP connect"))
            await self.console.open()   # QEMU made its sockets before it greeted on QMP
            if saved is not None:
                await self._monitor(self._guarded(self._load(ready_timeout), "restore"))
                loaded = time.monotonic() - started
                await self._guarded(self._resume(), "resume")
            else:
                # The VM is ready once its guest's agent answers on its port.
                await self._guarded(self._agent_answers(ready_timeout), "boot")
        except BaseException:
            await self.kill()
            raise
        self.boot_seconds = time.monotonic() - started
        if saved is not None:
            log.info("vm %s: restored, state loaded %.2fs and agent ready %.2fs after start (pid %d, %s)",
                     self.name, loaded, self.boot_seconds, self.pid, self.config.accel)
        else:
            log.info("vm %s: agent ready %.2fs after start (pid %d, %s)", self.name, self.boot_seconds,
                     self.pid, self.config.accel)
        return self.boot_seconds

    async def _agent_answers(self, timeout: float) -> None:
        started = asyncio.get_running_loop().time()
        if await self.port.ready(wait=timeout) is not None:
            return
        waited = asyncio.get_running_loop().time() - started
        if not self.alive() or waited < timeout:
            # Given up early: QEMU's monitor closed (QEMU exiting, not yet
            # reaped) or the port would not answer; _guarded says why.
            raise ConnectionError(f"its agent's port gave up {waited:.1f} s into a wait of {timeout:.0f} s")
        raise GuestSilent(f"vm {self.name}: its guest's agent did not answer on its port within {timeout:.0f} s")

    async def adopt(self, qemu: proc.ProcessId, disks: list[tuple[str, str]], timeout: float = 30.0) -> None:
        """Take over a VM that an earlier handler process started (QEMU runs
        in its own session and outlived it): reconnect to its QMP socket and
        its agent's port, whose servers accept a new client once the old one
        is gone, and rebuild the disk table from (host device, serial) pairs
        (node and device names derive from the serial)."""
        self._adopted = qemu
        if not self.alive():
            raise VmError(f"vm {self.name}: {qemu} is not this VM's QEMU (gone, or its pid was reused)")
        self._exited = asyncio.create_task(self._watch(), name=f"vm-watch {self.name}")
        await self._monitor(self._guarded(self.qmp.connect(), "QMP reconnect"))
        await self.console.open()
        await self._guarded(self._agent_answers(timeout), "agent reconnect")
        plugged = await self._monitor(self._peripherals())
        # What was hot-plugged for its pod, as QEMU has it.
        devices = await self._monitor(self.qmp.execute("query-memory-devices"))
        # The DIMMs plugged for the pod (the guest root's virtio-pmem is a memory device too).
        self.plugged_mib = sum(int(d.get("data", {}).get("size", 0)) for d in devices or []
                               if d.get("type") == "dimm") // MIB
        # The bus the VM booted with, whatever this process's setting: its
        # next disks go where the guest looks for them.
        bus = "virtio-scsi" if SCSI_CONTROLLER in plugged else "virtio-blk"
        if bus != self.config.disk_bus:
            log.info("vm %s: booted with its disks on %s (this handler's setting: %s); they stay there",
                     self.name, bus, self.config.disk_bus)
            self.config = dataclasses.replace(self.config, disk_bus=bus)
        for host_device, serial in disks:
            disk = self._disk(serial, host_device, readonly=False)
            scsi = self._disk(serial, host_device, readonly=False, lun=0)
            if scsi.device_id in plugged:   # the VM's own bus, whatever this process's setting
                scsi.lun = await self._monitor(self.qmp.execute("qom-get", {
                    "path": f"/machine/peripheral/{scsi.device_id}", "property": "lun"}))
                self._next_lun = max(self._next_lun, scsi.lun + 1)
                disk = scsi
            self.disks[serial] = disk
        for tag in SHARE_TAGS:
            served = self._daemon(SharedDir(tag, Path(".")))
            if served.adopt():
                self.virtiofsds[tag] = served   # stopped with the VM, as if this process had started it
        log.info("vm %s: adopted (pid %d, %d disks)", self.name, qemu.pid, len(disks))

    async def status(self) -> str:
        return (await self.qmp.execute("query-status"))["status"]

    async def stop(self, timeout: float = stop_bound.POD_STOP) -> int | None:
        """Power off through the agent (it unmounts first); QMP quit, then
        SIGKILL, if the guest does not go. The agent's answer is waited for
        at most timeout (and never past the stop's deadline: a silent agent
        has QEMU killed at once), QEMU's exit after an answer at most
        POWER_OFF_EXIT: a guest that answers and stays up is ended too.
        Returns QEMU's exit code."""
        self.stopping = True
        # A connection that broke is opened again: PowerOff syncs and
        # unmounts the guest's file systems before it goes.
        client = await self.port.ready(wait=stop_bound.POWER_OFF_PORT_WAIT) if self.alive() else None
        answered = False
        if client is not None:
            try:
                with stop_bound.bounded(timeout):
                    answer = await client.call("PowerOff", agent_pb2.PowerOffRequest(), timeout=timeout)
                answered = True
                log.info("vm %s: powered off by its agent (%d unmounted, %d would not go)", self.name,
                         answer.unmounted, answer.failed)
            except (ttrpc.TtrpcError, ConnectionError) as exc:
                log.warning("vm %s: power-off through the agent's port failed: %s", self.name,
                            guest_text(str(exc)))
        for attempt, wait in (("wait", stop_bound.POWER_OFF_EXIT if answered else 0), ("quit", stop_bound.QEMU_QUIT)):
            if not self.alive():
                break
            if attempt == "quit":
                if answered:
                    log.warning("vm %s: its guest answered the power-off and did not go within %.0f s",
                                self.name, stop_bound.POWER_OFF_EXIT)
                try:
                    await self.qmp.execute("quit", timeout=stop_bound.QEMU_QUIT)
                except Exception as exc:  # noqa: BLE001 - any failure leads to SIGKILL
                    log.warning("vm %s: QMP quit failed: %s", self.name, exc)
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), wait)
            except asyncio.TimeoutError:
                pass
        if self.alive():
            await self.kill()
        await self._close_clients()
        return self._proc.returncode if self._proc else None

    async def kill_unresponsive(self, reason: str) -> None:
        """The guest's agent left a call of a stop unanswered: QEMU is
        killed, the reason kept (the pod's record names it)."""
        if not self.alive():
            return
        if self.unresponsive:
            # Another call found it silent first: its kill is under way.
            if self._exited is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self._exited), stop_bound.QEMU_KILL)
            return
        self.unresponsive = reason
        log.error("vm %s: %s; killing QEMU (pid %d)", self.name, reason, self.pid)
        await self.port.close(f"{reason}: QEMU was killed")
        await self.kill()

    async def kill(self) -> None:
        if self._proc is not None:
            if self._proc.returncode is None:
                try:
                    self._proc.kill()  # our child: its pid is its own until it is reaped
                except ProcessLookupError:
                    pass
        elif self._adopted is not None:
            proc.signal_if(self._adopted.pid, lambda: self.is_this_vm(self._adopted))
        if self._exited is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._exited), stop_bound.QEMU_KILL)
            except asyncio.TimeoutError:
                log.error("vm %s: QEMU pid %d survived SIGKILL", self.name, self.pid)
        await self._close_clients()

    async def _close_clients(self) -> None:
        await self.port.close()
        await self.qmp.close()
        await self.console.close()
        if not self.alive():
            await self._stop_virtiofsd()
        if self.socket_dir != self.workdir and not self.alive():
            self._remove_socket_dir()

    def _remove_socket_dir(self) -> None:
        """The short socket directory of a VM that is gone, and the root of
        such directories once it is empty (it is made again when needed)."""
        shares = [SharedDir(tag, Path(".")) for tag in SHARE_TAGS]
        for sock in (self.port_socket, self.qmp_socket, self.console_socket, *map(self.fs_socket, shares)):
            sock.unlink(missing_ok=True)
        for directory in (self.socket_dir, SHORT_SOCKET_ROOT):
            try:
                directory.rmdir()
            except OSError:
                return  # not empty (another VM's), or gone already

    # ------------------------------------------------- devices of a booted VM
