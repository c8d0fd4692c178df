"""ttrpc (crust/containerd_shim/ttrpc.py): the framing byte for byte, our
server and client against each other on a real unix socket, a round trip
into a real containerd's ttrpc socket (its event service), and the shim's
task service answering containerd's error codes."""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from google.protobuf import empty_pb2

from crust.api import containerd_events_pb2 as events
from crust.api import containerd_task_pb2 as task_pb
from crust.api import ttrpc_pb2
from crust.containerd_shim import ttrpc
from crust.containerd_shim.events import Publisher, envelope, forward
from crust.containerd_shim.task import TaskService, process_spec
from crust.containerd_shim.ttrpc import Client, Server, TtrpcError

TASK = "containerd.task.v2.Task"


# -- framing ---------------------------------------------------------------------------


def test_header_is_ten_big_endian_bytes():
    header = ttrpc.encode_header(0x01020304, 7, ttrpc.TYPE_REQUEST, 0)
    assert header == bytes([1, 2, 3, 4, 0, 0, 0, 7, 1, 0])
    assert ttrpc.decode_header(header) == (0x01020304, 7, 1, 0)
    assert ttrpc.decode_header(ttrpc.encode_header(5, 0xFFFFFFFF, ttrpc.TYPE_RESPONSE, 4)) == (5, 0xFFFFFFFF, 2, 4)
    with pytest.raises(ttrpc.FrameError):
        ttrpc.decode_header(b"\0" * 9)


def test_frame_carries_its_payload_and_refuses_more_than_4_mib():
    body = b"x" * 300
    assert ttrpc.frame(3, ttrpc.TYPE_RESPONSE, body) == struct.pack(">IIBB", 300, 3, 2, 0) + body
    assert len(ttrpc.frame(1, 1, b"y" * ttrpc.MESSAGE_LENGTH_MAX)) == ttrpc.MESSAGE_LENGTH_MAX + 10
    with pytest.raises(TtrpcError) as caught:
        ttrpc.frame(1, 1, b"y" * (ttrpc.MESSAGE_LENGTH_MAX + 1))
    assert caught.value.code == ttrpc.RESOURCE_EXHAUSTED


def test_request_and_response_field_numbers():
    """The wire layout of ttrpc's Request and Response (field numbers)."""
    request = ttrpc_pb2.Request(service="s", method="m", payload=b"p", timeout_nano=5,
                                metadata=[ttrpc_pb2.KeyValue(key="k", value="v")])
    assert request.SerializeToString() == (b"\x0a\x01s" b"\x12\x01m" b"\x1a\x01p" b"\x20\x05"
                                           b"\x2a\x06\x0a\x01k\x12\x01v")
    response = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=5, message="no"), payload=b"q")
    assert response.SerializeToString() == b"\x0a\x06\x08\x05\x12\x02no" b"\x12\x01q"


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


async def test_server_answers_raw_frames_and_survives_bad_ones(sock):
    server = Server()
    server.register_service(task_pb.DESCRIPTOR.services_by_name["Task"], _Service())
    await server.serve_path(sock)
    try:
        good = ttrpc_pb2.Request(service=TASK, method="Connect",
                                 payload=task_pb.ConnectRequest(id="raw").SerializeToString()).SerializeToString()
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


def test_process_spec_from_an_oci_process():
    spec = process_spec({"args": ["df", "-k", "/data"], "env": ["A=1"], "cwd": "/work",
                         "user": {"uid": 1000, "gid": 2000, "additionalGids": [3000]}})
    assert (list(spec.args), list(spec.env), spec.cwd, spec.uid, spec.gid, list(spec.additional_gids)) == (
        ["df", "-k", "/data"], ["A=1"], "/work", 1000, 2000, [3000])
    assert process_spec({"args": ["true"]}).cwd == "/"
    for broken, field in [({}, "spec.args"), ({"args": []}, "spec.args"), ({"args": [1]}, "spec.args"),
                          ({"args": ["x"], "env": "A=1"}, "spec.env"),
                          ({"args": ["x"], "user": {"uid": "root"}}, "spec.user"),
                          ({"args": ["x"], "terminal": True}, "spec.terminal")]:
        with pytest.raises(TtrpcError) as caught:
            process_spec(broken)
        assert caught.value.code == ttrpc.INVALID_ARGUMENT and field in caught.value.message


def test_socket_alive(tmp_path):
    path = str(tmp_path / "s.sock")
    assert not ttrpc.socket_alive(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        assert ttrpc.socket_alive(path)
    finally:
        listener.close()
    assert not ttrpc.socket_alive(path)


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
