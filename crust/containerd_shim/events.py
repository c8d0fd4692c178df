"""Task events to containerd (specs/containerd_events*.proto).

A shim tells containerd what happened to its tasks by forwarding events to
containerd's ttrpc socket (the TTRPC_ADDRESS containerd started the shim
with): service containerd.services.events.ttrpc.v1.Events, method Forward,
an Envelope with the time, the namespace, the topic and the event as an Any
whose type_url is the event's full protobuf name. CRI learns a container's
exit from /tasks/exit.

Events go out in order from one queue. While containerd is away (restarted)
they wait and are sent once it answers again: an exit that happened
meanwhile still reaches CRI. The queue is bounded; past the bound the oldest
event is dropped with a log line (containerd also asks the shim for state
when it comes back).
"""

from __future__ import annotations

import asyncio
import logging
import time

from google.protobuf import any_pb2, empty_pb2, timestamp_pb2
from google.protobuf import message as pb_message

from crust.api import containerd_events_pb2 as events
from crust.api import containerd_events_ttrpc_pb2 as events_ttrpc
from crust.common.ttrpc import NAMESPACE_KEY, TtrpcError
from crust.common.ttrpc_client import Client

log = logging.getLogger(__name__)

SERVICE = "containerd.services.events.ttrpc.v1.Events"
TOPICS = {
    events.TaskCreate: "/tasks/create",
    events.TaskStart: "/tasks/start",
    events.TaskExit: "/tasks/exit",
    events.TaskDelete: "/tasks/delete",
    events.TaskExecAdded: "/tasks/exec-added",
    events.TaskExecStarted: "/tasks/exec-started",
    events.TaskOOM: "/tasks/oom",
}
QUEUE_BOUND = 4096
RETRY_SECONDS = (0.1, 0.2, 0.5, 1.0)
CALL_TIMEOUT = 10.0


def timestamp(unix_ns: int | None = None) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns() if unix_ns is None else unix_ns)
    return stamp


def envelope(namespace: str, event: pb_message.Message, when_ns: int | None = None) -> events_ttrpc.Envelope:
    wrapped = any_pb2.Any(type_url=event.DESCRIPTOR.full_name, value=event.SerializeToString())
    return events_ttrpc.Envelope(timestamp=timestamp(when_ns), namespace=namespace,
                                 topic=TOPICS[type(event)], event=wrapped)


async def forward(client: Client, namespace: str, event: pb_message.Message, timeout: float = CALL_TIMEOUT) -> None:
    await client.call(SERVICE, "Forward", events_ttrpc.ForwardRequest(envelope=envelope(namespace, event)),
                      empty_pb2.Empty, timeout=timeout, metadata={NAMESPACE_KEY: namespace})


class Publisher:
    """Sends events to containerd in order, waiting out containerd's absence."""

    def __init__(self, ttrpc_address: str, namespace: str):
        self.path = ttrpc_address.removeprefix("unix://")
        self.namespace = namespace
        self._queue: asyncio.Queue[events_ttrpc.Envelope] = asyncio.Queue()
        self._client: Client | None = None
        self._sender: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def publish(self, event: pb_message.Message) -> None:
        if not self.path:
            return  # started without containerd (a test of the task service alone)
        if self._queue.qsize() >= QUEUE_BOUND:
            dropped = self._queue.get_nowait()
            log.warning("event queue full; dropped the oldest", extra={"fields": {"topic": dropped.topic}})
        self._queue.put_nowait(envelope(self.namespace, event))
        self._idle.clear()
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_all())

    async def drain(self, timeout: float) -> bool:
        """Wait until every queued event was sent; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    async def _send_all(self) -> None:
        attempt = 0
        while not self._queue.empty():
            item = self._queue._queue[0]  # sent first, removed once containerd took it
            try:
                if self._client is None or self._client.closed:
                    self._client = await Client.connect(self.path, {NAMESPACE_KEY: self.namespace})
                await self._client.call(SERVICE, "Forward", events_ttrpc.ForwardRequest(envelope=item),
                                        empty_pb2.Empty, timeout=CALL_TIMEOUT)
            except (OSError, TtrpcError) as exc:
                if isinstance(exc, TtrpcError) and exc.code not in (4, 14):
                    # containerd refused this event itself: retrying cannot help.
                    log.error("containerd refused an event", extra={"fields": {"topic": item.topic, "error": str(exc)}})
                    self._queue.get_nowait()
                    continue
                if self._client is not None:
                    await self._client.close()
                    self._client = None
                delay = RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)]
                if attempt == 0:
                    log.info("containerd's event service does not answer; events wait",
                             extra={"fields": {"topic": item.topic, "error": str(exc)}})
                attempt += 1
                await asyncio.sleep(delay)
                continue
            attempt = 0
            self._queue.get_nowait()
        self._idle.set()

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        if self._client is not None:
            await self._client.close()
