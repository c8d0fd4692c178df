"""The containerd shim's services over ttrpc without a pod: the task
service's status codes (containerd's error codes), the stdio fifos, the
`start` bench and `delete`'s clean-up of a dead shim's socket, and an exec's
exit that waits for its whole output."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest
from google.protobuf import empty_pb2

from crust.api import handler_pb2
from crust.api import containerd_task_pb2 as task_pb
from crust.common import ttrpc
from crust.containerd_shim.events import Publisher
from crust.containerd_shim.task import TaskService
from crust.common.ttrpc import TtrpcError
from crust.common.ttrpc_client import Client
from crust.common.ttrpc_server import Server
from tests.harness.ttrpc import TASK
from tests.harness.ttrpc import sock  # noqa: F401 - a fixture


# -- the task service's answers without a pod --------------------------------------------------


async def test_task_service_status_codes(sock, tmp_path, monkeypatch):
    """Unknown ids are NOT_FOUND, bad input INVALID_ARGUMENT, what crust
    does not offer UNIMPLEMENTED: the codes containerd's errdefs map; a pod
    whose Create failed is let go, and Shutdown with no pod ends the shim."""
    from crust.containerd_shim import task
    from crust.containerd_shim.pods import ShimPods

    monkeypatch.setattr(task, "HANDLER_RESTART_SECONDS", 0.5)  # no handler ever comes here
    ended = asyncio.Event()
    service = ShimPods("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"), on_empty=ended.set)
    server = Server()
    server.register_service(task_pb.DESCRIPTOR.services_by_name["Task"], service)
    await server.serve_path(sock)
    client = await Client.connect(sock)

    async def code(method, request, response_type=empty_pb2.Empty):
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, method, request, response_type, timeout=5)
        return caught.value.code

    try:
        for method, request, response in [("State", task_pb.StateRequest(id="nope"), task_pb.StateResponse),
                                          ("Start", task_pb.StartRequest(id="nope"), task_pb.StartResponse),
                                          ("Wait", task_pb.WaitRequest(id="nope"), task_pb.WaitResponse),
                                          ("Delete", task_pb.DeleteRequest(id="nope"), task_pb.DeleteResponse),
                                          ("Kill", task_pb.KillRequest(id="nope", signal=9), empty_pb2.Empty),
                                          ("Pids", task_pb.PidsRequest(id="nope"), task_pb.PidsResponse),
                                          ("CloseIO", task_pb.CloseIORequest(id="nope"), empty_pb2.Empty),
                                          ("Connect", task_pb.ConnectRequest(id="nope"), task_pb.ConnectResponse)]:
            assert await code(method, request, response) == ttrpc.NOT_FOUND, method
        assert await code("State", task_pb.StateRequest(id=""), task_pb.StateResponse) == ttrpc.INVALID_ARGUMENT
        assert await code("Create", task_pb.CreateTaskRequest(id="c", bundle="relative"),
                          task_pb.CreateTaskResponse) == ttrpc.INVALID_ARGUMENT
        assert await code("Create", task_pb.CreateTaskRequest(id="c", bundle=str(tmp_path)),
                          task_pb.CreateTaskResponse) == ttrpc.INVALID_ARGUMENT  # no config.json
        (tmp_path / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "pod-x"}}))
        # A container of a pod this shim does not run.
        assert await code("Create", task_pb.CreateTaskRequest(id="c", bundle=str(tmp_path)),
                          task_pb.CreateTaskResponse) == ttrpc.FAILED_PRECONDITION
        (tmp_path / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": "pod-x"}}))
        # The handler is not there: UNAVAILABLE, and no task is left.
        assert await code("Create", task_pb.CreateTaskRequest(id="pod-x", bundle=str(tmp_path)),
                          task_pb.CreateTaskResponse) == ttrpc.UNAVAILABLE
        assert await code("State", task_pb.StateRequest(id="pod-x"), task_pb.StateResponse) == ttrpc.NOT_FOUND
        assert service.pods == {} and service.bundles == {}
        for method, request in [("Stats", task_pb.StatsRequest(id="x")), ("Update", task_pb.UpdateTaskRequest(id="x")),
                                ("Pause", task_pb.PauseRequest(id="x")), ("Resume", task_pb.ResumeRequest(id="x")),
                                ("Checkpoint", task_pb.CheckpointTaskRequest(id="x"))]:
            assert await code(method, request) in (ttrpc.UNIMPLEMENTED, ttrpc.NOT_FOUND), method
        # With no task, Shutdown ends the shim.
        assert not ended.is_set()
        await client.call(TASK, "Shutdown", task_pb.ShutdownRequest(id="x"), empty_pb2.Empty, timeout=5)
        await asyncio.wait_for(ended.wait(), 5)
    finally:
        await client.close()
        await server.close()
        await service.close()


async def test_a_shared_shim_ends_only_once_no_start_touched_its_socket(tmp_path, monkeypatch):
    """A shim shared by a node's pods, with no pod left and asked to shut
    down: it stays while a `start` touched its socket within the grace and
    containerd has not asked anything since (it is about to connect), and
    while a `start` holds the socket directory's lock; it stays for good
    when a pod came meanwhile; otherwise it removes its socket and ends,
    at once when the last touch was answered. Ended otherwise, it removes
    its socket unless it released it already."""
    import fcntl

    from crust.containerd_shim import pods as shim_pods
    from crust.containerd_shim.pods import ShimPods

    monkeypatch.setattr(shim_pods, "START_GRACE_SECONDS", 1.0)
    path = tmp_path / "shim.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    ended = asyncio.Event()
    service = ShimPods("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"), socket_path=str(path),
                       shared=True, on_empty=ended.set)
    try:
        await service.Shutdown(task_pb.ShutdownRequest(id="gone"), None)
        await asyncio.sleep(0.6)
        os.utime(path)  # a start answered this address
        await asyncio.sleep(0.7)
        assert not ended.is_set() and path.is_socket()   # 1.3 s after the bind, 0.7 after the start
        await asyncio.wait_for(ended.wait(), 3)
        assert not path.exists()

        def bind():
            made = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            made.bind(str(path))
            made.listen(4)
            return made

        listener.close()
        listener = bind()
        ended.clear()
        await service.Connect(task_pb.ConnectRequest(), None)   # the start's containerd asked
        await service.Shutdown(task_pb.ShutdownRequest(id="gone"), None)
        await asyncio.wait_for(ended.wait(), 0.5)
        assert not path.exists()

        listener.close()
        listener = bind()
        ended.clear()
        await service.Shutdown(task_pb.ShutdownRequest(id="gone"), None)
        service.pods["pod-new"] = TaskService(service.handler_endpoint, service.publisher)  # its Create came
        await asyncio.sleep(1.5)
        assert not ended.is_set() and path.is_socket() and service._leaving is None
        del service.pods["pod-new"]

        os.utime(path, (time.time() - 5, time.time() - 5))
        lock = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)   # a start checks and binds under it
            await service.Shutdown(task_pb.ShutdownRequest(id="gone"), None)
            await asyncio.sleep(0.5)
            assert not ended.is_set() and path.is_socket()
        finally:
            os.close(lock)
        await asyncio.wait_for(ended.wait(), 3)
        assert not path.exists()

        # Ending after all (SIGTERM): the socket it released is another
        # shim's now and stays; one that never released its own removes it.
        listener.close()
        listener = bind()
        await service.release_socket()
        assert path.is_socket()
        other = ShimPods(service.handler_endpoint, service.publisher, socket_path=str(path), shared=True)
        await other.release_socket()
        assert not path.exists()
    finally:
        listener.close()
        await service.close()


# -- the shim's stdio fifos (real fifos) ---------------------------------------------------------


async def test_a_finished_fifo_keeps_its_last_words_until_a_reader_comes(tmp_path):
    """Output written while nobody reads (containerd away) stays in the pipe;
    the shim closes its end only once a reader is back, who then reads it
    all and an end of file."""
    import errno
    import os

    from crust.containerd_shim.stdio import open_fifo

    path = tmp_path / "stdout"
    os.mkfifo(path)
    writer = open_fifo(str(path))  # no reader: the open does not block
    await writer.write(b"last words\n")
    deleted = asyncio.Event()
    closing = asyncio.ensure_future(writer.close_once_read(deleted, bound=30, interval=0.05))
    await asyncio.sleep(0.5)
    assert not closing.done(), "closed with nobody reading: the bytes would be lost"
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        await asyncio.wait_for(closing, 5)
        assert os.read(reader, 100) == b"last words\n"
        assert os.read(reader, 100) == b""  # the shim's end is closed: end of file
    finally:
        os.close(reader)
    # A deleted process's fifo is let go at once, reader or not.
    second = open_fifo(str(path))
    deleted.set()
    await asyncio.wait_for(second.close_once_read(deleted, bound=30), 5)
    assert second.fd is None
    with pytest.raises(OSError) as caught:
        os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    assert caught.value.errno == errno.ENXIO  # nobody holds it any more
    assert open_fifo("") is None


# -- the shim's `start` and `delete` ---------------------------------------------------------------


def test_the_shim_start_bench_times_start_for_a_running_pod_and_leaves_nothing(tmp_path):
    """bench/microvm/shim_start.py: each round's `start` answers the address of the
    pod shim the bench made to listen (no daemon is started), and the bench
    removes that socket with its bundle."""
    from tests.harness.bench_run import run_bench
    from tests.harness.cri import processes_naming

    results = run_bench("bench/microvm/shim_start.py", "--rounds", "2", out=tmp_path / "start.json")["results"]
    (timed,) = results.values()
    assert timed["wall_ms"]["n"] == 2 and timed["cpu_ms"]["n"] == 2 and 0 < timed["wall_ms"]["median"] < 10_000
    assert not list(Path(tempfile.gettempdir()).glob("crust-shim-start-*"))
    # No daemon was started (each start found the shim answering): none
    # names the bench's directory, nor the pod it names.
    assert not processes_naming("crust-shim-start-") and not processes_naming("shim-start-bench")


def test_a_dead_shims_socket_is_removed_and_nothing_else(tmp_path):
    """`delete`'s clean-up of a killed shim's socket (the bundle's address):
    removed when nobody accepts on it; kept when a shim answers there, and
    never outside containerd's socket directory."""
    from crust.containerd_shim.main import remove_dead_socket
    from crust.containerd_shim.options import SOCKET_DIR

    SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    ours = SOCKET_DIR / f"crust-test-{os.getpid()}-{time.monotonic_ns()}"
    outside = tmp_path / "elsewhere.sock"
    listeners = []
    try:
        for path in (ours, outside):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(path))
            listener.listen(4)
            listeners.append(listener)
        (bundle / "address").write_text(f"unix://{ours}")
        assert not remove_dead_socket(bundle) and ours.is_socket()     # a shim answers there
        (bundle / "address").write_text(f"unix://{outside}")
        listeners.pop().close()
        assert not remove_dead_socket(bundle) and outside.is_socket()  # not containerd's directory
        (bundle / "address").write_text(f"unix://{ours}")
        listeners.pop().close()
        assert remove_dead_socket(bundle) and not ours.exists()
        assert not remove_dead_socket(bundle)                           # gone already
        (bundle / "address").unlink()
        assert not remove_dead_socket(bundle)                           # no address at all
    finally:
        for listener in listeners:
            listener.close()
        ours.unlink(missing_ok=True)


# -- a process's exit and its output ---------------------------------------------------------------


class _Handler:
    """PodRuntime as the shim sees it: the exec exited 0 at once; its
    output comes as chunks once `more` is set, then the stream ends (with
    end: an error)."""

    def __init__(self, chunks: list[bytes], end: TtrpcError | None):
        self.chunks, self.end, self.more = chunks, end, asyncio.Event()

    async def call(self, method, request, timeout=None):
        assert method == "GetProcess"
        return handler_pb2.ProcessState(status=handler_pb2.ProcessState.STOPPED, exit_code=0, exited_at_ns=1)

    async def _stream(self, request):
        await self.more.wait()
        offset = request.stdout_offset
        for data in self.chunks:
            yield handler_pb2.OutputChunk(stream=handler_pb2.OutputChunk.STDOUT, offset=offset, data=data)
            offset += len(data)
        if self.end is not None:
            raise self.end

    def read_output(self, request):
        return self._stream(request)


@pytest.mark.parametrize("end", [None, TtrpcError(ttrpc.DATA_LOSS, "the output of e was cut after 6 bytes "
                                                                   "of stdout and 0 of stderr: the VM is gone")],
                         ids=["whole", "cut"])
async def test_an_execs_exit_waits_for_its_whole_output_and_a_cut_one_fails_its_wait(tmp_path, monkeypatch, end):
    """The exit is reported only once the handler's stream of the output
    ended, however late; a stream that ended in an error fails the exec's
    Wait with DATA_LOSS and the handler's words (containerd's ExecSync then
    fails), where a whole one answers the exit code."""
    from crust.containerd_shim.process import RUNNING, Container, Process

    service = TaskService("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"))
    handler = _Handler([b"abc", b"def"], end)
    monkeypatch.setattr(TaskService, "pods", property(lambda _: handler))
    os.mkfifo(tmp_path / "out")
    os.mkfifo(tmp_path / "err")
    reader = os.open(tmp_path / "out", os.O_RDONLY | os.O_NONBLOCK)
    process = Process("c", "e", stdout=str(tmp_path / "out"), stderr=str(tmp_path / "err"), status=RUNNING)
    service.containers["c"] = Container("c", str(tmp_path), sandbox=False, init=Process("c", ""),
                                        execs={"e": process})
    try:
        watcher = asyncio.ensure_future(service._watch_process(process))
        await asyncio.sleep(0.3)
        assert not process.exited.is_set()   # exited in the guest, output not yet out
        handler.more.set()
        await asyncio.wait_for(watcher, 5)
        assert os.read(reader, 100) == b"abcdef"
        if end is None:
            answer = await service.Wait(task_pb.WaitRequest(id="c", exec_id="e"), None)
            assert answer.exit_status == 0
        else:
            with pytest.raises(TtrpcError) as failed:
                await service.Wait(task_pb.WaitRequest(id="c", exec_id="e"), None)
            assert failed.value.code == ttrpc.DATA_LOSS
            assert "exited with code 0, but the output of e was cut after 6 bytes" in failed.value.message
    finally:
        process.deleted.set()
        os.close(reader)


# -- an exec's end ----------------------------------------------------------------------------------


class _Deletes:
    """PodRuntime's DeleteProcess as the shim calls it: each call kept; the
    second of an exec is NOT_FOUND, as the handler answers it."""

    def __init__(self):
        self.asked: list[tuple[str, str]] = []

    async def call(self, method, request, timeout=None):
        assert method == "DeleteProcess"
        key = (request.container_id, request.exec_id)
        if key in self.asked:
            raise TtrpcError(ttrpc.NOT_FOUND, f"exec_id {request.exec_id!r}: no such process")
        self.asked.append(key)
        return handler_pb2.DeleteProcessResponse()


async def test_a_deleted_exec_is_gone_from_the_shim_and_the_handler_and_late_calls_are_not_found(monkeypatch):
    """containerd's Delete of an exited exec reaches the handler
    (DeleteProcess); afterwards every call naming the exec is NOT_FOUND, as
    containerd's runc shim answers for a process it does not have."""
    from crust.containerd_shim.process import RUNNING, Container, Process

    service = TaskService("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"))
    handler = _Deletes()
    monkeypatch.setattr(TaskService, "pods", property(lambda _: handler))
    process = Process("c", "e", status=RUNNING, guest_pid=42, spec=handler_pb2.ProcessSpec(args=["true"]))
    service.containers["c"] = Container("c", "/nonexistent", sandbox=False, init=Process("c", "", status=RUNNING),
                                        execs={"e": process})
    with pytest.raises(TtrpcError) as running:
        await service.Delete(task_pb.DeleteRequest(id="c", exec_id="e"), None)
    assert running.value.code == ttrpc.FAILED_PRECONDITION and handler.asked == []
    service._exited(process, 0)
    assert process.spec is None   # the exec's args and env are not kept past its start
    answer = await service.Delete(task_pb.DeleteRequest(id="c", exec_id="e"), None)
    assert answer.exit_status == 0 and handler.asked == [("c", "e")]
    for call, request in [("Wait", task_pb.WaitRequest(id="c", exec_id="e")),
                          ("State", task_pb.StateRequest(id="c", exec_id="e")),
                          ("Kill", task_pb.KillRequest(id="c", exec_id="e", signal=9)),
                          ("Delete", task_pb.DeleteRequest(id="c", exec_id="e"))]:
        with pytest.raises(TtrpcError) as gone:
            await getattr(service, call)(request, None)
        assert gone.value.code == ttrpc.NOT_FOUND, call
    assert handler.asked == [("c", "e")]
    # A handler that forgot it already (its bound, the pod gone): the Delete still succeeds.
    handler.asked.append(("c", "f"))
    late = Process("c", "f", status=RUNNING, guest_pid=43)
    service.containers["c"].execs["f"] = late
    service._exited(late, 3)
    assert (await service.Delete(task_pb.DeleteRequest(id="c", exec_id="f"), None)).exit_status == 3
    assert "f" not in service.containers["c"].execs
    # One whose start the handler refused (it runs nothing): its Delete is
    # asked of the handler too, which may hold it.
    service.containers["c"].execs["g"] = Process("c", "g", spec=handler_pb2.ProcessSpec(args=["/no/such"]))
    await service.Delete(task_pb.DeleteRequest(id="c", exec_id="g"), None)
    assert handler.asked[-1] == ("c", "g") and "g" not in service.containers["c"].execs


async def test_exited_execs_nobody_deletes_are_bounded_in_the_shim(monkeypatch):
    """More than EXITED_EXECS_KEPT exited execs of a container that
    containerd never deletes: the oldest are forgotten; one deleted in
    time is not counted."""
    from crust.containerd_shim import process as shim_process
    from crust.containerd_shim.process import RUNNING, Container, Process

    monkeypatch.setattr(shim_process, "EXITED_EXECS_KEPT", 4)
    service = TaskService("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"))
    container = Container("c", "/nonexistent", sandbox=False, init=Process("c", "", status=RUNNING))
    service.containers["c"] = container
    execs = [Process("c", f"e{i}", status=RUNNING, guest_pid=100 + i) for i in range(7)]
    container.execs.update({p.exec_id: p for p in execs})
    for n, p in enumerate(execs[:6]):
        service._exited(p, 0, exited_at_ns=1000 + n)
    assert sorted(container.execs) == ["e2", "e3", "e4", "e5", "e6"]   # four exited kept, the running one
    assert execs[0].deleted.is_set() and not execs[2].deleted.is_set()
    with pytest.raises(TtrpcError) as gone:
        await service.Wait(task_pb.WaitRequest(id="c", exec_id="e0"), None)
    assert gone.value.code == ttrpc.NOT_FOUND
