"""PodRuntime over ttrpc, on `<endpoint>.ttrpc` beside the handler's gRPC socket.

containerd's crust shim lives as long as its pod; importing grpc would be
a third of its memory (an idle shim: 39 MiB resident with it, 28 without). So the microVM
handler serves the same service, the same servicer and messages
(specs/handler.proto), also in ttrpc (crust.common.ttrpc), which the shim
speaks to containerd already. ReadOutput is a ttrpc server stream: each
OutputChunk a data frame, written once the shim took the one before, so a
shim that does not write its fifo holds the guest's process back as the
gRPC stream did.

The socket is the gRPC socket's peer: the same mode (0600, root), and a
caller whose uid is not this process's is refused (SO_PEERCRED) before a
frame is read. As on the gRPC socket (crust.common.grpcserver's
interceptor), a request is checked against crust.common.limits before the
servicer sees it, the caller's deadline (ttrpc's timeout, the CRI call's
passed on by the shim) bounds the handler's calls to the guest, and each
call is one log line naming its request. The servicer's CrustErrors carry
their gRPC code, which ttrpc's status shares; anything else is INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

from crust.api import handler_pb2
from crust.common import csi_input, limits, logs, ttrpc, ttrpc_server
from crust.common.errors import CrustError, status_number
from crust.common.redact import redacted
from crust.common.grpcserver import listen_unix
from crust.containerd_shim.handler_client import ttrpc_path
from crust.runtime_handler.json_endpoint import peer_uid
from crust.sys.run import rpc_deadline

log = logging.getLogger(__name__)

DESCRIPTOR = handler_pb2.DESCRIPTOR.services_by_name["PodRuntime"]


def ttrpc_error(exc: CrustError) -> ttrpc.TtrpcError:
    """crust's error as the ttrpc status the shim passes on to containerd."""
    return ttrpc.TtrpcError(status_number(exc.code), exc.message)


def _enter(request, call) -> None:
    """What the gRPC interceptor sets up for a call: its log fields, its
    deadline; the request's limits checked."""
    logs.log_fields.set({"component": "handler", "rpc": call.method, "request_id": uuid.uuid4().hex[:12],
                         "transport": "ttrpc"})
    rpc_deadline.set(time.monotonic() + call.timeout if call.timeout else None)
    limits.check(request)


class _Unary:
    """A servicer's unary method as a ttrpc handler."""

    def __init__(self, method):
        self.method = method

    async def __call__(self, request, call):
        started = time.monotonic()
        try:
            _enter(request, call)
            response = await self.method(request, None)
        except CrustError as exc:
            log.warning("failed", extra={"fields": {"code": exc.code.name, "error": exc.message,
                                                    "request": redacted(request),
                                                    "ms": round((time.monotonic() - started) * 1e3, 2)}})
            raise ttrpc_error(exc) from None
        log.info("ok", extra={"fields": {"request": redacted(request),
                                         "ms": round((time.monotonic() - started) * 1e3, 2)}})
        return response


class PodRuntimeTtrpc:
    """The servicer's methods with ttrpc's errors; ReadOutput a server stream."""

    def __init__(self, service):
        """service: crust.kata.pod.service's PodRuntimeService (its methods and its pods)."""
        self.service = service
        for method in DESCRIPTOR.methods:
            if method.name != "ReadOutput":
                setattr(self, method.name, _Unary(getattr(service, method.name)))

    async def ReadOutput(self, request: handler_pb2.ReadOutputRequest, call):
        try:
            _enter(request, call)
            container_id = csi_input.required(request.container_id, "container_id")
        except CrustError as exc:
            raise ttrpc_error(exc) from None
        return self._chunks(container_id, request)

    async def _chunks(self, container_id: str, request: handler_pb2.ReadOutputRequest):
        try:
            async for chunk in self.service.processes.read_output(container_id, request.exec_id,
                                                                  request.stdout_offset, request.stderr_offset):
                yield chunk
        except CrustError as exc:
            raise ttrpc_error(exc) from None


class TtrpcEndpoint:
    def __init__(self, service, endpoint: str):
        self.server = ttrpc_server.Server()
        self.server.register_service(DESCRIPTOR, PodRuntimeTtrpc(service))
        self.path = ttrpc_path(endpoint)
        self._socket: socket.socket | None = None
        self._listener: asyncio.base_events.Server | None = None

    def bind(self) -> None:
        """Listen (connections wait in the backlog until start)."""
        if self._socket is None:
            self._socket = listen_unix(self.path, 0o600)

    async def start(self) -> None:
        self.bind()
        self._listener = await asyncio.start_unix_server(self._serve, sock=self._socket)

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
            await self.server.close()
            self._listener = None
        elif self._socket is not None:
            self._socket.close()
        self._socket = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock: socket.socket = writer.get_extra_info("socket")
        uid = peer_uid(sock)
        if uid != os.geteuid():
            log.warning("a ttrpc caller of another user refused", extra={"fields": {"uid": uid}})
            writer.close()
            return
        await self.server.serve_stream(reader, writer)
