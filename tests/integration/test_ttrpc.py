"""ttrpc (crust/common/ttrpc.py): our server and client against each other
on a real unix socket, a round trip into a real containerd's ttrpc socket
(its event service), and the shim's task service answering containerd's
error codes. The framing byte for byte is in tests/unit/test_common_ttrpc.py."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2

from crust.api import containerd_events_pb2 as events
from crust.api import handler_pb2
from crust.api import containerd_task_pb2 as task_pb
from crust.api import ttrpc_pb2
from crust.common import ttrpc
from crust.containerd_shim.events import Publisher, envelope, forward
from crust.containerd_shim.task import TaskService
from crust.common.ttrpc import Client, Server, TtrpcError
from crust.sys.sockets import socket_alive
from tests.harness import stop_child

TASK = "containerd.task.v2.Task"


# -- our server and client --------------------------------------------------------------


class _Service:
    """A stand-in task service for the transport tests (not the shim's)."""

    def __init__(self):
        self.released = asyncio.Event()
        self.namespaces = []

    async def Wait(self, request, call):
        await self.released.wait()
        return task_pb.WaitResponse(exit_status=7)

    async def Connect(self, request, call):
        self.namespaces.append(call.namespace)
        if request.id == "missing":
            raise TtrpcError(ttrpc.NOT_FOUND, "container missing: not found")
        if request.id == "slow":
            await asyncio.sleep(5)
        if request.id == "bug":
            raise RuntimeError("a bug")
        return task_pb.ConnectResponse(shim_pid=42, task_pid=43, version=request.id)


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "t.sock")


async def _raw_call(path: str, data: bytes) -> list[tuple[tuple, bytes]]:
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(data)
    await writer.drain()
    frames = []
    try:
        while True:
            header = await asyncio.wait_for(reader.readexactly(10), 2)
            length = struct.unpack(">I", header[:4])[0]
            frames.append((ttrpc.decode_header(header), await reader.readexactly(length)))
    except (asyncio.TimeoutError, asyncio.IncompleteReadError):
        pass
    writer.close()
    return frames


async def test_overlapping_calls_on_one_connection(sock):
    service = _Service()
    server = Server()
    server.register_service(task_pb.DESCRIPTOR.services_by_name["Task"], service)
    await server.serve_path(sock)
    client = await Client.connect(sock, {ttrpc.NAMESPACE_KEY: "k8s.io"})
    try:
        waiting = asyncio.ensure_future(client.call(TASK, "Wait", task_pb.WaitRequest(id="c"), task_pb.WaitResponse))
        answer = await client.call(TASK, "Connect", task_pb.ConnectRequest(id="c"), task_pb.ConnectResponse, timeout=2)
        assert (answer.shim_pid, answer.task_pid, answer.version) == (42, 43, "c")
        assert not waiting.done()
        service.released.set()
        assert (await asyncio.wait_for(waiting, 2)).exit_status == 7
        assert service.namespaces == ["k8s.io"]
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Connect", task_pb.ConnectRequest(id="missing"), task_pb.ConnectResponse)
        assert caught.value.code == ttrpc.NOT_FOUND and "missing" in caught.value.message
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Stats", task_pb.StatsRequest(id="c"), task_pb.StatsResponse)
        assert caught.value.code == ttrpc.UNIMPLEMENTED
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Connect", task_pb.ConnectRequest(id="slow"), task_pb.ConnectResponse,
                              timeout=0.2)
        assert caught.value.code == ttrpc.DEADLINE_EXCEEDED
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Connect", task_pb.ConnectRequest(id="bug"), task_pb.ConnectResponse)
        assert caught.value.code == ttrpc.INTERNAL
        # The connection still serves after all of that.
        assert (await client.call(TASK, "Connect", task_pb.ConnectRequest(id="d"), task_pb.ConnectResponse)).version == "d"
    finally:
        await client.close()
        await server.close()


async def test_a_server_that_refuses_calls_over_its_limit_answers_resource_exhausted(sock):
    """With refuse_calls_over (the guest agent's server), calls beyond the
    limit are refused at once, and the connection is still read: a call
    that ends the blocked ones gets through."""
    service = _Service()
    server = Server(refuse_calls_over=2)
    server.register_service(task_pb.DESCRIPTOR.services_by_name["Task"], service)
    await server.serve_path(sock)
    client = await Client.connect(sock, {ttrpc.NAMESPACE_KEY: "k8s.io"})
    try:
        waits = [asyncio.ensure_future(client.call(TASK, "Wait", task_pb.WaitRequest(id=f"c{i}"),
                                                   task_pb.WaitResponse)) for i in range(2)]
        await asyncio.sleep(0.2)
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Connect", task_pb.ConnectRequest(id="c"), task_pb.ConnectResponse, timeout=2)
        assert caught.value.code == ttrpc.RESOURCE_EXHAUSTED and "2 calls in flight" in caught.value.message
        service.released.set()
        assert [(await asyncio.wait_for(w, 2)).exit_status for w in waits] == [7, 7]
        answer = await client.call(TASK, "Connect", task_pb.ConnectRequest(id="d"), task_pb.ConnectResponse, timeout=2)
        assert answer.version == "d"
    finally:
        await client.close()
        await server.close()


async def test_a_calls_after_reply_runs_once_its_reply_left_and_a_refusing_server_answers_its_status(sock):
    """What the guest agent's PowerOff rests on: its power-off runs only
    after the answer was written, and the calls after it are refused."""
    seen: list[str] = []

    async def connect(request, call):
        def after() -> None:
            seen.append(f"after {request.id}")
            server.refusing = (ttrpc.UNAVAILABLE, "going away")
        call.after_reply = after
        seen.append(f"answered {request.id}")
        return task_pb.ConnectResponse(version=request.id)

    server = Server()
    server.register(TASK, "Connect", task_pb.ConnectRequest, connect)
    await server.serve_path(sock)
    client = await Client.connect(sock)
    try:
        answer = await client.call(TASK, "Connect", task_pb.ConnectRequest(id="off"), task_pb.ConnectResponse,
                                   timeout=2)
        assert answer.version == "off" and seen[0] == "answered off"
        await asyncio.sleep(0.1)
        assert seen == ["answered off", "after off"]
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Connect", task_pb.ConnectRequest(id="late"), task_pb.ConnectResponse, timeout=2)
        assert (caught.value.code, caught.value.message) == (ttrpc.UNAVAILABLE, "going away")
        assert seen == ["answered off", "after off"]
    finally:
        await client.close()
        await server.close()


async def _stand_in_server(path: str) -> Server:
    """Our server with the stand-in task service, serving on path."""
    server = Server()
    server.register_service(task_pb.DESCRIPTOR.services_by_name["Task"], _Service())
    await server.serve_path(path)
    return server


def _connect_request(container_id: str) -> bytes:
    """A ttrpc Request for Task.Connect, as bytes."""
    return ttrpc_pb2.Request(service=TASK, method="Connect",
                             payload=task_pb.ConnectRequest(id=container_id).SerializeToString()).SerializeToString()


async def test_server_answers_raw_frames_and_survives_bad_ones(sock):
    server = await _stand_in_server(sock)
    try:
        good = _connect_request("raw")
        oversized = struct.pack(">IIBB", ttrpc.MESSAGE_LENGTH_MAX + 1, 3, 1, 0) + b"\0" * (ttrpc.MESSAGE_LENGTH_MAX + 1)
        data_frame = ttrpc.frame(5, ttrpc.TYPE_DATA, b"")
        garbage = ttrpc.frame(7, ttrpc.TYPE_REQUEST, b"\xff\xff\xff")
        frames = await _raw_call(sock, oversized + data_frame + garbage + ttrpc.frame(9, ttrpc.TYPE_REQUEST, good))
        by_stream = {header[1]: (header, payload) for header, payload in frames}
        assert set(by_stream) == {3, 5, 7, 9}
        codes = {}
        for stream, (header, payload) in by_stream.items():
            assert header[2] == ttrpc.TYPE_RESPONSE and header[0] == len(payload)
            response = ttrpc_pb2.Response()
            response.ParseFromString(payload)
            codes[stream] = response.status.code
        assert codes == {3: ttrpc.RESOURCE_EXHAUSTED, 5: ttrpc.UNIMPLEMENTED, 7: ttrpc.INVALID_ARGUMENT, 9: 0}
        response = ttrpc_pb2.Response()
        response.ParseFromString(by_stream[9][1])
        assert task_pb.ConnectResponse.FromString(response.payload).version == "raw"
    finally:
        await server.close()


# -- containerd's own ttrpc socket ------------------------------------------------------------


@pytest.fixture
def containerd():
    from crust.kubelet.containerd import Containerd

    directory = Path(tempfile.mkdtemp(prefix="crust-ttrpc-"))
    instance = Containerd(directory / "containerd", sandbox_image="localhost/none:0")
    try:
        instance.start()
        yield instance
    finally:
        instance.close()
        shutil.rmtree(directory, ignore_errors=True)


async def test_containerd_accepts_forwarded_events(containerd):
    """Our client, containerd's server: events Forward over ttrpc, seen by a
    subscriber (`ctr events`) exactly as sent; a bad topic is refused with
    containerd's own status."""
    watcher = subprocess.Popen(["ctr", "--address", str(containerd.socket), "events"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)  # subscribed
        client = await Client.connect(str(containerd.socket) + ".ttrpc")
        try:
            await forward(client, "crust-ttrpc", events.TaskExit(container_id="c-1", id="c-1", pid=4242, exit_status=3))
            bad = envelope("crust-ttrpc", events.TaskOOM(container_id="c-2"))
            bad.topic = "no-leading-slash"
            from crust.api import containerd_events_ttrpc_pb2 as events_ttrpc

            with pytest.raises(TtrpcError) as caught:
                await client.call("containerd.services.events.ttrpc.v1.Events", "Forward",
                                  events_ttrpc.ForwardRequest(envelope=bad), empty_pb2.Empty, timeout=5)
            assert caught.value.code == ttrpc.INVALID_ARGUMENT
            with pytest.raises(TtrpcError) as caught:
                await client.call("containerd.services.events.ttrpc.v1.Events", "Nope", empty_pb2.Empty(),
                                  empty_pb2.Empty, timeout=5)
            assert caught.value.code == ttrpc.UNIMPLEMENTED
        finally:
            await client.close()
        # The publisher (the shim's queue) delivers through the same path.
        publisher = Publisher(f"unix://{containerd.socket}.ttrpc", "crust-ttrpc")
        publisher.publish(events.TaskStart(container_id="c-9", pid=99))
        assert await publisher.drain(10)
        await publisher.close()
        deadline = time.monotonic() + 10
        seen = ""
        # The pipe's descriptor itself, waited on with select: a text
        # stream's read() of a non-blocking pipe with nothing in it raises
        # (the decoder is handed None) instead of returning.
        fd = watcher.stdout.fileno()
        while time.monotonic() < deadline and ("/tasks/start" not in seen or "/tasks/exit" not in seen):
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # ctr ended
                seen += chunk.decode(errors="replace")
    finally:
        watcher.kill()
        watcher.wait()
    exit_line = next(line for line in seen.splitlines() if "/tasks/exit" in line)
    assert "crust-ttrpc" in exit_line and '"container_id":"c-1"' in exit_line.replace(" ", "")
    assert '"exit_status":3' in exit_line.replace(" ", "") and '"pid":4242' in exit_line.replace(" ", "")
    assert "c-9" in next(line for line in seen.splitlines() if "/tasks/start" in line)


async def test_publisher_waits_for_containerd(tmp_path):
    """Events published while containerd's socket is away are sent, in
    order, once it answers (here: our own server standing in for the
    socket; containerd's own side is the test above)."""
    path = str(tmp_path / "events.sock")
    received = []

    class Events:
        async def Forward(self, request, call):
            received.append(request.envelope.topic)
            return empty_pb2.Empty()

    from crust.api import containerd_events_ttrpc_pb2 as events_ttrpc

    publisher = Publisher(f"unix://{path}", "ns")
    publisher.publish(events.TaskStart(container_id="a"))
    publisher.publish(events.TaskExit(container_id="a", id="a"))
    await asyncio.sleep(0.5)
    server = Server()
    server.register_service(events_ttrpc.DESCRIPTOR.services_by_name["Events"], Events())
    await server.serve_path(path)
    try:
        assert await publisher.drain(10)
        assert received == ["/tasks/start", "/tasks/exit"]
    finally:
        await publisher.close()
        await server.close()


# -- the task service's answers without a pod --------------------------------------------------


async def test_task_service_status_codes(sock, tmp_path, monkeypatch):
    """Unknown ids are NOT_FOUND, bad input INVALID_ARGUMENT, what crust
    does not offer UNIMPLEMENTED: the codes containerd's errdefs map."""
    from crust.containerd_shim import task

    monkeypatch.setattr(task, "HANDLER_RESTART_SECONDS", 0.5)  # no handler ever comes here
    service = TaskService("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"))
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
        for method, request in [("Stats", task_pb.StatsRequest(id="x")), ("Update", task_pb.UpdateTaskRequest(id="x")),
                                ("Pause", task_pb.PauseRequest(id="x")), ("Resume", task_pb.ResumeRequest(id="x")),
                                ("Checkpoint", task_pb.CheckpointTaskRequest(id="x"))]:
            assert await code(method, request) in (ttrpc.UNIMPLEMENTED, ttrpc.NOT_FOUND), method
        # With no task, Shutdown ends the shim.
        assert not service.containers
        await client.call(TASK, "Shutdown", task_pb.ShutdownRequest(id="x"), empty_pb2.Empty, timeout=5)
    finally:
        await client.close()
        await server.close()
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


# -- a hostile or broken client ------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.fixture
def shim_daemon(tmp_path):
    """containerd-shim-crust-v2's daemon (`serve`) on a socket of the test's,
    with no handler behind it: the transport is what is under test."""
    sock = tmp_path / "shim.sock"
    log = open(tmp_path / "shim.log", "wb")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "crust.containerd_shim", "-namespace", "t", "-address", "", "-id", "hostile",
         "-socket", str(sock), "-handler-endpoint", f"unix://{tmp_path}/no-handler.sock", "serve"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        while not socket_alive(str(sock)):
            assert daemon.poll() is None and time.monotonic() < deadline, (tmp_path / "shim.log").read_text()
            time.sleep(0.05)
        yield daemon, sock
    finally:
        stop_child(daemon)
        log.close()


def test_a_client_that_never_reads_its_replies_does_not_grow_the_shim(shim_daemon):
    """60 requests of 3.5 MiB to an unknown service, each UNIMPLEMENTED reply
    echoing the name, and the client never reads: the shim stops reading the
    connection once what it holds for it is bounded, its RSS stays put, and
    it answers another connection meanwhile."""
    daemon, sock = shim_daemon
    name = "x" * (3 << 19)  # 3.5 MiB... of a service name
    request = ttrpc_pb2.Request(service=name, method="M").SerializeToString()
    before = _rss_mib(daemon.pid)
    hostile = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hostile.connect(str(sock))
    hostile.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sent, peak = 0, before
    try:
        hostile.settimeout(3)
        for stream in range(1, 121, 2):
            try:
                hostile.sendall(ttrpc.frame(stream, ttrpc.TYPE_REQUEST, request))
            except TimeoutError:
                break  # the shim stopped reading this connection
            sent += 1
            peak = max(peak, _rss_mib(daemon.pid))
        for _ in range(20):
            time.sleep(0.1)
            peak = max(peak, _rss_mib(daemon.pid))

        async def another_caller():
            client = await Client.connect(str(sock))
            try:
                with pytest.raises(TtrpcError) as caught:
                    await client.call(TASK, "State", task_pb.StateRequest(id="nope"), task_pb.StateResponse, timeout=5)
                return caught.value.code
            finally:
                await client.close()

        assert asyncio.run(another_caller()) == ttrpc.NOT_FOUND
        peak = max(peak, _rss_mib(daemon.pid))
    finally:
        hostile.close()
    print(f"\nshim RSS {before:.0f} -> peak {peak:.0f} MiB; {sent} of 60 requests of 3.5 MiB taken before it "
          "stopped reading")
    assert peak - before < 32, f"the shim grew from {before:.0f} to {peak:.0f} MiB ({sent} requests taken)"
    assert sent < 60, "the shim read every request although no reply was taken"


async def test_stream_ids_are_odd_and_increase_as_in_gos_ttrpc(sock):
    """Stream 0 and even streams are answered InvalidArgument "StreamID must
    be odd for client initiated streams"; a request on a stream id not above
    the last one "StreamID cannot be re-used and must increment"."""
    server = await _stand_in_server(sock)
    try:
        good = _connect_request("odd")
        frames = await _raw_call(sock, b"".join(ttrpc.frame(s, ttrpc.TYPE_REQUEST, good) for s in (0, 2, 5, 3, 7)))
        answers = []
        for (length, stream, kind, _flags), payload in frames:
            assert kind == ttrpc.TYPE_RESPONSE and length == len(payload)
            response = ttrpc_pb2.Response.FromString(payload)
            answers.append((stream, response.status.code, response.status.message))
        odd = "StreamID must be odd for client initiated streams"
        assert sorted(answers) == [(0, ttrpc.INVALID_ARGUMENT, odd), (2, ttrpc.INVALID_ARGUMENT, odd),
                                   (3, ttrpc.INVALID_ARGUMENT, "StreamID cannot be re-used and must increment"),
                                   (5, ttrpc.OK, ""), (7, ttrpc.OK, "")]
    finally:
        await server.close()


async def test_the_listen_backlog_is_the_systems_somaxconn(tmp_path):
    """500 connects back to back while the server cannot accept (its event
    loop is busy here): every one is queued, on a socket the server bound
    and on one handed to it (the shim's `start` binds, its daemon serves)."""
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert somaxconn >= 500, f"this host's net.core.somaxconn is {somaxconn}"
    bound = str(tmp_path / "bound.sock")
    handed = str(tmp_path / "handed.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(handed)
    listener.listen(somaxconn)  # as the shim's `start` must; the daemon must not lower it
    servers = [Server(), Server()]
    await servers[0].serve_path(bound)
    await servers[1].serve_socket(listener)
    try:
        for path in (bound, handed):
            clients, refused = [], 0
            try:
                for _ in range(500):
                    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    client.setblocking(False)
                    try:
                        client.connect(path)
                        clients.append(client)
                    except BlockingIOError:
                        refused += 1
                        client.close()
            finally:
                for client in clients:
                    client.close()
            assert refused == 0, f"{path}: {refused} of 500 connects refused"
    finally:
        for server in servers:
            await server.close()


def test_the_shim_start_bench_times_start_for_a_running_pod_and_leaves_nothing(tmp_path):
    """bench/shim_start.py: each round's `start` answers the address of the
    pod shim the bench made to listen (no daemon is started), and the bench
    removes that socket with its bundle."""
    from bench import shim_start
    from tests.cri_harness import processes_naming

    out = tmp_path / "start.json"
    assert shim_start.main(["--rounds", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    (timed,) = results.values()
    assert timed["wall_ms"]["n"] == 2 and timed["cpu_ms"]["n"] == 2 and 0 < timed["wall_ms"]["median"] < 10_000
    assert not list(Path(tempfile.gettempdir()).glob("crust-shim-start-*"))
    assert not processes_naming(shim_start.POD)


def test_a_dead_shims_socket_is_removed_and_nothing_else(tmp_path):
    """`delete`'s clean-up of a killed shim's socket (the bundle's address):
    removed when nobody accepts on it; kept when a shim answers there, and
    never outside containerd's socket directory."""
    from crust.containerd_shim.main import SOCKET_DIR, remove_dead_socket

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


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Handler:
    """PodRuntime as the shim sees it: the exec exited 0 at once; its
    output comes as chunks once `more` is set, then the stream ends (with
    end: an error)."""

    def __init__(self, chunks: list[bytes], end: _RpcError | None):
        self.chunks, self.end, self.more = chunks, end, asyncio.Event()

    async def GetProcess(self, request):
        return handler_pb2.ProcessState(status=handler_pb2.ProcessState.STOPPED, exit_code=0, exited_at_ns=1)

    async def _stream(self, request):
        await self.more.wait()
        offset = request.stdout_offset
        for data in self.chunks:
            yield handler_pb2.OutputChunk(stream=handler_pb2.OutputChunk.STDOUT, offset=offset, data=data)
            offset += len(data)
        if self.end is not None:
            raise self.end

    def ReadOutput(self, request):
        return self._stream(request)


@pytest.mark.parametrize("end", [None, _RpcError(grpc.StatusCode.DATA_LOSS, "the output of e was cut after 6 bytes "
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
