"""Byte-level forwarding of every RPC the shim (or the proxy) does not change.

The handler is registered last, so it only sees methods no servicer claims,
including methods of a newer CSI than this one. Requests and responses are
forwarded as raw bytes (no deserialisation), with the caller's metadata and
remaining deadline; the backend's initial and trailing metadata, status code
and message come back unchanged.

Methods the CSI proto declares unary (all but SnapshotMetadata's two) are
served as unary calls on both sides, from handlers and client stubs built
once: one batch of operations each way per call, which is what a hop costs
least (a stream handler costs several more completion-queue round trips per
call; measured in docs/benchmarks.md). For any other method the handler
cannot know whether it streams, so it looks at the caller: a unary caller
sends its one message and its half-close together, and is forwarded as a
unary request; any other caller is forwarded as a bidirectional stream. Both
forward any number of responses.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from crust.api import csi_pb2

log = logging.getLogger(__name__)

_EOF = object()
# How long to wait, after a caller's first message, for its half-close before
# forwarding the call as a stream. A unary caller's half-close comes with its
# message, so for unary calls the wait ends at once.
_HALF_CLOSE_WAIT = 0.05


async def _next(requests):
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return _EOF


# Headers that belong to the transport, not to the caller.
_HOP_BY_HOP = ("user-agent", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout", "te", "content-type")


def forward_timeout(context: grpc.aio.ServicerContext) -> float | None:
    """The timeout to give the next hop: the caller's remaining time, less
    what gRPC's wire encoding can add.

    grpc-timeout is sent rounded UP to a unit that grows with the value (1 ms
    under 1 s, 10 ms under 10 s, 100 ms under 100 s, 1 s under 1000 s, ...),
    so the deadline we received may already be one unit late and ours would
    be rounded up once more. Forwarding time_remaining() as is let the
    backend work on after its caller had given up (measured: +19 ms on a 5 s
    call); two units and a little slack off keep its deadline within the
    caller's.
    """
    remaining = context.time_remaining()
    if remaining is None:
        return None
    unit = 0.001
    while unit < 3600 and remaining >= unit * 1000:
        unit *= 10
    return max(remaining - 2 * unit - 0.005, 0.001)


def forwardable_metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in (context.invocation_metadata() or ())
            if not k.startswith(":") and k not in _HOP_BY_HOP]


def unary_methods() -> list[str]:
    """Full names (/csi.v1.Service/Method) of the CSI methods that are unary both ways."""
    return [f"/{service.full_name}/{method.name}"
            for service in csi_pb2.DESCRIPTOR.services_by_name.values()
            for method in service.methods
            if not method.client_streaming and not method.server_streaming]


def unary_forwarder(channel: grpc.aio.Channel, method: str) -> grpc.RpcMethodHandler:
    """A raw unary handler forwarding `method` to `channel`."""
    # Made once per method, not per call.
    backend = channel.unary_unary(method, request_serializer=None, response_deserializer=None)

    async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        call = backend(request, timeout=forward_timeout(context), metadata=forwardable_metadata(context))
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            log.debug("backend answered %s for %s", exc.code().name, method)
            # abort() takes trailing metadata as a tuple only: grpc.aio's
            # Metadata object made a backend's error with trailers UNKNOWN.
            await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
        # Both arrived with the answer (one batch): awaiting them does not
        # wait. Only a backend that sends metadata costs an extra operation.
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(initial)
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        return response

    return grpc.unary_unary_rpc_method_handler(forward, request_deserializer=None, response_serializer=None)


class Passthrough(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.unary = {method: unary_forwarder(channel, method) for method in unary_methods()}

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        known = self.unary.get(method)
        if known is not None:
            return known
        channel = self.channel

        async def forward(request_iterator, context: grpc.aio.ServicerContext):
            requests = request_iterator.__aiter__()
            first = await _next(requests)
            following = None
            if first is not _EOF:
                following = asyncio.ensure_future(_next(requests))
                await asyncio.wait({following}, timeout=_HALF_CLOSE_WAIT)
            kw = {"timeout": forward_timeout(context), "metadata": forwardable_metadata(context)}
            if following is not None and following.done() and following.result() is _EOF:
                # Unary request: metadata, message and half-close leave in one
                # batch. Streaming it instead hits grpc-python issue #36066: a
                # write that loses the race with a backend answering early
                # (UNIMPLEMENTED is sent before the request is read) replaces
                # the backend's status with INTERNAL "Internal error from Core".
                call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(
                    first, **kw)
            else:
                async def replay():
                    if first is _EOF:
                        return
                    yield first
                    item = await following
                    while item is not _EOF:
                        yield item
                        item = await _next(requests)

                call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(
                    replay(), **kw)
            try:
                initial = await call.initial_metadata()
                if initial:
                    await context.send_initial_metadata(initial)
                async for response in call:
                    yield response
                trailing = await call.trailing_metadata()
                if trailing:
                    context.set_trailing_metadata(trailing)
            except grpc.aio.AioRpcError as exc:
                log.debug("backend answered %s for %s", exc.code().name, method)
                await context.abort(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))
            finally:
                if following is not None and not following.done():
                    following.cancel()

        return grpc.stream_stream_rpc_method_handler(forward, request_deserializer=None, response_serializer=None)
