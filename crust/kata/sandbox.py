"""A pod sandbox that is a microVM: the Sandbox interface on QEMU + the guest agent.

Volumes are hot-plugged as virtio-blk disks (a serial names each one, so the
guest finds it), mounted, measured and grown by the guest kernel; the host
kernel never parses the file system. The bundle's process runs in the guest,
seeing its volumes at their destinations.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shlex
from pathlib import Path

from crust.api import agent_pb2, csi_pb2
from crust.common import ttrpc
from crust.common.errors import (
    CrustError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from crust.common.private import make_dirs
from crust.kata import port_volumes
from crust.kata.agent import AgentError, AgentRefused
from crust.kata.agent_client import AgentClient, handler_error
from crust.kata.qemu import Vm, VmConfig, VmError, read_identity
from crust.runtime_handler.sandbox import Sandbox, VolumeStats
from crust.sys import proc

log = logging.getLogger(__name__)

Usage = csi_pb2.VolumeUsage
# The exec id of a sandbox's own process in the guest's agent (container "").
SANDBOX_PROCESS = "sandbox-process"
# How long a call about the process waits for the agent's port.
PORT_WAIT = 10.0
# How long a refused wait for the process pauses before it asks again.
WAIT_RETRY = 1.0


def serial_of(device: str) -> str:
    """A stable virtio serial for a host device (at most 20 characters)."""
    return "c" + hashlib.sha256(device.encode()).hexdigest()[:19]


class KataSandbox(Sandbox):
    def __init__(self, sandbox_id: str, workdir: Path, config: VmConfig, qemu: proc.ProcessId | None = None,
                 vm: Vm | None = None):
        """vm: one booted ahead for the pod (crust.kata.pool), whose
        directory is workdir now. Otherwise the VM's name and sockets are
        those its vm.json in workdir records (a pooled VM's are its own),
        if any: what an earlier handler process started is found by them."""
        self.id = sandbox_id
        self.workdir = workdir
        make_dirs(workdir)
        identity = read_identity(workdir) if vm is None else None
        if vm is not None:
            self.vm = vm
        elif identity is not None:
            self.vm = Vm(identity[0], workdir, config, socket_dir=identity[1])
        else:
            self.vm = Vm(f"crust-{sandbox_id}", workdir, config)
        # The QEMU an earlier handler process started (from the record).
        self._recorded = qemu
        self._process_pid = 0
        self._exit_code: int | None = None
        self._poller: asyncio.Task | None = None
        self._on_port = False   # the process was started by the guest's Python agent
        # Volumes the shell agent mounted (the Python agent was not up yet),
        # by mount point: what the Python agent takes over when connected.
        self._shell_mounted: dict[str, agent_pb2.Storage] = {}

    # -- errors: the guest's answers become CSI-style errors ---------------------------

    async def _agent(self, call):
        if not self.alive():
            raise Unavailable(f"sandbox {self.id}: its VM is not running")
        try:
            return await call
        except AgentRefused as exc:
            raise FailedPrecondition(f"sandbox {self.id}: the guest refused: {exc}") from None
        except AgentError as exc:
            raise Unavailable(f"sandbox {self.id}: the guest agent did not answer: {exc}") from None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.vm.pid or (self._recorded.pid if self._recorded is not None else 0)

    @property
    def identity(self) -> proc.ProcessId | None:
        return self.vm.identity or self._recorded

    def recognise(self, qemu: proc.ProcessId) -> bool:
        """That very process, running this VM's QEMU, and the pid QEMU
        itself wrote in the VM's work directory (-pidfile)."""
        try:
            written = int(self.vm.pidfile.read_text().strip() or 0)
        except (OSError, ValueError):
            return False
        return written == qemu.pid and self.vm.is_this_vm(qemu)

    def alive(self) -> bool:
        if self.vm.alive():
            return True
        # A VM started before a handler restart: alive while that very QEMU
        # runs (pid and start time; a reused pid is another process).
        return self._recorded is not None and self.vm.is_this_vm(self._recorded)

    async def start(self, saved: Path | None = None) -> None:
        """Boot the VM, or restore it from saved (crust.kata.template)."""
        try:
            seconds = await self.vm.start(saved=saved)
        except (VmError, AgentError, ConnectionError) as exc:
            # QEMU refused its arguments or exited, the guest did not boot
            # or its agent did not answer in time (a machine short of CPU or
            # memory): the pod's start may be retried, as kubelet does.
            raise Unavailable(f"sandbox {self.id}: its VM did not start: {exc}") from None
        log.info("vm up", extra={"fields": {"sandbox": self.id, "boot_s": round(seconds, 2), "pid": self.vm.pid,
                                           "restored": saved is not None}})

    async def adopt(self, devices: list[str], process_pid: int) -> None:
        try:
            if self._recorded is None:
                raise VmError("no QEMU process is recorded for it")
            await self.vm.adopt(self._recorded, [(d, serial_of(d)) for d in devices])
        except (VmError, AgentError) as exc:
            raise Unavailable(f"sandbox {self.id}: could not reconnect to its VM: {exc}") from None
        if process_pid:
            self._process_pid = process_pid
            client = await self.vm.port.ready(wait=PORT_WAIT)
            known = None
            if client is not None:
                try:
                    listed = await client.call("ListProcesses", agent_pb2.ListProcessesRequest(), timeout=30)
                    known = next((p for p in listed.processes if not p.container_id and
                                  p.exec_id == SANDBOX_PROCESS and p.pid == process_pid), None)
                except (ttrpc.TtrpcError, ConnectionError):
                    known = None
            self._on_port = known is not None
            self._poller = asyncio.create_task(self._wait_exit() if self._on_port else self._poll_exit())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.vm.alive():
            await self.vm.stop()
        elif self._recorded is not None:
            proc.signal_if(self._recorded.pid, lambda: self.vm.is_this_vm(self._recorded))
            await self.vm.stop_recorded_shares()

    # -- volumes -----------------------------------------------------------------------

    async def attach(self, device: str) -> str:
        serial = serial_of(device)
        if serial not in self.vm.disks:
            await self._agent(self.vm.attach_disk(device, serial))
        return serial

    async def open_encrypted(self, device: str, scheme: str, fs_type: str, passphrase: bytearray,
                             name: str, *, integrity: str = "", size_bytes: int = 0) -> str:
        """The guest opens it (luksFormat and mkfs first when blank) after
        checking its header is one crust made: the key goes over the VM's
        private port only."""
        if scheme != "luks2":
            raise FailedPrecondition(f"sandbox {self.id}: encryption {scheme!r} is not supported (luks2 is)")
        if not self.alive():
            raise Unavailable(f"sandbox {self.id}: its VM is not running")
        client = await self._encrypted_port(fs_type, integrity)
        if client is not None:
            answer = await port_volumes.open_encrypted(client, device, fs_type, name, passphrase,
                                                       integrity=integrity, size_bytes=size_bytes)
            formatted = answer.formatted
        else:
            formatted = await self._agent(self.vm.agent.luksopen(device, fs_type, name, passphrase,
                                                                 integrity=integrity, size_bytes=size_bytes))
        log.info("encrypted volume opened in the guest", extra={"fields": {
            "sandbox": self.id, "name": name, "formatted": formatted, "integrity": integrity or "none",
            "via": "agent port" if client is not None else "shell agent"}})
        return name

    async def _encrypted_port(self, fs_type: str = "", integrity: str = "") -> AgentClient | None:
        """The guest's Python agent when it is connected and opens encrypted
        volumes (a mapping the shell agent opened is the same to it: the
        kernel's table and the checked header copy at the same place)."""
        client = self.vm.port.current()
        if client is None or not port_volumes.serves_encrypted(self.vm.port, self.vm.config.disk_bus, fs_type,
                                                                integrity):
            return None
        return client

    async def close_encrypted(self, name: str) -> None:
        if not self.alive():
            return
        client = await self._encrypted_port()
        if client is not None:
            await port_volumes.close_encrypted(client, name)
        else:
            await self._agent(self.vm.agent.luksclose(name))

    async def _volume_port(self, mount_point: str = "", fs_type: str = "") -> AgentClient | None:
        """The guest's Python agent when its connection is open and it serves
        volumes on this VM's disk bus (and fs_type); None: the shell
        agent's way (the connection is then opened in the background). A
        VM just booted mounts its first volumes by the shell agent while
        its Python agent starts, rather than wait for it; once connected,
        the agent takes over such a volume (mount_point) before it serves a
        call about it."""
        port = self.vm.port
        client = port.current()
        if client is None or not port_volumes.serves(port, self.vm.config.disk_bus, fs_type):
            return None
        storage = self._shell_mounted.pop(mount_point, None)
        if storage is not None:
            try:
                await port_volumes.mount(client, storage)
            except CrustError as exc:
                log.warning("the guest's Python agent could not take over a volume; the shell agent serves it",
                            extra={"fields": {"sandbox": self.id, "volume": storage.volume_id, "error": exc.message}})
                return None
            log.info("volume mounted by the shell agent, now served via agent port", extra={"fields": {
                "sandbox": self.id, "volume": storage.volume_id}})
        return client

    async def volume_in_agent(self, mount_point: str, fs_type: str) -> str | None:
        """The id under which the guest's Python agent knows the volume
        mounted at mount_point (taken over from the shell agent first when
        that one mounted it); None when the agent does not serve it."""
        client = await self._volume_port(mount_point, fs_type)
        return None if client is None else port_volumes.volume_id(mount_point)

    async def mount(self, device, fs_type, options, readonly, mount_point, fs_group=None) -> None:
        opts = list(options) + (["nouuid"] if fs_type == "xfs" and "nouuid" not in options else [])
        if not self.alive():
            raise Unavailable(f"sandbox {self.id}: its VM is not running")
        storage = port_volumes.storage(device, fs_type, opts, readonly, mount_point, fs_group)
        client = await self._volume_port(fs_type=fs_type)
        if client is not None:
            answer = await port_volumes.mount(client, storage)
            log.info("volume mounted in the guest via agent port", extra={"fields": {
                "sandbox": self.id, "volume": storage.volume_id, "device": answer.device,
                "fs_group_walked": answer.fs_group_walked}})
            return
        await self._agent(self.vm.agent.mount(device, fs_type, opts, readonly, mount_point))
        if fs_group is not None:
            await self._agent(self.vm.agent.fsgroup(mount_point, *fs_group))
        storage.ClearField("fs_group")   # applied: a take-over leaves ownership as it is
        self._shell_mounted[mount_point] = storage

    async def bind_volume(self, mount_point: str, subpath: str, destination: str, readonly: bool) -> None:
        """The volume (or its subPath, opened below it by descriptors in the
        guest) bound at destination in the guest, by its Python agent."""
        volume_id = await self.volume_in_agent(mount_point, "")
        client = self.vm.port.current()
        if volume_id is None or client is None or not self.vm.port.has("process.guest"):
            await super().bind_volume(mount_point, subpath, destination, readonly)
            return
        try:
            await client.call("BindGuestPath", agent_pb2.BindGuestPathRequest(
                source=agent_pb2.Source(volume_id=volume_id, subpath=subpath, strict=True), target=destination,
                readonly=readonly), timeout=60)
        except ttrpc.TtrpcError as exc:
            if exc.code == ttrpc.FAILED_PRECONDITION and "subpath" in exc.message:
                exc = ttrpc.TtrpcError(ttrpc.INVALID_ARGUMENT, exc.message)   # a subPath refused, as checkpath said
            raise handler_error(exc, f"sandbox {self.id}: {destination}") from None

    async def bind(self, source: str, destination: str, readonly: bool) -> None:
        await self._agent(self.vm.agent.bind(source, destination, readonly))

    async def check_subpath(self, mount_point: str, subpath: str) -> None:
        try:
            await self._agent(self.vm.agent.checkpath(mount_point, subpath))
        except FailedPrecondition as exc:
            raise InvalidArgument(exc.message) from None

    async def stats(self, mount_point: str, readonly: bool) -> VolumeStats:
        if not self.alive():
            return VolumeStats([], csi_pb2.VolumeCondition(abnormal=True, message=f"the VM of sandbox {self.id} is gone"))
        try:
            client = await self._volume_port(mount_point)
            if client is not None:
                found = await port_volumes.stats(client, mount_point, readonly)
                if found is not None:
                    return found
            s = await self._agent(self.vm.agent.stats(mount_point))
        except (Unavailable, DeadlineExceeded) as exc:
            # QEMU runs but its guest does not answer (hung, overloaded):
            # a volume condition kubelet reports, not a failed call.
            message = exc.message if isinstance(exc, Unavailable) else \
                f"sandbox {self.id}: the guest agent did not answer: {exc.message}"
            return VolumeStats([], csi_pb2.VolumeCondition(abnormal=True, message=message))
        usage = [Usage(unit=Usage.BYTES, total=s["total"], available=s["avail"], used=s["total"] - s["free"]),
                 Usage(unit=Usage.INODES, total=s["inodes"], available=s["ifree"], used=s["inodes"] - s["ifree"])]
        condition = csi_pb2.VolumeCondition(abnormal=False, message="mounted and healthy in the guest")
        if s.get("mode") == "ro" and not readonly:
            condition = csi_pb2.VolumeCondition(abnormal=True, message="the file system went read-only in the guest")
        elif int(s.get("errors", 0) or 0) > 0:
            condition = csi_pb2.VolumeCondition(abnormal=True, message=f"the guest's ext4 reports {s['errors']} errors")
        return VolumeStats(usage, condition)

    async def grow(self, fs_type: str, device: str, mount_point: str, encrypted: str = "") -> None:
        # The host device already grew (the shim asked the backend); QEMU
        # tells the guest, then the guest grows its mounted file system.
        await self._agent(self.vm.resize_disk(serial_of(device)))
        # An encrypted volume's mapping grows first (no key needed: the
        # volume key is in the guest's dm table); a plain one is left be.
        luks = await self._encrypted_port()
        if luks is None:
            await self._agent(self.vm.agent.luksresize(mount_point))
        elif encrypted:
            await port_volumes.resize_encrypted(luks, encrypted)
        client = await self._volume_port(mount_point)
        if client is None or not await port_volumes.grow(client, mount_point):
            await self._agent(self.vm.agent.grow(mount_point))

    async def unmount(self, mount_point: str) -> None:
        if not self.alive():
            return
        shell_mounted = self._shell_mounted.pop(mount_point, None) is not None
        client = None if shell_mounted else await self._volume_port(mount_point)
        if client is None or not await port_volumes.unmount(client, mount_point):
            await self._agent(self.vm.agent.umount(mount_point))

    async def detach(self, device: str) -> None:
        if self.vm.alive() and serial_of(device) in self.vm.disks:
            await self._agent(self.vm.detach_disk(serial_of(device)))

    # -- the process ---------------------------------------------------------------------

    async def run_process(self, args, env, cwd, log_path: Path) -> int:
        # Output goes to the guest console (the VM's console.log in workdir).
        if not self.alive():
            raise Unavailable(f"sandbox {self.id}: its VM is not running")
        client = self.vm.port.current()
        if client is not None and self.vm.port.has("process.guest"):
            process = {"args": ["/bin/sh", "-c", 'mkdir -p "$0" && cd "$0" && exec "$@" >/dev/console 2>&1',
                                cwd, *args], "env": list(env), "cwd": "/"}
            try:
                self._process_pid = (await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                    exec_id=SANDBOX_PROCESS, process=json.dumps(process).encode()), timeout=60)).pid
            except ttrpc.TtrpcError as exc:
                raise handler_error(exc, f"sandbox {self.id}: its process") from None
            self._on_port = True
            self._poller = asyncio.create_task(self._wait_exit())
            return self._process_pid
        command = f"mkdir -p {shlex.quote(cwd)} && cd {shlex.quote(cwd)} && exec env -i " + \
            " ".join(shlex.quote(e) for e in env) + " " + " ".join(shlex.quote(a) for a in args)
        self._process_pid = await self._agent(self.vm.agent.exec(command))
        self._poller = asyncio.create_task(self._poll_exit())
        return self._process_pid

    async def _wait_exit(self) -> None:
        """The process's exit, pushed by the guest (a WaitProcess that waits
        there); a lost connection is waited out by a new one."""
        while self.vm.alive():
            client = await self.vm.port.ready(wait=PORT_WAIT)
            if client is None:
                await asyncio.sleep(PORT_WAIT)
                continue
            try:
                answer = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=SANDBOX_PROCESS))
            except ttrpc.TtrpcError as exc:
                if exc.code == ttrpc.NOT_FOUND:
                    return   # an agent that restarted no longer has it
                await asyncio.sleep(WAIT_RETRY)   # refusing (powering off): the VM's end comes
                continue
            except ConnectionError:
                continue
            self._exit_code = answer.exit_code
            return

    async def _poll_exit(self) -> None:
        while self.vm.alive():
            try:
                code = await self.vm.agent.wait(self._process_pid)
            except AgentError:
                return
            if code is not None:
                self._exit_code = code
                return
            await asyncio.sleep(0.2)

    def process_exit_code(self) -> int | None:
        return self._exit_code

    async def stop_process(self) -> None:
        if self._process_pid and self._exit_code is None and self.alive() and self._on_port:
            client = await self.vm.port.ready(wait=PORT_WAIT)
            if client is not None:
                try:
                    await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id=SANDBOX_PROCESS,
                                                                                      signal=9), timeout=30)
                except (ttrpc.TtrpcError, ConnectionError):
                    pass
            return
        if self._process_pid and self._exit_code is None and self.alive():
            try:
                await self.vm.agent.kill(self._process_pid)
            except AgentError:
                pass
