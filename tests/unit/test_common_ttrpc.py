"""ttrpc's framing byte for byte (crust.common.ttrpc) and the wire layout of
its Request and Response. Our server and client on real sockets are in
tests/integration/test_ttrpc_transport.py, a real containerd in
tests/integration/test_ttrpc_containerd.py."""

from __future__ import annotations

import struct

import pytest

from crust.api import ttrpc_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError


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
