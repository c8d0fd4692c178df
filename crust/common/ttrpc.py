"""ttrpc on asyncio: the wire (specs/ttrpc.proto); its server is
crust.common.ttrpc_server, its client crust.common.ttrpc_client.

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
stream.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass

from crust.api import ttrpc_pb2


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
