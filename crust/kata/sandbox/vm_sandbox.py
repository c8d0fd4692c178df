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
from pathlib import Path

from crust.api import agent_pb2, csi_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc
from crust.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from crust.common.private import make_dirs
from crust.kata.agent import checked_numbers, volume_calls
from crust.kata.agent import stop_bound
from crust.kata.agent.client import AgentClient, handler_error
from crust.kata.vmm.qemu import Vm, VmConfig, VmError, read_identity
from crust.runtime_handler.sandbox import Sandbox, VolumeStats
from crust.sys import blockdev, proc

log = logging.getLogger(__name__)

Usage = csi_pb2.VolumeUsage
# The exec id of a sandbox's own process in the guest's agent (container "").
SANDBOX_PROCESS = "sandbox-process"
# How long a call about the process waits for the agent's port.
PORT_WAIT = 10.0
# How long a refused wait for the process pauses before it asks again.
WAIT_RETRY = 1.0


async def _device_bytes(device: str) -> int | None:
    """The size of the host's device a volume is attached from (None:
    unknown), which the guest's numbers of it are checked against."""
    if not device:
        return None
    try:
        return await asyncio.to_thread(blockdev.size_bytes, device)
    except OSError:
        return None


def serial_of(device: str) -> str:
    """A stable virtio serial for a host device (at most 20 characters)."""
    return "c" + hashlib.sha256(device.encode()).hexdigest()[:19]


class KataSandbox(Sandbox):
    def __init__(self, sandbox_id: str, workdir: Path, config: VmConfig, qemu: proc.ProcessId | None = None,
                 vm: Vm | None = None):
        """vm: one booted ahead for the pod (crust.kata.supply.pool), whose
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
        # Its cgroups' counters as last reported (checked by container stats).
        self.counters = checked_numbers.CounterFloors()

    # -- the guest's agent -------------------------------------------------------------

    async def _vm(self, call):
        """A VM operation (a disk plugged, grown, unplugged) on a running VM."""
        if not self.alive():
            call.close()
            raise Unavailable(f"sandbox {self.id}: its VM is not running")
        return await call

    async def port(self, wait: float = PORT_WAIT) -> AgentClient:
        """The connection to the guest's agent (a VM is ready once it
        answers; a broken connection is opened again, waited for up to
        wait); Unavailable when the VM or its agent does not answer."""
        if not self.alive():
            raise Unavailable(f"sandbox {self.id}: its VM is not running")
        client = await self.vm.port.ready(wait=stop_bound.remaining(wait))
        if client is None and stop_bound.in_stop() and self.vm.alive():
            # A stop always ends: an agent gone from its port answers nothing.
            await self.vm.kill_unresponsive(f"its guest's agent is not on its port "
                                            f"({self.vm.port.dead or 'not open'})")
        if client is None:
            raise Unavailable(f"sandbox {self.id}: its guest's agent is not connected "
                              f"({self.vm.port.dead or 'its port is not open'})")
        return client

    async def lost(self) -> bool:
        """After a failed call to the agent: whether the VM is gone, a kill
        for its agent's silence (crust.kata.agent.stop_bound) waited for."""
        if self.vm.unresponsive:
            await self.vm.kill_unresponsive(self.vm.unresponsive)
        return not self.alive()

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
        """Boot the VM, or restore it from saved (crust.kata.supply.template)."""
        try:
            seconds = await self.vm.start(saved=saved)
        except (VmError, ConnectionError) as exc:
            # QEMU refused its arguments or exited, the guest did not boot
            # or its agent did not answer in time (a machine short of CPU or
            # memory): the pod's start may be retried, as kubelet does.
            raise Unavailable(f"sandbox {self.id}: its VM did not start: {exc}") from None
        # QEMU's CPU time to here: the boot's (or restore's) work, which a
        # busy machine stretches in wall time but not in this.
        cpu = proc.cpu_seconds(self.vm.pid)
        log.info("vm up", extra={"fields": {"sandbox": self.id, "boot_s": round(seconds, 2), "pid": self.vm.pid,
                                           "cpu_s": round(cpu, 2) if cpu is not None else None,
                                           "restored": saved is not None}})

    async def adopt(self, devices: list[str], process_pid: int) -> None:
        try:
            if self._recorded is None:
                raise VmError("no QEMU process is recorded for it")
            await self.vm.adopt(self._recorded, [(d, serial_of(d)) for d in devices])
        except VmError as exc:
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
            if known is None:
                log.warning("the sandbox's process is not the guest agent's; its exit is not followed",
                            extra={"fields": {"sandbox": self.id, "pid": process_pid}})
            else:
                self._poller = asyncio.create_task(self._wait_exit())

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
            await self._vm(self.vm.attach_disk(device, serial))
        return serial

    async def open_encrypted(self, device: str, scheme: str, fs_type: str, passphrase: bytearray,
                             name: str, *, integrity: str = "", size_bytes: int = 0) -> str:
        """The guest opens it (luksFormat and mkfs first when blank) after
        checking its header is one crust made: the key goes over the VM's
        private port only."""
        if scheme != "luks2":
            raise FailedPrecondition(f"sandbox {self.id}: encryption {scheme!r} is not supported (luks2 is)")
        client = await self.port()
        if not volume_calls.serves_encrypted(self.vm.port, self.vm.config.disk_bus, fs_type, integrity):
            raise FailedPrecondition(f"sandbox {self.id}: its guest's agent does not open {fs_type} volumes "
                                     f"encrypted with {scheme}{' and ' + integrity if integrity else ''} on "
                                     f"{self.vm.config.disk_bus}")
        answer = await volume_calls.open_encrypted(client, device, fs_type, name, passphrase,
                                                   integrity=integrity, size_bytes=size_bytes)
        log.info("encrypted volume opened in the guest", extra={"fields": {
            "sandbox": self.id, "name": name, "formatted": answer.formatted, "integrity": integrity or "none"}})
        return name

    async def close_encrypted(self, name: str) -> None:
        if self.alive():
            try:
                await volume_calls.close_encrypted(await self.port(), name)
            except (Unavailable, DeadlineExceeded):
                if not await self.lost():
                    raise   # a VM killed meanwhile (its agent silent) has nothing open any more

    async def mount(self, device, fs_type, options, readonly, mount_point, fs_group=None) -> None:
        opts = list(options) + (["nouuid"] if fs_type == "xfs" and "nouuid" not in options else [])
        client = await self.port()
        if not volume_calls.serves(self.vm.port, self.vm.config.disk_bus, fs_type):
            raise FailedPrecondition(f"sandbox {self.id}: its guest's agent does not mount {fs_type} volumes on "
                                     f"{self.vm.config.disk_bus}")
        storage = volume_calls.storage(device, fs_type, opts, readonly, mount_point, fs_group)
        answer = await volume_calls.mount(client, storage)
        log.info("volume mounted in the guest", extra={"fields": {
            "sandbox": self.id, "volume": storage.volume_id, "device": answer.device,
            "fs_group_walked": answer.fs_group_walked}})

    async def bind_volume(self, mount_point: str, subpath: str, destination: str, readonly: bool) -> None:
        """The volume (or its subPath, opened below it by descriptors in the
        guest) bound at destination in the guest, by its agent."""
        client = await self.port()
        try:
            await client.call("BindGuestPath", agent_pb2.BindGuestPathRequest(
                source=agent_pb2.Source(volume_id=volume_calls.volume_id(mount_point), subpath=subpath,
                                        strict=True), target=destination, readonly=readonly), timeout=60)
        except ttrpc.TtrpcError as exc:
            if exc.code == ttrpc.FAILED_PRECONDITION and "subpath" in exc.message:
                exc = ttrpc.TtrpcError(ttrpc.INVALID_ARGUMENT, exc.message)   # a subPath that leaves its volume
            raise handler_error(exc, f"sandbox {self.id}: {destination}") from None

    async def bind(self, source: str, destination: str, readonly: bool) -> None:
        raise InvalidArgument(f"mount {destination}: {source} is a host path; a microVM sandbox's guest binds "
                              f"only its volumes (a pod's containers get host paths through its share)")

    async def check_subpath(self, mount_point: str, subpath: str) -> None:
        """Checked where it is bound: BindGuestPath opens it below the volume."""

    async def stats(self, mount_point: str, readonly: bool, device: str = "") -> VolumeStats:
        if not self.alive():
            return VolumeStats([], csi_pb2.VolumeCondition(abnormal=True, message=f"the VM of sandbox {self.id} is gone"))
        try:
            found = await volume_calls.stats(await self.port(wait=volume_calls.STATS_TIMEOUT), mount_point,
                                             readonly, await _device_bytes(device), f"pod {self.id}")
        except (Unavailable, DeadlineExceeded) as exc:
            # QEMU runs but its guest does not answer (hung, overloaded):
            # a volume condition kubelet reports, not a failed call.
            return VolumeStats([], csi_pb2.VolumeCondition(
                abnormal=True, message=f"sandbox {self.id}: the guest's agent did not answer: {exc.message}"))
        if found is None:
            return VolumeStats([], csi_pb2.VolumeCondition(
                abnormal=True, message=f"sandbox {self.id}: the guest's agent does not know the volume at "
                                       f"{mount_point} (not mounted)"))
        return found

    async def freeze(self, mount_point: str, timeout: int) -> int:
        # Applied and bounded in the guest: its agent thaws by itself after
        # the timeout, whatever becomes of the host.
        if not self.alive():
            raise FailedPrecondition(f"the VM of sandbox {self.id} is gone")
        client = await self.port(wait=volume_calls.FREEZE_TIMEOUT)
        if not self.vm.port.has(caps.VOLUME_FREEZE):
            raise FailedPrecondition(f"sandbox {self.id}: its guest's agent cannot freeze a file system "
                                     "(no volume.freeze capability)")
        depth = await volume_calls.freeze(client, mount_point, timeout)
        if depth is None:
            raise FailedPrecondition(f"sandbox {self.id}: the guest's agent does not know the volume at "
                                     f"{mount_point} (not mounted)")
        return depth

    async def thaw(self, mount_point: str) -> tuple[int, bool]:
        if not self.alive():
            return 0, False
        return await volume_calls.thaw(await self.port(wait=volume_calls.FREEZE_TIMEOUT), mount_point)

    async def grow(self, fs_type: str, device: str, mount_point: str, encrypted: str = "") -> None:
        # The host device already grew (the shim asked the backend); QEMU
        # tells the guest, then the guest grows its mounted file system.
        await self._vm(self.vm.resize_disk(serial_of(device)))
        client = await self.port()
        if encrypted:
            # The mapping grows first (no key needed: the volume key is in
            # the guest's dm table).
            await volume_calls.resize_encrypted(client, encrypted)
        if not await volume_calls.grow(client, mount_point):
            raise FailedPrecondition(f"sandbox {self.id}: the guest's agent does not know the volume at "
                                     f"{mount_point} (not mounted)")

    async def unmount(self, mount_point: str) -> None:
        if self.alive():
            try:
                await volume_calls.unmount(await self.port(), mount_point)
            except (Unavailable, DeadlineExceeded):
                if not await self.lost():
                    raise   # a VM killed meanwhile (its agent silent) has nothing mounted any more

    async def detach(self, device: str) -> None:
        if self.vm.alive() and serial_of(device) in self.vm.disks:
            await self._vm(self.vm.detach_disk(serial_of(device)))

    # -- the process ---------------------------------------------------------------------

    async def run_process(self, args, env, cwd, log_path: Path) -> int:
        # Output goes to the guest console (the VM's console.log in workdir).
        client = await self.port()
        process = {"args": ["/bin/sh", "-c", 'mkdir -p "$0" && cd "$0" && exec "$@" >/dev/console 2>&1',
                            cwd, *args], "env": list(env), "cwd": "/"}
        try:
            self._process_pid = (await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                exec_id=SANDBOX_PROCESS, process=json.dumps(process).encode()), timeout=60)).pid
        except ttrpc.TtrpcError as exc:
            raise handler_error(exc, f"sandbox {self.id}: its process") from None
        self._poller = asyncio.create_task(self._wait_exit())
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

    def process_exit_code(self) -> int | None:
        return self._exit_code

    async def stop_process(self) -> None:
        if self._process_pid and self._exit_code is None and self.alive():
            client = await self.vm.port.ready(wait=PORT_WAIT)
            if client is not None:
                try:
                    await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id=SANDBOX_PROCESS,
                                                                                      signal=9), timeout=30)
                except (ttrpc.TtrpcError, ConnectionError):
                    pass
