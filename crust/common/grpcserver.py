"""gRPC wiring shared by every crust daemon.

- one interceptor: request id and structured log fields, the RPC deadline for
  subprocesses, secrets stripped from logged requests, the bounds every
  request keeps (crust.common.limits), latency metrics, and the single
  mapping of crust errors to gRPC status codes;
- a unix socket bound with a restrictive umask (no window where another user
  can connect) after a stale socket file is cleared; where a daemon must know
  its callers, the socket is a gate that reads each connection's credentials
  from the kernel (crust.common.peergate) and every call is checked against
  the daemon's PeerPolicy before anything else;
- the gRPC health service, reflection, and a graceful stop on SIGTERM/SIGINT:
  the signal only sets an event, health turns NOT_SERVING, in-flight RPCs get
  a grace period, the socket file is removed.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import socket
import time
import uuid
from typing import Awaitable, Callable, Iterable

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Histogram

from crust.common import limits, logs
from crust.common.endpoint import clear_stale_socket, prepare_socket_dir, socket_path
from crust.common.errors import NO_SPACE, CrustError
from crust.common.peergate import PeerGate, PeerPolicy, caller, inner_socket_path
from crust.common.redact import redacted
from crust.sys import memory
from crust.sys.run import rpc_deadline
from crust.sys.sockets import listen_backlog

log = logging.getLogger("crust.rpc")

RPC_LATENCY = Histogram(
    "crust_rpc_duration_seconds",
    "Time to serve one gRPC call",
    ["component", "method", "code"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# The CSI methods whose answer describes the plugin, not a volume: its name,
# capabilities and node. They change nothing, a plugin gives the same answers
# for as long as it runs, and kubelet asks NodeGetCapabilities before every
# stage, publish, stats and expansion call.
PLUGIN_METHODS = frozenset({
    "/csi.v1.Identity/GetPluginInfo",
    "/csi.v1.Identity/GetPluginCapabilities",
    "/csi.v1.Controller/ControllerGetCapabilities",
    "/csi.v1.Node/NodeGetCapabilities",
    "/csi.v1.Node/NodeGetInfo",
    "/csi.v1.GroupController/GroupControllerGetCapabilities",
})

# Logged at debug only: the health checks liveness sidecars make every few
# seconds, and the plugin's description.
QUIET_METHODS = PLUGIN_METHODS | {"/csi.v1.Identity/Probe", "/grpc.health.v1.Health/Check"}


def _forwarded_code(exc: BaseException, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a forwarded call ended with, from what it raised."""
    if isinstance(exc, grpc.aio.AbortError):
        return context.code() or grpc.StatusCode.UNKNOWN  # the backend's own status, passed on
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


# A served call still running after this long is logged with its request
# (its line at the end follows when it ends).
SLOW_CALL_SECONDS = 2.0


def _log_still_running(level: int, request: Message, started: float) -> None:
    # Runs in the call's context (call_later copies it): the line names the
    # request id, RPC and volume like the call's own lines.
    log.log(level, "still running", extra={"fields": {
        "request": redacted(request), "s": round(time.monotonic() - started, 1)}})


def _log_end(level: int | None, request: Message, code: grpc.StatusCode, message: str, elapsed: float) -> None:
    """The one line of a served call: at `level` when it succeeded (None: not
    written), as a warning when it failed; both name the request."""
    if code is grpc.StatusCode.OK:
        if level is not None:
            log.log(level, "ok", extra={"fields": {"request": redacted(request), "ms": round(elapsed * 1e3, 2)}})
        return
    log.warning("failed", extra={"fields": {"code": code.name, "error": message, "request": redacted(request),
                                            "ms": round(elapsed * 1e3, 2)}})


def _volume_fields(request: Message) -> dict:
    fields = {}
    for name in ("volume_id", "name", "snapshot_id", "target_path", "staging_target_path", "volume_path"):
        if hasattr(request, name):
            try:
                value = getattr(request, name)
            except AttributeError:
                continue
            if isinstance(value, str) and value:
                fields[name] = value
    return fields


class Undecodable:
    """What a request whose bytes do not parse as its message becomes (bad
    varints, invalid UTF-8 in a string, nesting past the parser's limit).

    gRPC parses a request before any interceptor sees it and answers a parse
    failure UNKNOWN with a traceback in the log; the interceptor wraps each
    method's parser so that such bytes reach it as this instead, and refuses
    them with INVALID_ARGUMENT (crust.common.grpcserver.CrustInterceptor)."""

    __slots__ = ("type_name", "size", "error")

    def __init__(self, type_name: str, size: int, error: str):
        self.type_name, self.size, self.error = type_name, size, error

    @property
    def message(self) -> str:
        return (f"the request ({self.size} bytes) does not decode as {self.type_name}: {self.error} "
                "(a malformed field, a string that is not UTF-8, or nesting deeper than the parser allows)")


def _tolerant(deserialize: Callable[[bytes], object] | None) -> Callable[[bytes], object] | None:
    """A method's request parser that returns Undecodable instead of raising."""
    if deserialize is None:
        return None
    type_name = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "the method's request message"

    def parse(data: bytes):
        memory.note_request_size(len(data))
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError: the sender's bytes, not our bug
            return Undecodable(type_name, len(data), type(exc).__name__)
    return parse


def fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str, trailing=()) -> None:
    """End a unary call with this status: set, not raised. context.abort()
    raises an exception whose traceback and gRPC's call state refer to each
    other, so every aborted call, its request included (forwarded ones are up
    to 4 MiB), stayed in memory until Python's cyclic garbage collector ran:
    the proxy's CSI socket grew by hundreds of MiB under large forwarded
    requests (docs/performance.md, "Memory under large requests")."""
    context.set_code(code)
    context.set_details(details)
    if trailing:
        # A tuple: grpc.aio's Metadata object made a backend's error with
        # trailers UNKNOWN.
        context.set_trailing_metadata(tuple(trailing))


# Wrapped handlers kept per method (see CrustInterceptor.intercept_service);
# a bound, since a client may name any number of methods the passthrough
# forwards.
_MAX_CACHED_METHODS = 1024


class CrustInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, component: str, peer_policy: PeerPolicy | None = None):
        self.component = component
        # Set on a socket behind a peer gate: every call's caller is checked
        # first, whatever the method.
        self.peer_policy = peer_policy
        # Calls being served right now: a graceful stop waits for these, not
        # for idle client connections (gRPC's own grace would).
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._latency: dict[tuple[str, grpc.StatusCode], object] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return handler
        # A method's handler is the same object call after call (registered
        # services, the passthrough's known methods), and so is its wrapper:
        # built once instead of a closure and a handler per call.
        method = details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        if method in self._wrapped or len(self._wrapped) < _MAX_CACHED_METHODS:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _enter(self) -> None:
        """A call starts: a graceful stop waits for it."""
        self.in_flight += 1
        self.idle.clear()

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    def _observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """One call into crust_rpc_duration_seconds (its labelled child looked up once)."""
        child = self._latency.get((method, code))
        if child is None:
            child = self._latency[(method, code)] = RPC_LATENCY.labels(self.component, method, code.name)
        child.observe(seconds)

    async def _refuse_undecodable(self, request: Undecodable, method: str,
                                  context: grpc.aio.ServicerContext) -> None:
        """INVALID_ARGUMENT for bytes that are not the method's message: one
        warning line, no traceback (the sender's fault, not ours)."""
        self._observe(method, grpc.StatusCode.INVALID_ARGUMENT, 0.0)
        log.warning("failed", extra={"fields": {"component": self.component, "rpc": method.rsplit("/", 1)[-1],
                                                "code": "INVALID_ARGUMENT", "error": request.message}})
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_unary is None:
            if handler.stream_stream is not None:
                return self._measured_stream(handler, method)
            return self._guarded_other(handler, method)
        if handler.request_deserializer is None and handler.response_serializer is None:
            # Raw bytes: a forwarded call, nothing here can read it.
            return self._measured_forward(handler, method)
        inner = handler.unary_unary
        rpc = method.rsplit("/", 1)[-1]
        level = logging.DEBUG if method in QUIET_METHODS else logging.INFO

        async def serve_one(request, context: grpc.aio.ServicerContext):
            if self.peer_policy is not None:
                await self._check_peer(context)  # first: a stranger learns nothing, not even a parse error
            if isinstance(request, Undecodable):
                await self._refuse_undecodable(request, method, context)
            request_id = None
            for key, value in context.invocation_metadata() or ():
                if key == "x-request-id":
                    request_id = value
            logs.log_fields.set({"component": self.component, "rpc": rpc,
                                 "request_id": request_id or uuid.uuid4().hex[:12], **_volume_fields(request)})
            remaining = context.time_remaining()
            rpc_deadline.set(time.monotonic() + remaining if remaining is not None else None)
            # One log line per call, when it ends, naming its request (and
            # one more, while it runs, for a call slower than
            # SLOW_CALL_SECONDS). The redacted copy of the request, the costly
            # part of a line, is made only for a line that is written.
            logged = log.isEnabledFor(level)
            started = time.monotonic()
            slow = asyncio.get_running_loop().call_later(
                SLOW_CALL_SECONDS, _log_still_running, level, request, started) if logged else None
            code, message = grpc.StatusCode.OK, ""
            self._enter()
            try:
                if isinstance(request, Message):
                    limits.check(request)  # before any servicer: see crust.common.limits
                response = await inner(request, context)
            except CrustError as exc:
                code, message = exc.code, exc.message
            except asyncio.CancelledError:
                code, message = grpc.StatusCode.CANCELLED, "cancelled"
                raise
            except Exception as exc:  # noqa: BLE001 - the one catch-all boundary
                if isinstance(exc, grpc.aio.AbortError):
                    code = context.code() or grpc.StatusCode.UNKNOWN
                    message = context.details() or ""
                    raise
                if isinstance(exc, OSError) and exc.errno in NO_SPACE:
                    # A full disk where no step named its directory (crust's
                    # own writes say NoSpace): the condition, not a bug.
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    message = f"{exc.strerror}: {exc.filename or 'a write of this call'}; retry once there is room"
                else:
                    log.exception("unexpected error")
                    code, message = grpc.StatusCode.INTERNAL, f"internal error: {exc}"
            finally:
                if slow is not None:
                    slow.cancel()
                self._leave()
                elapsed = time.monotonic() - started
                self._observe(method, code, elapsed)
                _log_end(level if logged else None, request, code, message, elapsed)
            if code is grpc.StatusCode.OK:
                return response
            fail(context, code, message)
            return None

        return grpc.unary_unary_rpc_method_handler(
            serve_one,
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def _guarded_other(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """A unary-stream or stream-unary method (health's Watch): only its
        undecodable requests are refused here."""
        if handler.request_deserializer is None:
            return handler
        if handler.unary_stream is not None:
            inner = handler.unary_stream
            if inspect.isasyncgenfunction(inner):
                async def watch(request, context):
                    await self._check_peer(context)
                    if isinstance(request, Undecodable):
                        await self._refuse_undecodable(request, method, context)
                    async for response in inner(request, context):
                        yield response
            else:
                async def watch(request, context):
                    await self._check_peer(context)
                    if isinstance(request, Undecodable):
                        await self._refuse_undecodable(request, method, context)
                    return await inner(request, context)
            return grpc.unary_stream_rpc_method_handler(
                watch, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        if handler.stream_unary is not None:
            inner = handler.stream_unary

            async def collect(request_iterator, context):
                await self._check_peer(context)
                return await inner(self._decoded(request_iterator, method, context), context)
            return grpc.stream_unary_rpc_method_handler(
                collect, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)
        return handler

    async def _decoded(self, request_iterator, method: str, context: grpc.aio.ServicerContext):
        """The requests of a stream, the first undecodable one refused."""
        async for request in request_iterator:
            if isinstance(request, Undecodable):
                await self._refuse_undecodable(request, method, context)
            if isinstance(request, bytes):  # forwarded as it came (typed ones are noted as parsed)
                memory.note_request_size(len(request))
            yield request

    def _measured_forward(self, handler, method: str):
        """A forwarded unary call (the shim's and the proxy's passthrough of
        known CSI methods): counted like a served one, latency and final
        code, and waited for by a graceful stop; its bytes are not read, so
        there is nothing to log."""
        inner = handler.unary_unary

        async def forward_one(request, context: grpc.aio.ServicerContext):
            memory.note_request_size(len(request))
            started = time.monotonic()
            code = grpc.StatusCode.OK
            self._enter()
            try:
                response = await inner(request, context)
                code = context.code() or grpc.StatusCode.OK  # a backend's error is set, not raised (fail())
                return response
            except (Exception, asyncio.CancelledError) as exc:
                code = _forwarded_code(exc, context)
                raise
            finally:
                self._leave()
                self._observe(method, code, time.monotonic() - started)

        return grpc.unary_unary_rpc_method_handler(forward_one, request_deserializer=None, response_serializer=None)

    def _measured_stream(self, handler, method: str):
        """A forwarded call of a method the passthrough cannot take for
        unary (not in the CSI proto, or streaming): its latency and final
        code are counted like those of a served one."""
        inner = handler.stream_stream

        async def serve_stream(request_iterator, context: grpc.aio.ServicerContext):
            started = time.monotonic()
            code = grpc.StatusCode.OK
            try:
                await self._check_peer(context)
                async for response in inner(self._decoded(request_iterator, method, context), context):
                    yield response
                code = context.code() or grpc.StatusCode.OK  # a backend's error is set, not raised (fail())
            except (Exception, asyncio.CancelledError) as exc:
                code = _forwarded_code(exc, context)
                raise
            finally:
                self._observe(method, code, time.monotonic() - started)

        return grpc.stream_stream_rpc_method_handler(
            serve_stream, request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer)

    async def _check_peer(self, context: grpc.aio.ServicerContext) -> None:
        """On a socket behind a peer gate: the caller, as the kernel named
        it, must be allowed (crust.common.peergate); it is then known to the
        servicer as `caller`. A refusal is one warning line."""
        if self.peer_policy is None:
            return
        try:
            caller.set(self.peer_policy.check(context.peer()))
        except CrustError as exc:
            log.warning("failed", extra={"fields": {"component": self.component, "code": exc.code.name,
                                                    "error": exc.message}})
            await context.abort(exc.code, exc.message)


def bind_unix(server: grpc.aio.Server, endpoint: str, mode: int = 0o600, group: int | None = None) -> str:
    path = socket_path(endpoint)
    prepare_socket_dir(path)
    clear_stale_socket(path)
    # The umask is process-wide; binding happens synchronously right here,
    # before any other thread of ours creates files, so the socket never
    # exists with a looser mode.
    old = os.umask(0o777 & ~mode)
    try:
        server.add_insecure_port("unix://" + path)
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
    return path


def listen_unix(path: str, mode: int = 0o600, group: int | None = None) -> socket.socket:
    """A listening unix socket at path, never looser than mode (see bind_unix)."""
    prepare_socket_dir(path)
    clear_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~mode)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
    sock.listen(listen_backlog())
    sock.setblocking(False)
    return sock


class Daemon:
    """A gRPC server on a unix socket with health, reflection and graceful stop."""

    def __init__(self, component: str, endpoint: str, service_names: Iterable[str], *,
                 max_request_bytes: int | None = None, socket_mode: int = 0o600, socket_group: int | None = None,
                 peer_policy: PeerPolicy | None = None):
        self.component = component
        self.endpoint = endpoint
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        options = [("grpc.max_receive_message_length", max_request_bytes)] if max_request_bytes else []
        # With a peer policy the endpoint is a gate (crust.common.peergate)
        # and gRPC listens behind it on a root-only inner socket.
        self.peer_policy = peer_policy
        self.gate: PeerGate | None = None
        self.interceptor = CrustInterceptor(component, peer_policy)
        self.server = grpc.aio.server(interceptors=[self.interceptor], options=options)
        # Handlers consulted after every registered service (the shim's
        # passthrough): they would otherwise shadow health and reflection.
        self.fallback_handlers: list[grpc.GenericRpcHandler] = []
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.service_names = list(service_names)
        self.stopping = asyncio.Event()
        self.socket_path: str | None = None

    async def start(self) -> None:
        memory.start_trimming()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = self.service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        if self.fallback_handlers:
            self.server.add_generic_rpc_handlers(tuple(self.fallback_handlers))
        if self.peer_policy is None:
            self.socket_path = bind_unix(self.server, self.endpoint, self.socket_mode, self.socket_group)
            await self.server.start()
        else:
            public = socket_path(self.endpoint)
            prepare_socket_dir(public)
            inner = inner_socket_path(public)
            bind_unix(self.server, inner, 0o600)
            await self.server.start()
            self.gate = PeerGate(public, inner)
            await self.gate.start(listen_unix(public, self.socket_mode, self.socket_group))
            self.socket_path = public
        for name in self.service_names + [""]:
            await _maybe_await(self.health.set(name, health_pb2.HealthCheckResponse.SERVING))
        log.info("serving", extra={"fields": {"component": self.component, "socket": self.socket_path}})

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

    async def stop(self, grace: float = 5.0) -> None:
        await _maybe_await(self.health.enter_graceful_shutdown())
        # Let the calls in flight finish (up to grace), then stop at once:
        # waiting on idle client connections would only delay every restart.
        try:
            await asyncio.wait_for(self.interceptor.idle.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("stopping with calls still in flight", extra={"fields": {"calls": self.interceptor.in_flight}})
        if self.gate is not None:
            await self.gate.stop()
        await self.server.stop(0.2)
        paths = [self.socket_path] if self.socket_path else []
        if self.gate is not None:
            paths.append(self.gate.inner_path)
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        log.info("stopped", extra={"fields": {"component": self.component}})

    async def run_until_signal(self, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        await self.start()
        self.install_signal_handlers()
        await self.stopping.wait()
        if on_stop:
            await on_stop()
        await self.stop()


def unary_handlers(service: str, implementation, methods: dict[str, tuple[type, type]]) -> grpc.GenericRpcHandler:
    """A handler serving only the named unary methods of `service` from
    `implementation`; other methods of the service fall through to the next
    handler (the shim registers its passthrough after these)."""
    return grpc.method_handlers_generic_handler(service, {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(implementation, name), request_deserializer=req.FromString,
            response_serializer=rsp.SerializeToString)
        for name, (req, rsp) in methods.items()
    })


async def _maybe_await(value):
    if asyncio.iscoroutine(value):
        return await value
    return value
