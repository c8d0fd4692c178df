"""A ttrpc client on asyncio (the wire: crust.common.ttrpc).

Unary calls share one connection. A client reads a server stream on a
connection of its own: while the stream's reader does not take a message,
the connection is not read, so a slow reader holds the server's writes back
(the socket's buffers fill and the server's drain waits) and nothing piles
up between.
"""

from __future__ import annotations

import asyncio

from google.protobuf import message as pb_message

from crust.api import ttrpc_pb2
from crust.common.ttrpc import (
    DEADLINE_EXCEEDED, HEADER_LENGTH, MESSAGE_LENGTH_MAX, OK, RESOURCE_EXHAUSTED, TYPE_DATA, TYPE_REQUEST,
    TYPE_RESPONSE, UNAVAILABLE, FrameError, TtrpcError, frame, read_frame,
)

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
