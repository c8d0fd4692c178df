"""The ContainerVolumes service on a second socket, as JSON lines.

crust-oci-runtime is a process per call; importing grpc would be most of
its start (crust.oci_runtime.client). So the light handler serves the same
service, the same servicer and messages, also on `<endpoint>.json`: one
connection per call, a line `{"method": M, "request": {...}}` in, a line
`{"response": {...}}` or `{"error": {"code": NAME, "message": TEXT}}` out,
the messages in protobuf's JSON mapping of specs/handler.proto.

The socket is the gRPC socket's peer: the same mode (0600, root), and a
caller whose uid is not this process's is refused (SO_PEERCRED), as is a
line longer than MAX_REQUEST, an unknown method or a message the mapping
refuses (INVALID_ARGUMENT, naming it). The servicer's CrustErrors carry
their gRPC code's name; anything else is INTERNAL.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct

from google.protobuf import json_format

from crust.api import handler_pb2
from crust.common.errors import CrustError
from crust.common.grpcserver import listen_unix, socket_path
from crust.oci_runtime.client import JSON_SUFFIX
from crust.runtime_handler.service import ContainerVolumesService

log = logging.getLogger(__name__)

MAX_REQUEST = 4 << 20
READ_TIMEOUT = 30.0
METHODS = {
    "PrepareContainer": handler_pb2.PrepareContainerRequest,
    "PrepareBundle": handler_pb2.PrepareBundleRequest,
    "ContainerCreated": handler_pb2.ContainerCreatedRequest,
    "ReleaseContainer": handler_pb2.ReleaseContainerRequest,
    "ListContainers": handler_pb2.ListContainersRequest,
}


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class JsonEndpoint:
    def __init__(self, service: ContainerVolumesService, endpoint: str):
        self.service = service
        self.path = socket_path(endpoint) + JSON_SUFFIX
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, sock=listen_unix(self.path, 0o600),
                                                      limit=MAX_REQUEST)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            if peer_uid(sock) != os.geteuid():
                # Its line is read first (never parsed): a client that writes
                # and then reads gets the refusal, not a broken pipe from a
                # socket closed before its write (as on a busy machine).
                try:
                    await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
                except (asyncio.LimitOverrunError, ValueError):
                    pass
                answer = _error("PERMISSION_DENIED", "only the handler's own user may call it")
            else:
                try:
                    line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT)
                except (asyncio.LimitOverrunError, ValueError):
                    line, answer = b"", _error("INVALID_ARGUMENT", f"a request longer than {MAX_REQUEST} bytes")
                else:
                    answer = await self._answer(line)
            writer.write(json.dumps(answer, separators=(",", ":")).encode() + b"\n")
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _answer(self, line: bytes) -> dict:
        try:
            call = json.loads(line)
        except ValueError as exc:
            return _error("INVALID_ARGUMENT", f"not a JSON line: {exc}")
        if not isinstance(call, dict) or not isinstance(call.get("request", {}), dict):
            return _error("INVALID_ARGUMENT", "a request is an object with method and request (an object)")
        method = call.get("method")
        if method not in METHODS:
            return _error("UNIMPLEMENTED", f"method {method!r}: one of {', '.join(METHODS)}")
        try:
            request = json_format.ParseDict(call.get("request", {}), METHODS[method]())
        except json_format.ParseError as exc:
            return _error("INVALID_ARGUMENT", f"{method} request: {exc}")
        try:
            response = await getattr(self.service, method)(request, None)
        except CrustError as exc:
            return _error(exc.code.name, exc.message)
        except Exception as exc:  # noqa: BLE001 - the caller gets a status, the log the detail
            log.exception("ContainerVolumes over JSON failed", extra={"fields": {"method": method}})
            return _error("INTERNAL", f"{type(exc).__name__}: {exc}")
        return {"response": json_format.MessageToDict(response)}


def _error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}
