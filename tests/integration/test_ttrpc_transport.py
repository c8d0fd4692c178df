"""ttrpc's transport (crust/common/ttrpc.py): our server and client against
each other on a real unix socket (overlapping calls, limits, raw and bad
frames, stream ids as in Go's ttrpc, the listen backlog), and the shim's
daemon against a client that never reads its replies. The framing byte for
byte is in tests/unit/test_common_ttrpc.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crust.api import containerd_task_pb2 as task_pb
from crust.api import handler_pb2, ttrpc_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.common.ttrpc_client import Client
from crust.common.ttrpc_server import Server
from crust.sys.sockets import socket_alive
from tests.harness.daemons import stop_child
from tests.harness.ttrpc import TASK
from tests.harness.ttrpc import sock  # noqa: F401 - a fixture


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


# -- a server stream ---------------------------------------------------------------------------------


class _Output:
    """PodRuntime's ReadOutput as a ttrpc server stream: `total` chunks of
    1 MiB, each its own byte, then the end (or `end`, an error)."""

    def __init__(self, total: int, end: TtrpcError | None = None):
        self.total, self.end, self.made = total, end, 0

    async def ReadOutput(self, request, call):
        return self._chunks()

    async def _chunks(self):
        for n in range(self.total):
            self.made += 1
            yield handler_pb2.OutputChunk(offset=n << 20, data=bytes([n % 251]) * (1 << 20))
        if self.end is not None:
            raise self.end


@pytest.mark.parametrize("end", [None, TtrpcError(ttrpc.DATA_LOSS, "the VM is gone")], ids=["whole", "error"])
async def test_a_server_stream_comes_whole_and_in_order_and_waits_for_its_reader(sock, end):
    """Every message of a stream in order, byte for byte, then its end (or
    its error's status); a reader that stops taking messages stops the
    server's stream a few messages ahead of it, never the whole of it."""
    service = _Output(40, end)
    server = Server()
    server.register_service(handler_pb2.DESCRIPTOR.services_by_name["PodRuntime"], service)
    await server.serve_path(sock)
    client = await Client.connect(sock, buffer=1 << 20)
    got = []
    try:
        stream = client.stream("crust.handler.v1.PodRuntime", "ReadOutput", handler_pb2.ReadOutputRequest(
            container_id="c"), handler_pb2.OutputChunk, queue=2)
        with pytest.raises(TtrpcError) if end is not None else contextlib.nullcontext() as failed:
            async for chunk in stream:
                got.append(chunk)
                if len(got) == 3:
                    await asyncio.sleep(0.5)   # a reader that stalls
                    # Two queued, one waiting to be, two in the reader's
                    # buffer, one in the server's write, the socket's buffers.
                    assert service.made - len(got) <= 8, service.made
        assert [c.offset for c in got] == [n << 20 for n in range(40)]
        assert all(c.data == bytes([n % 251]) * (1 << 20) for n, c in enumerate(got))
        if end is not None:
            assert failed.value.code == ttrpc.DATA_LOSS and failed.value.message == "the VM is gone"
        # The connection serves on after the stream.
        again = [c async for c in client.stream("crust.handler.v1.PodRuntime", "ReadOutput",
                                                handler_pb2.ReadOutputRequest(), handler_pb2.OutputChunk)
                 ] if end is None else []
        assert len(again) == (40 if end is None else 0)
    finally:
        await client.close()
        await server.close()


async def test_a_stream_whose_server_goes_away_is_unavailable(sock):
    """The server closes mid-stream: the reader gets what came, then UNAVAILABLE."""
    service = _Output(1000)
    server = Server()
    server.register_service(handler_pb2.DESCRIPTOR.services_by_name["PodRuntime"], service)
    await server.serve_path(sock)
    client = await Client.connect(sock)
    try:
        with pytest.raises(TtrpcError) as failed:
            async for chunk in client.stream("crust.handler.v1.PodRuntime", "ReadOutput",
                                             handler_pb2.ReadOutputRequest(), handler_pb2.OutputChunk):
                if chunk.offset == 2 << 20:
                    await server.close()
        assert failed.value.code == ttrpc.UNAVAILABLE
        assert service.made < 1000
    finally:
        await client.close()
        await server.close()
