"""containerd's task service (containerd.task.v2.Task) for one pod, over the
microVM handler's PodRuntime (specs/handler.proto).

Every container of a pod goes to its pod's service (CRI groups them by the
sandbox id annotation; a shim process serves one pod or several:
crust.containerd_shim.pods). The sandbox container is the pod's VM: its
Create asks the handler for the pod (CreatePod), its pid is QEMU's, killing
it stops the pod.
Every other container has its root file system mounted by the shim at
<bundle>/rootfs on the host (containerd hands the snapshot's mounts to the
shim, as to runc's), then the handler makes the container (CreateContainer)
and runs its processes in the guest.

The shim keeps containerd's view of each process (created, running, stopped;
the exit status and time; the stdio fifos) and copies the handler's output
stream into the fifos. A process's exit is published (TaskExit) only after
its output was copied, so the container log is complete when CRI sees the
exit; a container the OOM killer struck is reported (TaskOOM) before its
exit, so CRI's reason is OOMKilled. A process's standard input (the stdin
fifo containerd made) is copied to the handler (WriteInput) until containerd
closes it; a terminal is the guest's (crust.kata.pod.container_spec). Stats are the
container's cgroup in the guest, as cgroup v2 metrics. Every task's pid
is QEMU's: a guest pid means nothing on the host and a host tool that
follows a task pid must find the pod's VM (Pids lists the guest pids).
The processes and the copies of their stdio are
crust.containerd_shim.process's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

from google.protobuf import empty_pb2

from google.protobuf import any_pb2

from crust.api import containerd_events_pb2 as events
from crust.api import containerd_task_pb2 as task_pb
from crust.api import containerd_task_types_pb2 as task_types
from crust.api import handler_pb2
from crust.common import cri_annotations, ttrpc
from crust.containerd_shim.events import Publisher, timestamp
from crust.containerd_shim.handler_client import HandlerClient
from crust.containerd_shim.options import configured_endpoint, keep_endpoint
from crust.containerd_shim.process import CREATED, RUNNING, STOPPED, Container, Process, copy_input, copy_output
from crust.containerd_shim.translate import (CGROUP_V2_METRICS_TYPE, bad, cgroup_metrics, checked_create,
                                             is_sandbox, process_spec, read_config)
from crust.common.ttrpc import TtrpcError
from crust.sys import mount as sysmount
from crust.sys import proc

log = logging.getLogger(__name__)

PROCESS_SPEC_TYPE = "types.containerd.io/opencontainers/runtime-spec/1/Process"
VERSION = "crust-shim-v2"
# The handler's calls that start or stop a VM take seconds under TCG.
HANDLER_TIMEOUT = 300.0
# How long a call waits for a handler that does not answer (restarting).
HANDLER_RESTART_SECONDS = 10.0
# The VM is gone, and the handler did not say how a process ended.
VM_GONE_STATUS = 128 + signal.SIGKILL


def handler_timeout(call, now: float) -> float:
    """The handler's deadline for a call made for containerd's call (its
    ttrpc timeout; HANDLER_TIMEOUT without one, and at most that)."""
    limit = getattr(call, "timeout", None)
    return min(HANDLER_TIMEOUT, limit) if limit else HANDLER_TIMEOUT


class TaskService:
    """The Task service of one pod (crust.containerd_shim.pods routes a
    shim process's calls to its pods' services)."""

    def __init__(self, handler_endpoint: str, publisher: Publisher):
        self.handler_endpoint = handler_endpoint
        self.publisher = publisher
        self.containers: dict[str, Container] = {}
        self.sandbox_id: str | None = None
        self.vm_pid = 0
        self._vm_watch: asyncio.Task | None = None
        self._client: HandlerClient | None = None
        self._lock = asyncio.Lock()

    # -- the handler ------------------------------------------------------------------

    @property
    def pods(self) -> HandlerClient:
        if self._client is None:
            self._client = HandlerClient(self.handler_endpoint)
        return self._client

    async def _handler(self, method: str, request, what: str, call=None):
        """One PodRuntime call, whose deadline is containerd's for the call
        that caused it (call: its ttrpc call; a CRI call's deadline reaches
        the shim as the ttrpc timeout), HANDLER_TIMEOUT at most: the handler
        bounds its calls to the guest by it. A handler that restarts is away
        for a moment (and the channel backs off after it saw it go):
        UNAVAILABLE is asked again for a while, which PodRuntime's
        idempotent calls allow. The handler's status is the answer's, with
        what was asked."""
        loop = asyncio.get_running_loop()
        timeout = handler_timeout(call, loop.time())
        give_up = loop.time() + HANDLER_RESTART_SECONDS
        delay = 0.1
        while True:
            try:
                return await self.pods.call(method, request, timeout=timeout)
            except TtrpcError as exc:
                if exc.code == ttrpc.UNAVAILABLE and loop.time() + delay < give_up:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    continue
                raise TtrpcError(exc.code, f"{what} ({method} at {self.handler_endpoint}): {exc.message}") from None

    def _configure(self, request: task_pb.CreateTaskRequest) -> None:
        """The handler the sandbox's runtime options name, if they name one:
        CRI-O hands its handler's runtime_config_path over only here, never
        to `start`. It is kept in the bundle for `delete`, as `start` keeps
        what containerd gave it."""
        if not request.HasField("options"):
            return
        endpoint = configured_endpoint(request.options.SerializeToString())
        if not endpoint:
            return
        if endpoint != self.handler_endpoint:
            if self._client is not None:
                asyncio.ensure_future(self._client.close())
                self._client = None
            log.info("handler named by the runtime options", extra={"fields": {"handler": endpoint}})
            self.handler_endpoint = endpoint
        try:
            keep_endpoint(Path(request.bundle), endpoint)
        except OSError as exc:
            log.warning("handler endpoint not kept in the bundle", extra={"fields": {"error": str(exc)}})

    async def close(self) -> None:
        for container in self.containers.values():
            for process in [container.init, *container.execs.values()]:
                if process.watcher is not None:
                    process.watcher.cancel()
        if self._vm_watch is not None:
            self._vm_watch.cancel()
        if self._client is not None:
            await self._client.close()

    # -- lookups ------------------------------------------------------------------------

    def container(self, container_id: str) -> Container:
        if not container_id:
            raise bad("id: the container id is empty")
        try:
            return self.containers[container_id]
        except KeyError:
            raise TtrpcError(ttrpc.NOT_FOUND, f"container {container_id} is not served by this shim") from None

    # -- Create / Start ---------------------------------------------------------------

    async def Create(self, request: task_pb.CreateTaskRequest, call) -> task_pb.CreateTaskResponse:
        checked_create(request)
        if request.checkpoint:
            raise TtrpcError(ttrpc.UNIMPLEMENTED, "checkpoint: restoring a checkpoint is not implemented")
        async with self._lock:
            if request.id in self.containers:
                raise TtrpcError(ttrpc.ALREADY_EXISTS, f"container {request.id} already exists")
            config = read_config(request.bundle)
            sandbox = is_sandbox(config)
            init = Process(request.id, "", request.stdin, request.stdout, request.stderr, request.terminal)
            container = Container(request.id, request.bundle, sandbox, init)
            if sandbox:
                if self.sandbox_id is not None:
                    raise TtrpcError(ttrpc.FAILED_PRECONDITION,
                                     f"this shim already serves pod {self.sandbox_id}; {request.id} is another sandbox")
                self._configure(request)
                response = await self._handler("CreatePod", handler_pb2.CreatePodRequest(
                    sandbox_id=request.id, bundle=request.bundle), f"pod {request.id}", call)
                self.sandbox_id, self.vm_pid = request.id, int(response.pid)
                self._vm_watch = asyncio.ensure_future(self._watch_vm(self.vm_pid))
            else:
                wanted = cri_annotations.sandbox_id(config)
                if self.sandbox_id is None or (wanted and wanted != self.sandbox_id):
                    raise TtrpcError(ttrpc.FAILED_PRECONDITION,
                                     f"container {request.id} belongs to pod {wanted or '?'}, "
                                     f"which this shim does not run")
                self._mount_rootfs(container, list(request.rootfs))
                try:
                    await self._handler("CreateContainer", handler_pb2.CreateContainerRequest(
                        sandbox_id=self.sandbox_id, container_id=request.id, bundle=request.bundle,
                        stdin=bool(request.stdin)), f"container {request.id}", call)
                except TtrpcError:
                    self._unmount_rootfs(container)
                    raise
            self.containers[request.id] = container
        log.info("task created", extra={"fields": {"container": request.id, "sandbox": sandbox, "pid": self.vm_pid}})
        self.publisher.publish(events.TaskCreate(
            container_id=request.id, bundle=request.bundle, rootfs=request.rootfs, pid=self.vm_pid,
            io=events.TaskIO(stdin=request.stdin, stdout=request.stdout, stderr=request.stderr)))
        return task_pb.CreateTaskResponse(pid=self.vm_pid)

    def _mount_rootfs(self, container: Container, mounts: list) -> None:
        if not mounts:
            return  # containerd left the bundle's rootfs as it is (ctr run --rootfs)
        target = os.path.join(container.bundle, "rootfs")
        os.makedirs(target, mode=0o711, exist_ok=True)
        try:
            for mount in mounts:
                sysmount.mount_path(mount.source, target, mount.type, list(mount.options))
                container.rootfs_mounted = True
        except OSError as exc:
            self._unmount_rootfs(container)
            raise TtrpcError(ttrpc.INTERNAL, f"rootfs of container {container.id}: {exc}") from None

    def _unmount_rootfs(self, container: Container) -> None:
        if container.rootfs_mounted:
            try:
                sysmount.unmount_all(os.path.join(container.bundle, "rootfs"))
                container.rootfs_mounted = False
            except OSError as exc:
                log.error("rootfs not unmounted", extra={"fields": {"container": container.id, "error": str(exc)}})

    async def Start(self, request: task_pb.StartRequest, call) -> task_pb.StartResponse:
        container = self.container(request.id)
        process = container.process(request.exec_id)
        if process.status != CREATED:
            raise TtrpcError(ttrpc.FAILED_PRECONDITION,
                             f"process {process.id} of container {container.id} was already started")
        if container.sandbox and not request.exec_id:
            process.status = RUNNING  # the VM runs since CreatePod
        else:
            response = await self._handler("StartProcess", handler_pb2.StartProcessRequest(
                container_id=container.id, exec_id=request.exec_id, process=process.spec),
                f"process {process.id} of container {container.id}", call)
            process.guest_pid = int(response.pid)
            if process.status == CREATED:
                process.status = RUNNING
            process.watcher = asyncio.ensure_future(self._watch_process(process))
            if process.stdin:
                process.feeder = asyncio.ensure_future(copy_input(process, self._write_input))
        log.info("process started", extra={"fields": {"container": container.id, "exec": request.exec_id,
                                                      "guest_pid": process.guest_pid}})
        if request.exec_id:
            self.publisher.publish(events.TaskExecStarted(container_id=container.id, exec_id=request.exec_id,
                                                          pid=self.vm_pid))
        else:
            self.publisher.publish(events.TaskStart(container_id=container.id, pid=self.vm_pid))
        return task_pb.StartResponse(pid=self.vm_pid)

    # -- exits --------------------------------------------------------------------------

    async def _watch_process(self, process: Process) -> None:
        """Copy the output, wait for the exit, publish it once the output is
        out: all of it, however long that takes (containerd's exec timeout
        bounds an exec). An exec whose output could not be copied whole
        exits with an error instead of its code (Wait)."""
        pump = asyncio.ensure_future(copy_output(lambda request: self.pods.read_output(request), process))
        state = None
        while state is None:
            try:
                state = await self.pods.call("GetProcess", handler_pb2.GetProcessRequest(
                    container_id=process.container_id, exec_id=process.exec_id, wait=True))
            except TtrpcError as exc:
                if exc.code == ttrpc.NOT_FOUND or process.status == STOPPED:
                    break  # gone from the handler (its pod was stopped)
                await asyncio.sleep(0.5)  # the handler restarts; ask again
        process.draining = pump
        try:
            cut = await pump
        except asyncio.CancelledError:
            if not process.drain_killed:
                raise
            cut = "its output was still being copied when it was killed"
        except Exception as exc:   # a failed copy is a cut output, never an exit left unreported
            log.exception("output copy failed", extra={"fields": {"container": process.container_id,
                                                                  "exec": process.exec_id}})
            cut = f"its output could not be copied: {exc}"
        if process.feeder is not None:
            process.feeder.cancel()
        by_itself = state is not None and state.status == handler_pb2.ProcessState.STOPPED and not state.reason
        if cut and by_itself:
            log.error("output cut", extra={"fields": {"container": process.container_id, "exec": process.exec_id,
                                                      "reason": cut}})
            process.output_cut = cut
        if state is not None and state.status == handler_pb2.ProcessState.STOPPED:
            if state.oom_killed:
                # Before the exit: containerd's CRI takes the reason from the
                # event it saw last; CRI-O, which takes no events, from a file
                # `oom` in the container's bundle.
                log.info("OOM killed", extra={"fields": {"container": process.container_id}})
                self.publisher.publish(events.TaskOOM(container_id=process.container_id))
                if not process.exec_id:
                    self._mark_oom(process.container_id)
            self._exited(process, state.exit_code, state.exited_at_ns or None)
        else:
            self._exited(process, VM_GONE_STATUS)

    async def _write_input(self, process: Process, offset: int, data: bytes, close: bool) -> int:
        response = await self._handler("WriteInput", handler_pb2.WriteInputRequest(
            container_id=process.container_id, exec_id=process.exec_id, offset=offset, data=data, close=close),
            f"stdin of {process.id}")
        return int(response.length)

    def _mark_oom(self, container_id: str) -> None:
        container = self.containers.get(container_id)
        if container is None:
            return
        try:
            fd = os.open(Path(container.bundle) / "oom", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            os.close(fd)
        except OSError as exc:
            log.warning("could not mark the bundle of an OOM-killed container",
                        extra={"fields": {"container": container_id, "error": str(exc)}})

    def _exited(self, process: Process, exit_status: int, exited_at_ns: int | None = None) -> None:
        if not process.stop(exit_status, exited_at_ns):
            return
        if process.exec_id:
            process.spec = None   # its args and env served its start only
            container = self.containers.get(process.container_id)
            if container is not None:
                container.bound_exited(process)
        log.info("process exited", extra={"fields": {"container": process.container_id, "exec": process.exec_id,
                                                     "exit_status": exit_status}})
        self.publisher.publish(events.TaskExit(container_id=process.container_id, id=process.id, pid=self.vm_pid,
                                               exit_status=exit_status,
                                               exited_at=timestamp(process.exited_at_ns)))

    async def _watch_vm(self, pid: int) -> None:
        """The pod's VM ending (stopped or killed) ends the sandbox task and,
        when the handler does not report them first, every process in it."""
        await proc.ended(proc.identify(pid))
        await asyncio.sleep(1.0)  # the handler's own reports of the processes come first
        sandbox = self.containers.get(self.sandbox_id or "")
        for container in list(self.containers.values()):
            for process in [container.init, *container.execs.values()]:
                if process.status == RUNNING and not (container.sandbox and process is container.init):
                    self._exited(process, VM_GONE_STATUS)
        if sandbox is not None and sandbox.init.status != STOPPED:
            log.warning("the pod's VM is gone", extra={"fields": {"sandbox": sandbox.id, "pid": pid}})
            self._exited(sandbox.init, VM_GONE_STATUS)

    # -- Wait / State / Pids ------------------------------------------------------------

    async def Wait(self, request: task_pb.WaitRequest, call) -> task_pb.WaitResponse:
        process = self.container(request.id).process(request.exec_id)
        await process.exited.wait()
        if process.output_cut and request.exec_id:
            # containerd's ExecSync fails with this rather than answer a
            # clean exit with a part of the output.
            raise TtrpcError(ttrpc.DATA_LOSS, f"exec {request.exec_id} of container {request.id} exited with "
                                              f"code {process.exit_status}, but {process.output_cut}")
        return task_pb.WaitResponse(exit_status=process.exit_status, exited_at=timestamp(process.exited_at_ns))

    async def State(self, request: task_pb.StateRequest, call) -> task_pb.StateResponse:
        container = self.container(request.id)
        process = container.process(request.exec_id)
        response = task_pb.StateResponse(
            id=container.id, bundle=container.bundle, pid=self.vm_pid, status=process.status,
            stdin=process.stdin, stdout=process.stdout, stderr=process.stderr, terminal=process.terminal,
            exit_status=process.exit_status, exec_id=request.exec_id)
        if process.status == STOPPED:
            response.exited_at.CopyFrom(timestamp(process.exited_at_ns))
        return response

    async def Pids(self, request: task_pb.PidsRequest, call) -> task_pb.PidsResponse:
        container = self.container(request.id)
        processes = [p for p in [container.init, *container.execs.values()] if p.status == RUNNING]
        pids = [self.vm_pid] if container.sandbox else [p.guest_pid for p in processes if p.guest_pid]
        return task_pb.PidsResponse(processes=[task_types.ProcessInfo(pid=pid) for pid in pids])

    # -- Kill / Delete ------------------------------------------------------------------

    async def Kill(self, request: task_pb.KillRequest, call) -> empty_pb2.Empty:
        container = self.container(request.id)
        process = container.process(request.exec_id)
        if not 0 <= request.signal < 65:
            raise bad(f"signal: {request.signal} is not a signal")
        if process.status == STOPPED:
            if request.signal in (signal.SIGTERM, signal.SIGKILL):
                # Stopping is idempotent (CRI's StopContainer): CRI-O, restarted,
                # waits on no task again, so it stops one that ended meanwhile.
                return empty_pb2.Empty()
            raise TtrpcError(ttrpc.NOT_FOUND, f"process {process.id} of container {container.id} already finished")
        if request.signal == 0:
            # kill(2)'s probe: is it there? (CRI-O asks before reopening a log.)
            return empty_pb2.Empty()
        if container.sandbox and not request.exec_id:
            # The sandbox's process is the VM: any signal that ends a pause
            # process ends the pod.
            await self._handler("DeletePod", handler_pb2.DeletePodRequest(sandbox_id=container.id),
                                f"pod {container.id}", call)
            self._exited(process, 128 + request.signal)
            return empty_pb2.Empty()
        if process.status == CREATED:
            # Never started: nothing runs in the guest; it ends here.
            self._exited(process, 128 + request.signal)
            return empty_pb2.Empty()
        if process.draining is not None and not process.draining.done():
            # It exited in the guest and its output is still on its way
            # (containerd's exec timeout ran out meanwhile): a kill ends the copy.
            if request.signal == signal.SIGKILL:
                process.drain_killed = True
                process.draining.cancel()
            return empty_pb2.Empty()
        await self._handler("SignalProcess", handler_pb2.SignalProcessRequest(
            container_id=container.id, exec_id=request.exec_id, signal=request.signal, all=request.all),
            f"process {process.id} of container {container.id}", call)
        return empty_pb2.Empty()

    async def Delete(self, request: task_pb.DeleteRequest, call) -> task_pb.DeleteResponse:
        container = self.container(request.id)
        process = container.process(request.exec_id)
        if process.status == RUNNING:
            raise TtrpcError(ttrpc.FAILED_PRECONDITION,
                             f"process {process.id} of container {container.id} is running; kill it first")
        process.deleted.set()
        if request.exec_id:
            # Forgotten here whatever the handler answers: containerd does
            # not ask again, and the handler forgets an exited exec nobody
            # deleted on its own.
            container.forget(process)
            await self._delete_in_handler(container, process)
        else:
            if container.execs and any(p.status == RUNNING for p in container.execs.values()):
                raise TtrpcError(ttrpc.FAILED_PRECONDITION, f"container {container.id} still has running execs")
            if container.sandbox:
                if any(not c.sandbox for c in self.containers.values()):
                    log.info("the pod is deleted before its containers", extra={"fields": {"sandbox": container.id}})
                await self._handler("DeletePod", handler_pb2.DeletePodRequest(sandbox_id=container.id),
                                    f"pod {container.id}", call)
                if self._vm_watch is not None:
                    self._vm_watch.cancel()
            else:
                try:
                    await self._handler("DeleteContainer", handler_pb2.DeleteContainerRequest(
                        container_id=container.id), f"container {container.id}", call)
                except TtrpcError as exc:
                    if exc.code != ttrpc.NOT_FOUND:  # a pod already gone took its containers along
                        raise
                self._unmount_rootfs(container)
            if process.status == CREATED:
                process.stop(0)
            if process.watcher is not None:
                process.watcher.cancel()
            self.containers.pop(container.id, None)
        stamp = timestamp(process.exited_at_ns or None)
        self.publisher.publish(events.TaskDelete(container_id=container.id, id=process.id, pid=self.vm_pid,
                                                 exit_status=process.exit_status, exited_at=stamp))
        log.info("deleted", extra={"fields": {"container": container.id, "exec": request.exec_id}})
        return task_pb.DeleteResponse(pid=self.vm_pid, exit_status=process.exit_status, exited_at=stamp)

    async def _delete_in_handler(self, container: Container, process: Process) -> None:
        try:
            await self._handler("DeleteProcess", handler_pb2.DeleteProcessRequest(
                container_id=container.id, exec_id=process.exec_id), f"exec {process.exec_id} of {container.id}")
        except TtrpcError as exc:
            # NOT_FOUND: never started there, or gone already (its pod
            # stopped, its container deleted).
            if exc.code != ttrpc.NOT_FOUND:
                log.warning("exec not deleted in the handler", extra={"fields": {
                    "container": container.id, "exec": process.exec_id, "error": exc.message}})

    # -- Exec ---------------------------------------------------------------------------

    async def Exec(self, request: task_pb.ExecProcessRequest, call) -> empty_pb2.Empty:
        container = self.container(request.id)
        if not request.exec_id:
            raise bad("exec_id: an exec needs an id")
        if request.exec_id in container.execs:
            raise TtrpcError(ttrpc.ALREADY_EXISTS, f"container {container.id} already has exec {request.exec_id}")
        if container.init.status != RUNNING or container.sandbox:
            raise TtrpcError(ttrpc.FAILED_PRECONDITION, f"container {container.id} is not running a process")
        if not request.spec.value:
            raise bad("spec: an exec needs its process spec")
        try:
            spec = json.loads(request.spec.value)
        except ValueError as exc:
            raise bad(f"spec: the process spec is not JSON ({request.spec.type_url}): {exc}") from None
        container.execs[request.exec_id] = Process(container.id, request.exec_id, request.stdin, request.stdout,
                                                   request.stderr, request.terminal,
                                                   spec=process_spec({**spec, "terminal": request.terminal},
                                                                     stdin=bool(request.stdin)))
        self.publisher.publish(events.TaskExecAdded(container_id=container.id, exec_id=request.exec_id))
        return empty_pb2.Empty()

    async def ResizePty(self, request: task_pb.ResizePtyRequest, call) -> empty_pb2.Empty:
        container = self.container(request.id)
        process = container.process(request.exec_id)
        # As runc's shim: a process without a terminal has nothing to resize.
        if process.terminal and process.status == RUNNING:
            await self._handler("ResizeTerminal", handler_pb2.ResizeTerminalRequest(
                container_id=container.id, exec_id=request.exec_id, width=request.width, height=request.height),
                f"terminal of {process.id}", call)
        return empty_pb2.Empty()

    async def CloseIO(self, request: task_pb.CloseIORequest, call) -> empty_pb2.Empty:
        process = self.container(request.id).process(request.exec_id)
        if request.stdin:
            process.input_closed.set()   # the copy ends once what the fifo holds is written
        return empty_pb2.Empty()

    # -- the shim itself ------------------------------------------------------------------

    async def Connect(self, request: task_pb.ConnectRequest, call) -> task_pb.ConnectResponse:
        if request.id:
            self.container(request.id)
        return task_pb.ConnectResponse(shim_pid=os.getpid(), task_pid=self.vm_pid, version=VERSION)

    # -- not offered ----------------------------------------------------------------------

    async def _unimplemented(self, what: str):
        raise TtrpcError(ttrpc.UNIMPLEMENTED, f"{what} is not implemented by crust's microVM runtime")

    async def Stats(self, request: task_pb.StatsRequest, call) -> task_pb.StatsResponse:
        container = self.container(request.id)
        numbers = await self._handler("ContainerStats", handler_pb2.ContainerStatsRequest(container_id=container.id),
                                      f"stats of {container.id}", call)
        return task_pb.StatsResponse(stats=any_pb2.Any(type_url=CGROUP_V2_METRICS_TYPE,
                                                       value=cgroup_metrics(numbers).SerializeToString()))

    async def Update(self, request, call):
        self.container(request.id)
        await self._unimplemented("Update (changing a running task's resources)")

    async def Pause(self, request, call):
        self.container(request.id)
        await self._unimplemented("Pause")

    async def Resume(self, request, call):
        self.container(request.id)
        await self._unimplemented("Resume")

    async def Checkpoint(self, request, call):
        self.container(request.id)
        await self._unimplemented("Checkpoint")
