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
call; measured in docs/performance.md). For any other method the handler
cannot know whether it streams, so it looks at the caller: a unary caller
sends its one message and its half-close together, and is forwarded as a
unary request; any other caller is forwarded as a bidirectional stream. Both
forward any number of responses.

The answers that describe the plugin rather than a volume (its name and
capabilities, the node's id and topology) are kept once the backend has
given them, for as long as the connection that carried them lasts; see
PluginAnswers.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from crust.api import csi_pb2
from crust.common.grpcserver import PLUGIN_METHODS, fail

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
    backend work on after its caller had given up; two units and a little
    slack off keep its deadline within the caller's.
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


_READY = grpc.ChannelConnectivity.READY

# The longest a kept answer is served. The connection only says that the
# next hop did not change: behind a shim, the plugin it wraps may restart
# while the proxy's connection to the shim lasts, and its new answers reach
# the proxy's callers within this time.
PLUGIN_ANSWER_SECONDS = 2.0


class PluginAnswers:
    """The backend's successful answers to PLUGIN_METHODS, each kept for as
    long as the connection it came over lasts, and PLUGIN_ANSWER_SECONDS at
    most. A plugin gives these answers for as long as it runs (the CSI
    sidecars read them once per connection), and a plugin restarted, perhaps
    as a newer version, is reached over a new connection.

    A watch on the channel's connectivity ends the current connection's
    answers at any change of state: a backend that stops, restarts or is
    replaced leaves READY first, so its next answer is asked for again. An
    answer is only kept when the state was READY and unchanged from before
    the call was sent until its answer arrived, and only served while the
    state is READY. Only answers to empty requests (these methods' requests
    have no fields) are kept: at most one per method, whatever a caller
    sends. Errors and answers that carry metadata are never kept (the caller
    gets exactly what the backend sent). Probe is not a plugin method: it
    always reaches the backend.
    """

    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.epoch = 0  # the connection's generation; +1 at every change of state
        # method -> (epoch, monotonic expiry, answer bytes)
        self.answers: dict[str, tuple[int, float, bytes]] = {}
        self._watching = False
        self._watcher: asyncio.Task | None = None

    def _watch_started(self) -> bool:
        """Whether changes of state are being watched (starting the watch if
        not): nothing is kept or served before the watch is in place."""
        if self._watcher is None:
            self._watcher = asyncio.ensure_future(self._watch())
        return self._watching

    async def _watch(self) -> None:
        try:
            state = self.channel.get_state()
            while True:
                # The watch is registered before this coroutine first
                # suspends, so no change after the state read above is missed.
                self._watching = True
                await self.channel.wait_for_state_change(state)
                self.epoch += 1
                self.answers.clear()
                state = self.channel.get_state()
        except Exception as exc:  # noqa: BLE001 - a closed channel ends the watch
            log.debug("stopped watching the backend's connection: %r", exc)
        finally:
            # Without a watch nothing is kept or served any more.
            self._watching = False
            self.answers.clear()
            self.epoch += 1

    def kept(self, method: str, request: bytes) -> bytes | None:
        """The answer kept for this request on the current connection, if any."""
        if request or not self._watch_started():
            return None
        entry = self.answers.get(method)
        if entry is None:
            return None
        epoch, expiry, answer = entry
        if epoch != self.epoch or time.monotonic() >= expiry or self.channel.get_state() is not _READY:
            return None
        return answer

    def ticket(self) -> int | None:
        """Taken before a call is sent: the connection it may be kept for."""
        if not self._watch_started() or self.channel.get_state() is not _READY:
            return None
        return self.epoch

    def keep(self, ticket: int | None, method: str, request: bytes, response: bytes) -> None:
        if not request and ticket is not None and ticket == self.epoch and self.channel.get_state() is _READY:
            self.answers[method] = (ticket, time.monotonic() + PLUGIN_ANSWER_SECONDS, response)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


def unary_forwarder(channel: grpc.aio.Channel, method: str,
                    plugin_answers: PluginAnswers | None = None) -> grpc.RpcMethodHandler:
    """A raw unary handler forwarding `method` to `channel`; answers taken
    from and kept in `plugin_answers` when given."""
    # Made once per method, not per call.
    backend = channel.unary_unary(method, request_serializer=None, response_deserializer=None)

    async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ticket = None
        if plugin_answers is not None:
            answer = plugin_answers.kept(method, request)
            if answer is not None:
                return answer
            ticket = plugin_answers.ticket()
        call = backend(request, timeout=forward_timeout(context), metadata=forwardable_metadata(context))
        try:
            response = await call
        except grpc.aio.AioRpcError as exc:
            log.debug("backend answered %s for %s", exc.code().name, method)
            fail(context, exc.code(), exc.details() or "", exc.trailing_metadata())
            return b""
        # Both arrived with the answer (one batch): awaiting them does not
        # wait. Only a backend that sends metadata costs an extra operation.
        initial = await call.initial_metadata()
        if initial:
            await context.send_initial_metadata(initial)
        trailing = await call.trailing_metadata()
        if trailing:
            context.set_trailing_metadata(trailing)
        if plugin_answers is not None and not initial and not trailing:
            plugin_answers.keep(ticket, method, request, response)
        return response

    return grpc.unary_unary_rpc_method_handler(forward, request_deserializer=None, response_serializer=None)


class Passthrough(grpc.GenericRpcHandler):
    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.plugin_answers = PluginAnswers(channel)
        self.unary = {method: unary_forwarder(channel, method,
                                              self.plugin_answers if method in PLUGIN_METHODS else None)
                      for method in unary_methods()}

    def close(self) -> None:
        """Stop watching the channel (before it is closed)."""
        self.plugin_answers.close()

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
                fail(context, exc.code(), exc.details() or "", exc.trailing_metadata())
            finally:
                if following is not None and not following.done():
                    following.cancel()

        return grpc.stream_stream_rpc_method_handler(forward, request_deserializer=None, response_serializer=None)
