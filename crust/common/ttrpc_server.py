"""A ttrpc server on asyncio (the wire: crust.common.ttrpc).

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
increasing for requests. Data frames from a client are refused.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from crust.api import ttrpc_pb2
from crust.common.ttrpc import (
    CONNECTION_BYTES_MAX, CONNECTION_CALLS_MAX, DEADLINE_EXCEEDED, INTERNAL, INVALID_ARGUMENT, MESSAGE_LENGTH_MAX,
    NAMESPACE_KEY, RESOURCE_EXHAUSTED, STREAM_ID_NOT_ODD, STREAM_ID_REUSED, TYPE_DATA, TYPE_REQUEST, TYPE_RESPONSE,
    UNIMPLEMENTED, Encoded, FrameError, TtrpcError, encode_header, error_response, ok_response, ok_response_pieces,
    read_frame,
)
from crust.sys.sockets import listen_backlog

log = logging.getLogger(__name__)
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
