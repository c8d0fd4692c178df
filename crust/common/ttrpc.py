"""ttrpc on asyncio: the framing, a server and a client (specs/ttrpc.proto).

containerd talks to its shims, shims to containerd's event service, and
crust-microvm's host to its guest agent (specs/agent.proto) in ttrpc: gRPC's
status codes and protobuf messages without HTTP/2. Every frame
is a 10-byte big-endian header (payload length, stream id, type, flags) and
the payload; a request's payload is a ttrpc.Request naming the service and
method and carrying the method's message, the answer is a ttrpc.Response on
the same stream id. The task API and the event service are unary. A
server stream (the microVM handler's process output to the shim) is a
handler returning an async iterator: each message it yields goes out as a
data frame (type 3) on the call's stream id, and the Response ends the
stream. A client reads a stream on a connection of its own: while the
stream's reader does not take a message, the connection is not read, so a
slow reader holds the server's writes back (the socket's buffers fill and
the server's drain waits) and nothing piles up between. Data frames from a
client are refused.

The server runs each request as its own task (containerd keeps a Wait call
open for as long as a container runs, next to its other calls on the same
connection) and cancels a connection's calls when it closes. Go's ttrpc
writes each reply from one loop per connection, so a peer that does not
read its replies stops that loop, and with it the reading of requests. Here
replies are written one at a time, each waiting until the peer has taken
the bytes before it (the transport's drain), and a connection is read only
while what it holds (requests being served, replies not taken yet) is below
CONNECTION_BYTES_MAX and its calls below CONNECTION_CALLS_MAX: a client
that sends and never reads costs a bounded amount of memory, then waits.
A server made with refuse_calls_over (the guest agent's, whose calls may
wait for hours) answers the calls beyond it RESOURCE_EXHAUSTED instead.
Stream ids are checked as Go's server checks them: odd (the client's), and
increasing for requests.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from crust.api import ttrpc_pb2
from crust.sys.sockets import listen_backlog

log = logging.getLogger(__name__)

HEADER = struct.Struct(">IIBB")
HEADER_LENGTH = HEADER.size  # 10
# ttrpc refuses a message longer than this (either way).
MESSAGE_LENGTH_MAX = 4 << 20
TYPE_REQUEST = 1
TYPE_RESPONSE = 2
TYPE_DATA = 3

# gRPC status codes (ttrpc carries them in google.rpc.Status).
OK = 0
CANCELLED = 1
UNKNOWN = 2
INVALID_ARGUMENT = 3
DEADLINE_EXCEEDED = 4
NOT_FOUND = 5
ALREADY_EXISTS = 6
PERMISSION_DENIED = 7
RESOURCE_EXHAUSTED = 8
FAILED_PRECONDITION = 9
ABORTED = 10
OUT_OF_RANGE = 11
UNIMPLEMENTED = 12
INTERNAL = 13
UNAVAILABLE = 14
DATA_LOSS = 15

# What one connection may hold before it is read no more: the requests of
# its calls in flight and the replies its peer has not taken. At least one
# request and one reply of the largest size fit.
CONNECTION_BYTES_MAX = 8 << 20
# Calls one connection may have in flight (containerd keeps a Wait open per
# process of the pod next to its other calls).
CONNECTION_CALLS_MAX = 1024
# Go's ttrpc's words for a stream id a client may not use.
STREAM_ID_NOT_ODD = "StreamID must be odd for client initiated streams"
STREAM_ID_REUSED = "StreamID cannot be re-used and must increment"

# Where containerd puts its namespace in a call's metadata.
NAMESPACE_KEY = "containerd-namespace-ttrpc"


class TtrpcError(Exception):
    """A call that failed with a status code (raised by handlers, returned to callers)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"ttrpc status {self.code}: {self.message}"


class FrameError(Exception):
    """The peer broke the framing; the connection cannot go on."""


def encode_header(length: int, stream_id: int, message_type: int, flags: int = 0) -> bytes:
    return HEADER.pack(length, stream_id, message_type, flags)


def decode_header(data: bytes) -> tuple[int, int, int, int]:
    """(length, stream_id, type, flags) of a 10-byte header."""
    if len(data) != HEADER_LENGTH:
        raise FrameError(f"a ttrpc header has {HEADER_LENGTH} bytes, not {len(data)}")
    return HEADER.unpack(data)


def frame(stream_id: int, message_type: int, payload: bytes, flags: int = 0) -> bytes:
    if len(payload) > MESSAGE_LENGTH_MAX:
        raise TtrpcError(RESOURCE_EXHAUSTED,
                         f"message of {len(payload)} bytes exceeds ttrpc's maximum of {MESSAGE_LENGTH_MAX}")
    return encode_header(len(payload), stream_id, message_type, flags) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, int, bytes | None]:
    """(stream_id, type, flags, payload); payload is None when the frame was
    over the limit (its bytes are skipped so the connection stays usable).
    IncompleteReadError at a clean end of stream."""
    length, stream_id, message_type, flags = decode_header(await reader.readexactly(HEADER_LENGTH))
    if length > MESSAGE_LENGTH_MAX:
        remaining = length
        while remaining:
            chunk = await reader.read(min(remaining, 1 << 16))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(chunk)
        return stream_id, message_type, flags, None
    return stream_id, message_type, flags, await reader.readexactly(length) if length else b""


def varint(value: int) -> bytes:
    """protobuf's base-128 encoding of an unsigned integer."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@dataclass(frozen=True)
class Encoded:
    """A handler's reply encoded already, as pieces whose join is the
    message: a megabyte of a process's output goes out as it is, where a
    message would copy it in, serialize it and be wrapped in a Response,
    a copy each (under emulation the copies cost the guest's vCPU more
    than anything else a read does)."""

    pieces: tuple[bytes, ...]


def ok_response(payload: bytes) -> bytes:
    """A ttrpc Response carrying payload (field 2, no status), encoded by
    hand: protobuf would copy a megabyte of output once more to wrap it."""
    return b"\x12" + varint(len(payload)) + payload if payload else b""


def ok_response_pieces(message: Encoded) -> tuple[bytes, ...]:
    """As ok_response, its pieces: nothing of the message copied."""
    size = sum(map(len, message.pieces))
    return (b"\x12" + varint(size), *message.pieces) if size else ()


def error_response(code: int, message: str) -> bytes:
    return ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=code, message=message)).SerializeToString()


@dataclass
class Call:
    """What a handler knows of the call besides its message."""

    service: str
    method: str
    metadata: dict[str, list[str]]
    timeout: float | None
    # Run once the reply was written to the peer (a power-off must not
    # cut its own answer off).
    after_reply: Callable[[], None] | None = None

    @property
    def namespace(self) -> str:
        return (self.metadata.get(NAMESPACE_KEY) or [""])[0]


Handler = Callable[[pb_message.Message, Call], Awaitable[pb_message.Message]]


@dataclass
class _Method:
    request_type: type
    handler: Handler


class Server:
    """A ttrpc server on a unix socket; handlers are coroutines taking the
    request message and the Call, returning the response message or raising
    TtrpcError."""

    def __init__(self, refuse_calls_over: int | None = None) -> None:
        """refuse_calls_over: a request that comes while a connection has
        that many calls in flight is answered RESOURCE_EXHAUSTED at once,
        instead of the connection not being read until one ends. For a
        server whose calls may block for long (a wait for a process's
        exit): with every slot held by such waits, the call that would end
        one could never be read."""
        self.refuse_calls_over = refuse_calls_over
        # Set: every request from now on answered with this status (a
        # server that is going away).
        self.refusing: tuple[int, str] | None = None
        self._methods: dict[tuple[str, str], _Method] = {}
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    def register(self, service: str, method: str, request_type: type, handler: Handler) -> None:
        self._methods[(service, method)] = _Method(request_type, handler)

    def register_service(self, descriptor: ServiceDescriptor, implementation: object) -> None:
        """Every method of the service, answered by the implementation's
        method of the same name (a missing one answers UNIMPLEMENTED)."""
        for method in descriptor.methods:
            handler = getattr(implementation, method.name, None)
            if handler is not None:
                self.register(descriptor.full_name, method.name,
                              message_factory.GetMessageClass(method.input_type), handler)

    async def serve_socket(self, listener: socket.socket) -> None:
        """Start accepting on a bound, listening unix socket."""
        listener.setblocking(False)
        # asyncio listens again on a socket it is handed: with the system's backlog.
        self._server = await asyncio.start_unix_server(self._connection, sock=listener, backlog=listen_backlog())

    async def serve_path(self, path: str) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(listen_backlog())
        await self.serve_socket(listener)

    async def serve_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection until its peer closes it: a socket's, or a
        byte stream with no connections of its own (a virtio-serial port)."""
        await self._connection(reader, writer)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        self._connections.add(me)
        try:
            await _Connection(self, reader, writer).serve()
        finally:
            self._connections.discard(me)

    async def dispatch(self, payload: bytes) -> bytes:
        """The reply (a serialized ttrpc.Response) to one request."""
        reply, _call = await self.dispatch_call(payload)
        return reply if isinstance(reply, bytes) else b"".join(reply)

    async def dispatch_call(self, payload: bytes) -> tuple[bytes | tuple[bytes, ...], Call | None]:
        """The reply to one request (serialized, or the pieces of a handler's
        Encoded reply), and its Call once a handler got it."""
        if self.refusing is not None:
            return error_response(*self.refusing), None
        request = ttrpc_pb2.Request()
        try:
            request.ParseFromString(payload)
        except pb_message.DecodeError as exc:
            return error_response(INVALID_ARGUMENT, f"not a ttrpc Request: {exc}"), None
        method = self._methods.get((request.service, request.method))
        if method is None:
            return error_response(UNIMPLEMENTED, f"{request.service}/{request.method} is not implemented"), None
        message = method.request_type()
        try:
            message.ParseFromString(request.payload)
        except pb_message.DecodeError as exc:
            return error_response(INVALID_ARGUMENT, f"{request.method}: the request does not decode: {exc}"), None
        metadata: dict[str, list[str]] = {}
        for pair in request.metadata:
            metadata.setdefault(pair.key, []).append(pair.value)
        timeout = request.timeout_nano / 1e9 if request.timeout_nano > 0 else None
        call = Call(request.service, request.method, metadata, timeout)
        try:
            if timeout is None:
                result = await method.handler(message, call)
            else:
                result = await asyncio.wait_for(method.handler(message, call), timeout)
        except TtrpcError as exc:
            return error_response(exc.code, exc.message), None
        except asyncio.TimeoutError:
            return error_response(DEADLINE_EXCEEDED, f"{request.method}: the caller's deadline passed"), None
        except Exception as exc:  # a bug must not take the shim down
            log.exception("ttrpc handler failed", extra={"fields": {"method": request.method}})
            return error_response(INTERNAL, f"{request.method}: {exc}"), None
        if isinstance(result, Encoded):
            return ok_response_pieces(result), call
        if hasattr(result, "__aiter__"):
            return Streamed(request.method, result), call
        return ok_response(result.SerializeToString()), call



@dataclass(frozen=True)
class Streamed:
    """A handler's server stream, not written yet: its messages, then the end."""

    method: str
    messages: object  # an async iterator of messages


class _Connection:
    """One client's connection: its requests read while it has room, its
    replies written one after the other, each once the peer took the last."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.server = server
        self.reader, self.writer = reader, writer
        self.calls: set[asyncio.Task] = set()
        self.held = 0  # bytes of requests in flight and of replies not taken yet
        self.room = asyncio.Event()
        self.room.set()
        self.sending = asyncio.Lock()
        self.last_request = 0

    def _hold(self, size: int) -> None:
        self.held += size
        self._measure()

    def _measure(self) -> None:
        calls_ok = self.server.refuse_calls_over is not None or len(self.calls) < CONNECTION_CALLS_MAX
        if self.held < CONNECTION_BYTES_MAX and calls_ok:
            self.room.set()
        else:
            self.room.clear()

    async def serve(self) -> None:
        try:
            while True:
                # A peer that does not take its replies, or keeps too many
                # calls going, is not read until it does.
                await self.room.wait()
                try:
                    stream_id, message_type, _flags, payload = await read_frame(self.reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except FrameError as exc:
                    log.warning("ttrpc connection dropped", extra={"fields": {"error": str(exc)}})
                    return
                refusal = self._refusal(stream_id, message_type, payload)
                if refusal is not None:
                    await self.reply(stream_id, error_response(*refusal))
                    continue
                self.last_request = stream_id
                full = self._full()
                if full is not None:
                    await self.reply(stream_id, error_response(*full))
                    continue
                self._start(stream_id, payload)
        finally:
            for task in list(self.calls):
                task.cancel()
            self.writer.close()

    def _refusal(self, stream_id: int, message_type: int, payload: bytes | None) -> tuple[int, str] | None:
        """The status a frame is answered with instead of being served."""
        if stream_id % 2 == 0:
            return INVALID_ARGUMENT, STREAM_ID_NOT_ODD
        if payload is None:
            return RESOURCE_EXHAUSTED, f"message exceeds ttrpc's maximum of {MESSAGE_LENGTH_MAX} bytes"
        if message_type != TYPE_REQUEST:
            return UNIMPLEMENTED, f"ttrpc message type {message_type} is not served here (unary calls only)"
        if stream_id <= self.last_request:
            return INVALID_ARGUMENT, STREAM_ID_REUSED
        return None

    def _full(self) -> tuple[int, str] | None:
        limit = self.server.refuse_calls_over
        if limit is not None and len(self.calls) >= limit:
            return RESOURCE_EXHAUSTED, f"{len(self.calls)} calls in flight on this connection, the most served at once"
        return None

    def _start(self, stream_id: int, payload: bytes) -> None:
        task = asyncio.ensure_future(self._call(stream_id, payload))
        self.calls.add(task)
        self._hold(len(payload))

        def done(_task: asyncio.Task) -> None:
            self.calls.discard(task)
            self._hold(-len(payload))

        task.add_done_callback(done)

    async def _call(self, stream_id: int, payload: bytes) -> None:
        response, call = await self.server.dispatch_call(payload)
        if isinstance(response, Streamed):
            response = await self._stream(stream_id, response)
        await self.reply(stream_id, response)
        if call is not None and call.after_reply is not None:
            call.after_reply()

    async def _stream(self, stream_id: int, stream: Streamed) -> bytes:
        """Each message of the stream as a data frame, each written once the
        peer took the one before; the Response that ends it."""
        try:
            async for message in stream.messages:
                data = message.SerializeToString()
                if len(data) > MESSAGE_LENGTH_MAX:
                    return error_response(RESOURCE_EXHAUSTED, f"{stream.method}: a message of {len(data)} bytes "
                                                              f"exceeds ttrpc's maximum of {MESSAGE_LENGTH_MAX}")
                if not await self.reply(stream_id, (data,), TYPE_DATA):
                    return b""   # the peer is gone
        except TtrpcError as exc:
            return error_response(exc.code, exc.message)
        except Exception as exc:  # a bug must not take the server down
            log.exception("ttrpc stream failed", extra={"fields": {"method": stream.method}})
            return error_response(INTERNAL, f"{stream.method}: {exc}")
        finally:
            close = getattr(stream.messages, "aclose", None)
            if close is not None:
                await close()
        return ok_response(b"")

    async def reply(self, stream_id: int, response: bytes | tuple[bytes, ...], message_type: int = TYPE_RESPONSE
                    ) -> bool:
        """Write one reply (serialized, or in pieces) once every reply before
        it has left: until the peer reads, the reply waits here, counted in
        what the connection holds. Whether it was written."""
        pieces = (response,) if isinstance(response, bytes) else response
        size = sum(map(len, pieces))
        if size > MESSAGE_LENGTH_MAX:
            pieces = (error_response(RESOURCE_EXHAUSTED, f"message of {size} bytes exceeds ttrpc's maximum of "
                                                         f"{MESSAGE_LENGTH_MAX}"),)
            size = len(pieces[0])
        # The header and the response in one call, not joined here: no copy
        # of the response to put the header before it, and a writer that
        # can (the guest's port) puts the header in one write with what
        # follows it.
        header = encode_header(size, stream_id, message_type, 0)
        self._hold(size)
        try:
            async with self.sending:
                if self.writer.is_closing():
                    return False
                self.writer.writelines((header, *pieces))
                await self.writer.drain()
                return True
        except ConnectionError:
            return False  # the peer went away; serve() ends on its next read
        finally:
            self._hold(-size)


def _response(payload: bytes) -> ttrpc_pb2.Response:
    response = ttrpc_pb2.Response()
    response.ParseFromString(payload)
    if response.HasField("status") and response.status.code != OK:
        raise TtrpcError(response.status.code, response.status.message)
    return response


class Client:
    """A ttrpc client on one unix socket connection; calls may overlap."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 metadata: dict[str, str] | None = None):
        self._reader, self._writer = reader, writer
        self._metadata = dict(metadata or {})
        self._next_stream = 1
        self._pending: dict[int, asyncio.Future] = {}
        self._streams: dict[int, asyncio.Queue] = {}
        self._receiver = asyncio.ensure_future(self._receive())

    @classmethod
    async def connect(cls, path: str, metadata: dict[str, str] | None = None,
                      buffer: int = MESSAGE_LENGTH_MAX + HEADER_LENGTH) -> "Client":
        """buffer: about half of what the connection reads ahead of its
        caller (asyncio's reader pauses at twice its limit)."""
        reader, writer = await asyncio.open_unix_connection(path, limit=buffer)
        return cls(reader, writer, metadata)

    @property
    def closed(self) -> bool:
        return self._receiver.done()

    def _request(self, service: str, method: str, request: pb_message.Message, timeout: float | None,
                 metadata: dict[str, str] | None) -> tuple[int, bytes]:
        if self.closed:
            raise TtrpcError(UNAVAILABLE, "the ttrpc connection is closed")
        stream_id = self._next_stream
        self._next_stream += 2  # client streams are odd
        pairs = [ttrpc_pb2.KeyValue(key=k, value=v) for k, v in {**self._metadata, **(metadata or {})}.items()]
        envelope = ttrpc_pb2.Request(service=service, method=method, payload=request.SerializeToString(),
                                     timeout_nano=int(timeout * 1e9) if timeout else 0, metadata=pairs)
        return stream_id, frame(stream_id, TYPE_REQUEST, envelope.SerializeToString())

    async def call(self, service: str, method: str, request: pb_message.Message, response_type: type,
                   timeout: float | None = None, metadata: dict[str, str] | None = None) -> pb_message.Message:
        stream_id, request_frame = self._request(service, method, request, timeout, metadata)
        future = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        try:
            self._writer.write(request_frame)
            await self._writer.drain()
            payload = await asyncio.wait_for(future, timeout) if timeout else await future
        except asyncio.TimeoutError:
            raise TtrpcError(DEADLINE_EXCEEDED, f"{service}/{method}: no answer within {timeout:g} s") from None
        finally:
            self._pending.pop(stream_id, None)
        response = _response(payload)
        result = response_type()
        result.ParseFromString(response.payload)
        return result

    async def stream(self, service: str, method: str, request: pb_message.Message, message_type: type,
                     metadata: dict[str, str] | None = None, queue: int = 2):
        """A server stream's messages, as the server sends them, until its
        Response (raising its error). While the caller does not take the
        next message (more than `queue` are waiting), this connection is
        not read: a stream wants a connection of its own."""
        stream_id, request_frame = self._request(service, method, request, None, metadata)
        messages: asyncio.Queue = asyncio.Queue(queue)
        self._streams[stream_id] = messages
        try:
            self._writer.write(request_frame)
            await self._writer.drain()
            while True:
                kind, payload = await self._next(messages)
                if payload is None:
                    raise TtrpcError(RESOURCE_EXHAUSTED, f"{method}: a message exceeds ttrpc's maximum")
                if kind == TYPE_RESPONSE:
                    _response(payload)
                    return
                message = message_type()
                message.ParseFromString(payload)
                yield message
        finally:
            self._streams.pop(stream_id, None)
            while not messages.empty():   # the receiver may wait to put one more
                messages.get_nowait()

    async def _next(self, messages: asyncio.Queue) -> tuple[int, bytes | None]:
        if not messages.empty() or not self.closed:
            getting = asyncio.ensure_future(messages.get())
            try:
                await asyncio.wait({getting, self._receiver}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not getting.done():
                    getting.cancel()
            if getting.done() and not getting.cancelled():
                return getting.result()
            if not messages.empty():
                return messages.get_nowait()
        raise TtrpcError(UNAVAILABLE, "the ttrpc connection closed")

    async def _receive(self) -> None:
        try:
            while True:
                stream_id, message_type, _flags, payload = await read_frame(self._reader)
                messages = self._streams.get(stream_id)
                if messages is not None and message_type in (TYPE_DATA, TYPE_RESPONSE):
                    await messages.put((message_type, payload))
                    continue
                future = self._pending.get(stream_id)
                if future is None or future.done() or message_type != TYPE_RESPONSE:
                    continue
                if payload is None:
                    future.set_exception(TtrpcError(RESOURCE_EXHAUSTED, "the response exceeds ttrpc's maximum"))
                else:
                    future.set_result(payload)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError):
            pass
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(TtrpcError(UNAVAILABLE, "the ttrpc connection closed"))

    async def close(self) -> None:
        self._writer.close()
        self._receiver.cancel()
        try:
            await self._receiver
        except asyncio.CancelledError:
            pass
        try:
            await self._writer.wait_closed()
        except (ConnectionError, OSError):
            pass
