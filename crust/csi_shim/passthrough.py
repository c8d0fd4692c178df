"""Byte-level forwarding of every RPC the shim does not change.

The handler is registered last, so it only sees methods no servicer of the
shim claims, including methods of a newer CSI the shim has never heard of.
Requests and responses are forwarded as raw bytes (no deserialisation), with
the caller's metadata and remaining deadline; the backend's initial and
trailing metadata, status code and message come back unchanged. Every method
is proxied as a bidirectional stream: on the wire a unary call is a stream of
one message, so this forwards unary and streaming methods alike.
"""

from __future__ import annotations

import logging

import grpc

log = logging.getLogger(__name__)

# Headers that belong to the transport, not to the caller.
_HOP_BY_HOP = ("user-agent", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout", "te", "content-type")


def forwardable_metadata(context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in (context.invocation_metadata() or ())
            if not k.startswith(":") and k not in _HOP_BY_HOP]


class Passthrough(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel

    def service(self, details: grpc.HandlerCallDetails):
        method = details.method
        channel = self.channel

        async def forward(request_iterator, context: grpc.aio.ServicerContext):
            call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(
                request_iterator,
                timeout=context.time_remaining(),
                metadata=forwardable_metadata(context),
            )
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
                await context.abort(exc.code(), exc.details() or "", exc.trailing_metadata() or ())

        return grpc.stream_stream_rpc_method_handler(forward, request_deserializer=None, response_serializer=None)
