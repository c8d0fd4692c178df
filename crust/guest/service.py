"""AgentService (specs/agent.proto): each call checks its request, names
the field it refuses, and hands the work to the module of its concern."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import crust
from crust.api import agent_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc, ttrpc_server
from crust.guest import cgroups, guestbinds, guestconf, lifecycle, network, terminal
from crust.guest.containers import CONTAINERS_DIR, HOLDS_DIR, REMOVE_WAIT, Containers
from crust.guest.disks import Disks, check_disk
from crust.guest.errors import AgentError, check_id
from crust.guest.held_pipe import PipedBytes
from crust.guest.lifecycle import WARM_SPEC, Warmer
from crust.guest.luks import EncryptedVolumes
from crust.guest.oci import OciRuntime
from crust.guest.places import CATATONIT, RUN_DIR, Places
from crust.guest.process import (
    CREATED,
    EXITED,
    Limits,
    Process,
    ProcessTable,
    parse_process,
)
from crust.guest.uevents import DeviceEvents
from crust.guest.volumes import Volumes, wait_for
from crust.sys import guestpower

AGENT_NAME = "crust-agent"
# The most bytes one read answers: with its envelope, well under a frame.
MAX_READ_BYTES = 1 << 20
IMAGE_ID_FILE = "/etc/crust-image-id"

log = logging.getLogger(__name__)

# What this agent always serves; the rest depends on the guest (its OCI
# runtime, cgroups, kernel modules, tools).
CAPABILITIES = (caps.PROCESS_GUEST, caps.PROCESS_STDIN, caps.GUEST_SETTINGS, caps.SHARE_VIRTIOFS, caps.TMPFS_POD,
                caps.SUBPATH_BENEATH, caps.MIRROR_ATOMIC_WRITER, caps.NETWORK_INTERFACE, caps.RESUME)


def _memory_total() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _image_id() -> str:
    try:
        with open(IMAGE_ID_FILE) as f:
            return f.read().strip()
    except OSError:
        return ""


def _exit_message(process: Process) -> agent_pb2.WaitProcessResponse:
    status = process.exit
    return agent_pb2.WaitProcessResponse(
        exit_code=status.exit_code, signal=status.signal, exited_at_ns=status.exited_at_ns,
        output_complete=status.output_complete, stdout_length=process.stdout.length,
        stderr_length=process.stderr.length)


def encode_read(offset: int, data: bytes | PipedBytes, eof: bool) -> ttrpc.Encoded:
    """A ReadStreamResponse (specs/agent.proto: offset 1, data 2, eof 3),
    encoded around data without copying it (ttrpc.Encoded): bytes, or
    PipedBytes the port's writer splices in their place."""
    head = (b"\x08" + ttrpc.varint(offset) if offset else b"") + \
        (b"\x12" + ttrpc.varint(len(data)) if data else b"")
    return ttrpc.Encoded(tuple(piece for piece in (head, data, b"\x18\x01" if eof else b"") if piece))


def _stream_state(stream) -> agent_pb2.StreamState:
    length, held_from, ended = stream.state()
    return agent_pb2.StreamState(length=length, held_from=held_from, ended=ended)


def _exec_ids(request, own_process: str) -> None:
    """The ids of an exec: a container's (or "" for the guest) and a
    non-empty exec_id (the empty one is the container's own process)."""
    check_id("container_id", request.container_id, empty_ok=True)
    if request.exec_id == "":
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"exec_id: empty (a container's own process {own_process})")
    check_id("exec_id", request.exec_id)


class AgentService:
    def __init__(self, limits: Limits | None = None, runtime: OciRuntime | None = None,
                 volumes: Volumes | None = None, pod_cgroup: str = cgroups.POD_CGROUP,
                 containers_dir: str = CONTAINERS_DIR, holds_dir: str = HOLDS_DIR, run_dir: str = RUN_DIR,
                 pod_init: str = CATATONIT, warm_spec: str = WARM_SPEC):
        self.limits = limits or Limits()
        self.runtime = runtime or OciRuntime()
        self.processes = ProcessTable(self.limits)
        self.containers = Containers(self.processes, self.runtime, containers_dir, pod_cgroup, holds_dir)
        self.volumes = volumes or Volumes(Disks(DeviceEvents()))
        self.places = Places(self.volumes, run_dir, pod_init)
        self.encrypted = EncryptedVolumes(self.volumes, run_dir)
        self.warmer = Warmer(self.runtime, run_dir, warm_spec)
        self.server: ttrpc_server.Server | None = None   # set by the one that serves it
        self.power_off = guestpower.power_off
        self.in_guest = True   # false when served on a unix socket (tests on a host)
        self._creating: dict[str, asyncio.Lock] = {}
        self.pod_cgroup = pod_cgroup

    @property
    def capabilities(self) -> list[str]:
        runtime = [caps.PROCESS_EXEC, caps.PROCESS_TERMINAL, caps.CONTAINER_CREATE, caps.CONTAINER_OCI,
                   caps.CONTAINER_TERMINAL] if self.runtime.present else []
        if runtime and os.path.exists(self.places.pod_init):
            runtime.append(caps.CONTAINER_POD_PID)
        return [*CAPABILITIES, *runtime,
                *([caps.STATS_CGROUP2] if cgroups.available(self.pod_cgroup) else []), *self.volumes.capabilities,
                *self.encrypted.capabilities, *self.warmer.capabilities]

    async def close(self) -> None:
        await self.volumes.freezes.close()
        self.volumes.disks.events.close()
        await self.processes.close()
        await self.places.close()

    # ---------------------------------------------------------------- guest

    async def GetGuestDetails(self, request: agent_pb2.GuestDetailsRequest, call) -> agent_pb2.GuestDetailsResponse:
        return agent_pb2.GuestDetailsResponse(
            capabilities=self.capabilities, agent_name=AGENT_NAME, agent_version=crust.__version__,
            image_id=_image_id(), kernel_release=os.uname().release,
            uptime_ms=int(time.clock_gettime(time.CLOCK_BOOTTIME) * 1000),
            limits=agent_pb2.Limits(
                max_message_bytes=ttrpc.MESSAGE_LENGTH_MAX, max_read_bytes=MAX_READ_BYTES,
                stream_buffer_bytes=self.limits.stream_buffer_bytes,
                stdin_buffer_bytes=self.limits.stdin_buffer_bytes, max_in_flight=ttrpc.CONNECTION_CALLS_MAX,
                output_grace_ms=int(self.limits.output_grace * 1000),
                exited_execs_kept=self.limits.exited_execs_kept),
            cpus=len(os.sched_getaffinity(0)), memory_bytes=_memory_total())

    async def ConfigureInterface(self, request: agent_pb2.ConfigureInterfaceRequest,
                                 call) -> agent_pb2.ConfigureInterfaceResponse:
        return await network.configure(request, self.volumes.disks.events, wait_for(call))

    async def ConfigureGuest(self, request: agent_pb2.ConfigureGuestRequest,
                             call) -> agent_pb2.ConfigureGuestResponse:
        guestconf.configure(request.hostname, [(s.key, s.value) for s in request.sysctls])
        return agent_pb2.ConfigureGuestResponse()

    # ----------------------------------------------------------- containers

    def _runtime_needed(self) -> None:
        if not self.runtime.present:
            raise AgentError(ttrpc.UNIMPLEMENTED, f"container_id: the guest has no OCI runtime "
                                                 f"({self.runtime.binary}; capability {caps.CONTAINER_CREATE} absent)")

    async def CreateContainer(self, request: agent_pb2.CreateContainerRequest,
                              call) -> agent_pb2.CreateContainerResponse:
        check_id("container_id", request.container_id)
        self._runtime_needed()
        placed = bool(request.storages or request.binds or request.HasField("rootfs") or request.pod_pid_namespace)
        raw = request.SerializeToString()
        # One create of an id at a time: a retry waits, then finds it known.
        async with self._creating.setdefault(request.container_id, asyncio.Lock()):
            known = self.containers.known(request.container_id, raw, request.stdin)
            if known is not None:
                return agent_pb2.CreateContainerResponse(pid=(await known).pid)
            try:
                spec = await self.places.place(request, call) if placed else request.oci_spec
                process = await self.containers.create(request.container_id, raw, spec, request.stdin)
            except BaseException:
                if placed:
                    await self.places.remove(request.container_id)
                raise
            finally:
                self._creating.pop(request.container_id, None)
        return agent_pb2.CreateContainerResponse(pid=process.pid)

    async def StartContainer(self, request: agent_pb2.StartContainerRequest,
                             call) -> agent_pb2.StartContainerResponse:
        check_id("container_id", request.container_id)
        process = await self.containers.start(request.container_id)
        return agent_pb2.StartContainerResponse(pid=process.pid)

    async def RemoveContainer(self, request: agent_pb2.RemoveContainerRequest,
                              call) -> agent_pb2.RemoveContainerResponse:
        check_id("container_id", request.container_id)
        timeout = request.timeout_ms / 1000 if request.timeout_ms else (getattr(call, "timeout", None) or REMOVE_WAIT)
        unread = await self.containers.remove(request.container_id, timeout)
        try:
            await self.places.remove(request.container_id)
        except OSError as exc:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"container_id: its subpath binds: {exc}") from None
        return agent_pb2.RemoveContainerResponse(unread_bytes=unread)

    async def StatsContainer(self, request: agent_pb2.StatsContainerRequest,
                             call) -> agent_pb2.StatsContainerResponse:
        return cgroups.stats(request.container_id, self.pod_cgroup)

    # ------------------------------------------------------------ processes

    def _process(self, request) -> Process:
        check_id("container_id", request.container_id, empty_ok=True)
        check_id("exec_id", request.exec_id, empty_ok=True)
        return self.processes.get(request.container_id, request.exec_id)

    async def ExecProcess(self, request: agent_pb2.ExecProcessRequest, call) -> agent_pb2.ExecProcessResponse:
        _exec_ids(request, "starts with StartContainer")
        spec = parse_process(request.process)
        if request.container_id:
            if not self.runtime.present:
                raise AgentError(ttrpc.UNIMPLEMENTED, f"container_id: the guest has no OCI runtime "
                                                     f"({self.runtime.binary}; capability {caps.PROCESS_EXEC} absent)")
            process = await self.processes.start_container_exec(self.runtime, request.container_id,
                                                                request.exec_id, request.process, spec, request.stdin)
            return agent_pb2.ExecProcessResponse(pid=process.pid)
        process = await self.processes.start_guest_process(request.exec_id, request.process, spec, request.stdin)
        return agent_pb2.ExecProcessResponse(pid=process.pid)

    async def WaitProcess(self, request: agent_pb2.WaitProcessRequest, call) -> agent_pb2.WaitProcessResponse:
        process = self._process(request)
        await process.done.wait()
        return _exit_message(process)

    async def _read(self, request: agent_pb2.ReadStreamRequest, stream_name: str) -> ttrpc.Encoded:
        if request.max_bytes == 0:
            raise AgentError(ttrpc.INVALID_ARGUMENT, "max_bytes: 0 (at least 1 is needed)")
        process = self._process(request)
        stream = getattr(process, stream_name)
        # In the guest the answer's bytes may stay in a pipe: the port's
        # writer splices them (crust.guest.held_pipe).
        offset, data, eof = await stream.read(request.offset, min(request.max_bytes, MAX_READ_BYTES),
                                              request.accept_loss, piped=self.in_guest)
        return encode_read(offset, data, eof)

    async def ReadStdout(self, request, call) -> ttrpc.Encoded:
        return await self._read(request, "stdout")

    async def ReadStderr(self, request, call) -> ttrpc.Encoded:
        return await self._read(request, "stderr")

    async def WriteStdin(self, request: agent_pb2.WriteStreamRequest, call) -> agent_pb2.WriteStreamResponse:
        process = self._process(request)
        if process.stdin is None:
            raise AgentError(ttrpc.FAILED_PRECONDITION, "exec_id: the process was started without stdin")
        length, gone = await process.stdin.write(request.offset, request.data)
        return agent_pb2.WriteStreamResponse(length=length, reader_gone=gone)

    async def CloseStdin(self, request: agent_pb2.CloseStdinRequest, call) -> agent_pb2.CloseStdinResponse:
        process = self._process(request)
        if process.stdin is None:
            raise AgentError(ttrpc.FAILED_PRECONDITION, "exec_id: the process was started without stdin")
        process.stdin.close()
        return agent_pb2.CloseStdinResponse()

    async def TtyWinResize(self, request: agent_pb2.TtyWinResizeRequest, call) -> agent_pb2.TtyWinResizeResponse:
        terminal.check_size(request.columns, request.rows)
        process = self._process(request)
        if process.terminal is None:
            raise AgentError(ttrpc.FAILED_PRECONDITION, "exec_id: the process runs on no terminal (any more)")
        terminal.resize(process.terminal, request.columns, request.rows)
        return agent_pb2.TtyWinResizeResponse()

    async def SignalProcess(self, request: agent_pb2.SignalProcessRequest, call) -> agent_pb2.SignalProcessResponse:
        if request.signal > 64:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"signal: {request.signal} is not 0..64")
        if request.all and not request.container_id:
            raise AgentError(ttrpc.INVALID_ARGUMENT, "all: a guest process has no container to signal")
        if request.all:
            check_id("container_id", request.container_id)
            own = self.processes.processes.get((request.container_id, ""))
            signalled = own.signal(request.signal) if own is not None and own.state == CREATED else 0
            return agent_pb2.SignalProcessResponse(signalled=signalled + await asyncio.to_thread(
                cgroups.signal_all, request.container_id, request.signal, self.pod_cgroup))
        process = self._process(request)
        return agent_pb2.SignalProcessResponse(signalled=process.signal(request.signal))

    async def RemoveProcess(self, request: agent_pb2.RemoveProcessRequest, call) -> agent_pb2.RemoveProcessResponse:
        _exec_ids(request, "goes with RemoveContainer")
        return agent_pb2.RemoveProcessResponse(unread_bytes=self.processes.remove(request.container_id,
                                                                                 request.exec_id))

    async def ListProcesses(self, request, call) -> agent_pb2.ListProcessesResponse:
        infos = []
        for process in self.processes.processes.values():
            info = agent_pb2.ProcessInfo(
                container_id=process.container_id, exec_id=process.exec_id, pid=process.pid,
                state=process.state, stdout=_stream_state(process.stdout), stderr=_stream_state(process.stderr),
                stdin=process.stdin is not None)
            if process.state == EXITED:
                info.exit.CopyFrom(_exit_message(process))
            infos.append(info)
        return agent_pb2.ListProcessesResponse(processes=infos)

    # ------------------------------------------------------ the guest's life

    async def Resume(self, request: agent_pb2.ResumeRequest, call) -> agent_pb2.ResumeResponse:
        return lifecycle.resume(request)

    async def Warm(self, request: agent_pb2.WarmRequest, call) -> agent_pb2.WarmResponse:
        return await self.warmer.warm()

    async def PowerOff(self, request: agent_pb2.PowerOffRequest, call) -> agent_pb2.PowerOffResponse:
        if not self.in_guest:
            # Served on a unix socket (tests on a host): killing every
            # process and unmounting would be the host's.
            raise AgentError(ttrpc.FAILED_PRECONDITION, "PowerOff: this agent serves no guest of its own (it "
                                                       "listens on a unix socket)")
        if self.server is not None:
            self.server.refusing = (ttrpc.UNAVAILABLE, "the guest is powering off")
        # A frozen file system would hang the sync before the power-off.
        await self.volumes.freezes.close("powering off")
        answer = await asyncio.to_thread(lifecycle.stop_everything)
        log.info("powering off: %d file systems unmounted, %d would not go", answer.unmounted, answer.failed)
        call.after_reply = self._power_off
        return answer

    def _power_off(self) -> None:
        try:
            self.power_off()
        except OSError as exc:
            log.error("the power-off failed: %s", exc)

    # -------------------------------------------------------------- volumes

    async def MountVolume(self, request: agent_pb2.MountVolumeRequest, call) -> agent_pb2.MountVolumeResponse:
        return await self.volumes.mount(request.storage, call)

    async def VolumeStats(self, request: agent_pb2.VolumeStatsRequest, call) -> agent_pb2.VolumeStatsResponse:
        return await asyncio.to_thread(self.volumes.stats, request.volume_id)

    async def GrowVolume(self, request: agent_pb2.GrowVolumeRequest, call) -> agent_pb2.GrowVolumeResponse:
        return await self.volumes.grow(request.volume_id)

    async def UnmountVolume(self, request: agent_pb2.UnmountVolumeRequest, call) -> agent_pb2.UnmountVolumeResponse:
        return await self.volumes.unmount(request.volume_id)

    async def FreezeVolume(self, request: agent_pb2.FreezeVolumeRequest, call) -> agent_pb2.FreezeVolumeResponse:
        return await self.volumes.freeze(request.volume_id, request.timeout_seconds)

    async def ThawVolume(self, request: agent_pb2.ThawVolumeRequest, call) -> agent_pb2.ThawVolumeResponse:
        return await self.volumes.thaw(request.volume_id)

    # ------------------------------------------- encrypted volumes (LUKS2)

    async def OpenEncrypted(self, request: agent_pb2.OpenEncryptedRequest, call) -> agent_pb2.OpenEncryptedResponse:
        return await self.encrypted.open(request, call)

    async def ResizeEncrypted(self, request: agent_pb2.ResizeEncryptedRequest,
                              call) -> agent_pb2.ResizeEncryptedResponse:
        return await self.encrypted.resize(request.name)

    async def CloseEncrypted(self, request: agent_pb2.CloseEncryptedRequest,
                             call) -> agent_pb2.CloseEncryptedResponse:
        return await self.encrypted.close(request.name)

    # ---------------------------------------------------- shares and tmpfs

    async def MountShare(self, request: agent_pb2.MountShareRequest, call) -> agent_pb2.MountShareResponse:
        return agent_pb2.MountShareResponse(mount_point=await self.places.mount_share(request.tag, call))

    async def MountPodTmpfs(self, request: agent_pb2.MountPodTmpfsRequest,
                            call) -> agent_pb2.MountPodTmpfsResponse:
        point, size = await asyncio.to_thread(self.places.mount_pod_tmpfs, request.name, request.size_bytes)
        return agent_pb2.MountPodTmpfsResponse(mount_point=point, size_bytes=size)

    async def StartMirror(self, request: agent_pb2.StartMirrorRequest, call) -> agent_pb2.StartMirrorResponse:
        return agent_pb2.StartMirrorResponse(mount_point=await self.places.start_mirror(request))

    async def BindGuestPath(self, request: agent_pb2.BindGuestPathRequest,
                            call) -> agent_pb2.BindGuestPathResponse:
        await asyncio.to_thread(guestbinds.bind, self.places, request)
        return agent_pb2.BindGuestPathResponse()

    async def UnbindGuestPath(self, request: agent_pb2.UnbindGuestPathRequest,
                              call) -> agent_pb2.UnbindGuestPathResponse:
        await asyncio.to_thread(guestbinds.unbind, request.target)
        return agent_pb2.UnbindGuestPathResponse()

    async def StopMirror(self, request: agent_pb2.StopMirrorRequest, call) -> agent_pb2.StopMirrorResponse:
        await self.places.stop_mirror(request.name)
        return agent_pb2.StopMirrorResponse()

    async def WaitDiskRemoved(self, request: agent_pb2.WaitDiskRemovedRequest,
                              call) -> agent_pb2.WaitDiskRemovedResponse:
        check_disk("disk", request.disk)
        await self.volumes.disks.wait_gone("disk", request.disk, wait_for(call))
        return agent_pb2.WaitDiskRemovedResponse()
