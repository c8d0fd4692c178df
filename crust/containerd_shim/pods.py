"""The Task service of a shim process: the pods it serves, each a
TaskService of its own (crust.containerd_shim.task).

`start` decides which pods share a process (crust.containerd_shim.options,
`shim_group`): one per pod, or every pod of a node's containerd namespace
and handler. containerd calls the same address for each of them; a call
goes to the pod whose container (the request's id) it names, a Create to
the pod its bundle's CRI annotation names (a sandbox's Create starts its
pod). A pod's service is let go once it holds no container; the process
ends when it serves no pod and containerd asked it to (Shutdown).

A shared process outlives its pods' churn, so its exit is guarded against
a `start` that just answered its address to containerd: `start` touches
the socket under the lock of the socket directory, and the process removes
its socket (under the same lock) only once the last touch was answered (a
Create or Connect came after it: containerd dials the address `start`
gave it at once and asks) or is START_GRACE_SECONDS old.

The process's own log goes to the `log` fifo of one of its pods' bundles
(containerd copies each task's fifo to its own log while the task lives):
the bundle of a pod that is deleted is left for another live pod's.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time
from pathlib import Path

from google.protobuf import empty_pb2

from crust.api import containerd_task_pb2 as task_pb
from crust.common import cri_annotations, ttrpc
from crust.common.ttrpc import TtrpcError
from crust.containerd_shim.events import Publisher
from crust.containerd_shim.task import VERSION, TaskService
from crust.containerd_shim.translate import bad, checked_create, is_sandbox, read_config

log = logging.getLogger(__name__)

# How long after a `start` answered its address the shared process stays
# for the containerd that asked: containerd connects at once.
START_GRACE_SECONDS = 10.0
LOCK_RETRY_SECONDS = 0.05
LOG_FIFO = "log"


class ShimLog:
    """Standard error (the process's log) on a live pod's `log` fifo."""

    def __init__(self, bundle: str = ""):
        self.bundle = bundle

    def follow(self, bundle: str) -> None:
        path = os.path.join(bundle, LOG_FIFO)
        try:
            # containerd holds the fifo's read end while the task lives;
            # opened for reading too, the open never blocks.
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        os.dup2(fd, 2)
        os.close(fd)
        self.bundle = bundle


class ShimPods:
    """containerd.task.v2.Task for the pods of one shim process."""

    def __init__(self, handler_endpoint: str, publisher: Publisher, socket_path: str = "", shared: bool = False,
                 on_empty=None, shim_log: ShimLog | None = None):
        self.handler_endpoint = handler_endpoint
        self.publisher = publisher
        self.socket_path = socket_path
        self.shared = shared
        self.pods: dict[str, TaskService] = {}   # sandbox id -> its service
        self.bundles: dict[str, str] = {}        # sandbox id -> the sandbox's bundle
        self.shim_log = shim_log or ShimLog()
        self._on_empty = on_empty
        self._leaving: asyncio.Task | None = None
        self._last_asked = 0.0   # wall-clock time of the last Create or Connect
        self._released = False   # a shared process's socket removed (another may be bound there since)

    def serving(self, container_id: str) -> TaskService:
        """The pod's service that holds this container (or sandbox)."""
        if not container_id:
            raise bad("id: the container id is empty")
        for pod in self.pods.values():
            if container_id in pod.containers:
                return pod
        raise TtrpcError(ttrpc.NOT_FOUND, f"container {container_id} is not served by this shim")

    def _forget_if_empty(self, sandbox_id: str) -> None:
        pod = self.pods.get(sandbox_id)
        if pod is None or pod.containers:
            return
        del self.pods[sandbox_id]
        bundle = self.bundles.pop(sandbox_id, "")
        asyncio.ensure_future(pod.close())
        if bundle and bundle == self.shim_log.bundle:
            for other in self.bundles.values():
                self.shim_log.follow(other)
                break

    # -- containerd's calls ---------------------------------------------------------------

    async def Create(self, request: task_pb.CreateTaskRequest, call) -> task_pb.CreateTaskResponse:
        self._last_asked = time.time()
        config = read_config(checked_create(request).bundle)
        if is_sandbox(config):
            pod = self.pods.get(request.id)
            if pod is None:
                pod = self.pods[request.id] = TaskService(self.handler_endpoint, self.publisher)
                self.bundles[request.id] = request.bundle
            try:
                return await pod.Create(request, call)
            finally:
                self._forget_if_empty(request.id)
                if request.id in self.pods and not self._log_alive():
                    self.shim_log.follow(request.bundle)
        wanted = cri_annotations.sandbox_id(config)
        pod = self.pods.get(wanted)
        if pod is None:
            raise TtrpcError(ttrpc.FAILED_PRECONDITION,
                             f"container {request.id} belongs to pod {wanted or '?'}, which this shim does not run")
        return await pod.Create(request, call)

    def _log_alive(self) -> bool:
        """Whether the log's fifo still has its pod (its bundle not deleted)."""
        bundle = self.shim_log.bundle
        return bool(bundle) and bundle in self.bundles.values() and os.path.exists(os.path.join(bundle, LOG_FIFO))

    async def Delete(self, request: task_pb.DeleteRequest, call) -> task_pb.DeleteResponse:
        pod = self.serving(request.id)
        try:
            return await pod.Delete(request, call)
        finally:
            self._forget_if_empty(pod.sandbox_id or "")

    async def Connect(self, request: task_pb.ConnectRequest, call) -> task_pb.ConnectResponse:
        self._last_asked = time.time()
        if not request.id:
            return task_pb.ConnectResponse(shim_pid=os.getpid(), version=VERSION)
        return await self.serving(request.id).Connect(request, call)

    async def Shutdown(self, request: task_pb.ShutdownRequest, call) -> empty_pb2.Empty:
        """The process ends once it serves no pod (a process of one pod
        also when asked `now`: a shared one never ends its other pods')."""
        if request.now and not self.shared:
            for pod in self.pods.values():
                await pod.close()
            self.pods.clear()
            self.bundles.clear()
        if not self.pods and self._leaving is None:
            self._leaving = asyncio.ensure_future(self._leave())
        return empty_pb2.Empty()

    # -- the calls about one container, answered by its pod's service ---------------------

    async def State(self, request, call):
        return await self.serving(request.id).State(request, call)

    async def Start(self, request, call):
        return await self.serving(request.id).Start(request, call)

    async def Pids(self, request, call):
        return await self.serving(request.id).Pids(request, call)

    async def Kill(self, request, call):
        return await self.serving(request.id).Kill(request, call)

    async def Exec(self, request, call):
        return await self.serving(request.id).Exec(request, call)

    async def ResizePty(self, request, call):
        return await self.serving(request.id).ResizePty(request, call)

    async def CloseIO(self, request, call):
        return await self.serving(request.id).CloseIO(request, call)

    async def Wait(self, request, call):
        return await self.serving(request.id).Wait(request, call)

    async def Stats(self, request, call):
        return await self.serving(request.id).Stats(request, call)

    async def Update(self, request, call):
        return await self.serving(request.id).Update(request, call)

    async def Pause(self, request, call):
        return await self.serving(request.id).Pause(request, call)

    async def Resume(self, request, call):
        return await self.serving(request.id).Resume(request, call)

    async def Checkpoint(self, request, call):
        return await self.serving(request.id).Checkpoint(request, call)

    # -- the process's end ----------------------------------------------------------------

    async def _leave(self) -> None:
        try:
            if self.shared and not await self._socket_released():
                return
            if self._on_empty is not None:
                self._on_empty()
        finally:
            self._leaving = None

    async def _socket_released(self) -> bool:
        """For a shared process: its socket removed under `start`'s lock
        once the last `start`'s touch was answered or is
        START_GRACE_SECONDS old, no pod having come; False when a pod came
        meanwhile (the process stays)."""
        path = Path(self.socket_path)
        while True:
            lock = await self._locked_directory()
            try:
                if self.pods:
                    return False
                try:
                    touched = os.stat(path).st_mtime
                except FileNotFoundError:
                    self._released = True
                    return True
                wait = touched + START_GRACE_SECONDS - time.time()
                if wait <= 0 or self._last_asked > touched:
                    self._unlink_socket()
                    return True
            finally:
                os.close(lock)
            await asyncio.sleep(min(wait, START_GRACE_SECONDS))

    async def release_socket(self) -> None:
        """A shared process that ends otherwise (SIGTERM) removes its
        socket under `start`'s lock, unless it released it already: while
        it still listens there, no `start` bound another at that path."""
        if not self.shared or self._released or not self.socket_path:
            return
        lock = await self._locked_directory()
        try:
            self._unlink_socket()
        finally:
            os.close(lock)

    def _unlink_socket(self) -> None:
        Path(self.socket_path).unlink(missing_ok=True)
        self._released = True
        log.info("shim socket released", extra={"fields": {"socket": self.socket_path}})

    async def _locked_directory(self) -> int:
        """The socket directory, opened and locked as `start` locks it (the
        caller closes it)."""
        lock = os.open(Path(self.socket_path).parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return lock
                except BlockingIOError:
                    await asyncio.sleep(LOCK_RETRY_SECONDS)
        except BaseException:
            os.close(lock)
            raise

    async def close(self) -> None:
        if self._leaving is not None:
            self._leaving.cancel()
        for pod in list(self.pods.values()):
            await pod.close()
        self.pods.clear()
        self.bundles.clear()
