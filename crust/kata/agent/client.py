"""The host's side of the guest agent's protocol (specs/agent.proto): a
ttrpc client whose calls are named as the service names them.

    client = await AgentClient.connect(path)  # the port's unix socket
    details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest())

Calls overlap on the one connection (the agent serves each as its own
task), so a WaitProcess that blocks for an hour delays nothing else. A
call's timeout is sent to the guest too (ttrpc's timeout_nano), which ends
its wait there with DEADLINE_EXCEEDED.

The guest is not trusted to answer: every call has a deadline (call_timeout):
its own, else CALL_TIMEOUT, never past the deadline of the RPC that caused
it (crust.sys.run.rpc_deadline, from the CRI call through the shim) nor of
a pod's stop (stop_deadline). Only the calls that wait in the guest for an
event (LONG_WAITS) have none of their own: they end with the VM, and no
stop waits on them. A call left unanswered during a stop is the guest's
silence: on_silent is told (the VM kills its QEMU).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Awaitable, Callable

from google.protobuf import message as pb_message
from google.protobuf import message_factory

from crust.api import agent_pb2
from crust.common import ttrpc, ttrpc_client
from crust.common.errors import CrustError, Internal, error_class
from crust.sys.run import rpc_deadline

log = logging.getLogger(__name__)

SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]
# How long a host that came back too soon stays away before it tries again:
# longer than the guest takes to see a host leave.
RECONNECT_PAUSE = 0.05
# An agent that runs answers a new connection's first call within
# milliseconds; one sent the moment the host connects may go unanswered
# (the guest may see the host's bytes before it sees the host connected).
# The host then leaves and comes back with the call again instead of
# waiting it out.
FIRST_ANSWER_TIMEOUT = 2.0
# The longest a call without a timeout of its own waits for its answer.
CALL_TIMEOUT = 120.0
# The calls that wait in the guest for something to happen (a process's
# exit, more of its output): they last as long as that, and end when the VM
# ends (its connection closes). Nothing a CRI call waits for is one of them.
LONG_WAITS = frozenset({"WaitProcess", "ReadStdout", "ReadStderr"})
# What a call is still given when its deadline has (nearly) passed: it
# fails at once, without a guest's answer being taken for granted.
MIN_TIMEOUT = 0.05
# The absolute (monotonic) deadline of the pod's stop being served
# (crust.kata.agent.stop_bound): every call made for it ends by then, and one left
# unanswered kills the VM.
stop_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("stop_deadline", default=None)


def call_timeout(method: str, timeout: float | None, now: float) -> float | None:
    """How long a call waits for its answer: its own timeout (CALL_TIMEOUT
    without one; none for LONG_WAITS, which the tasks that watch a process
    make, whatever RPC started them), never past the RPC's deadline or the
    stop's."""
    if timeout is None and method in LONG_WAITS:
        return None
    limit = CALL_TIMEOUT if timeout is None else timeout
    for deadline in (rpc_deadline.get(), stop_deadline.get()):
        if deadline is not None:
            limit = min(limit, max(MIN_TIMEOUT, deadline - now))
    return limit

# The codes of the agent's answers (specs/agent.proto) that the handler
# passes on as its error of the same code. Any other is the agent's bug as
# the host sees it (INTERNAL): ABORTED and UNKNOWN it never answers, and its
# one PERMISSION_DENIED (a passphrase, OpenEncrypted) is the caller's to say.
PASSED_ON = frozenset({
    ttrpc.INVALID_ARGUMENT, ttrpc.NOT_FOUND, ttrpc.ALREADY_EXISTS, ttrpc.FAILED_PRECONDITION, ttrpc.OUT_OF_RANGE,
    ttrpc.RESOURCE_EXHAUSTED, ttrpc.DEADLINE_EXCEEDED, ttrpc.UNIMPLEMENTED, ttrpc.UNAVAILABLE, ttrpc.DATA_LOSS,
})


# The most of a guest's words (an error message, its agent's name) the
# handler quotes in a log line or an error: the guest is not trusted to be
# brief (a ttrpc frame holds 4 MiB).
GUEST_TEXT_CHARS = 1000
_CONTROL = {c: " " for c in range(32) if c != 9} | {127: " "}


def guest_text(text: str, limit: int = GUEST_TEXT_CHARS) -> str:
    """A guest's words as the host quotes them: one line of at most limit
    characters (control characters as spaces), saying how much was cut."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text) - limit} more characters)"
    return text.translate(_CONTROL)


def handler_error(exc: ttrpc.TtrpcError, what: str) -> CrustError:
    """The agent's refusal as the handler's error of the same code."""
    kind = error_class(exc.code) if exc.code in PASSED_ON else Internal
    return kind(f"{what}: the guest's agent: {guest_text(exc.message)}")


class AgentClient:
    def __init__(self, client: ttrpc_client.Client):
        self._client = client
        # Told why, when the guest left a call of a stop unanswered.
        self.on_silent: Callable[[str], Awaitable[None]] | None = None
        self._responses = {m.name: message_factory.GetMessageClass(m.output_type) for m in SERVICE.methods}

    @classmethod
    async def connect(cls, path: str) -> AgentClient:
        return cls(await ttrpc_client.Client.connect(path))

    @classmethod
    async def open(cls, path: str, timeout: float = 30.0) -> tuple[AgentClient, agent_pb2.GuestDetailsResponse]:
        """A connection the agent serves as new, with its first call's
        answer. A port has no connections of its own: a host that comes
        back before the agent saw it leave meets the old connection's
        stream ids (its first call refused as a reused id); it leaves again,
        long enough for the agent to see it, and comes back. A first call
        left unanswered (FIRST_ANSWER_TIMEOUT) is asked again the same way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = RECONNECT_PAUSE
        while True:
            client = await cls.connect(path)
            wait = max(min(FIRST_ANSWER_TIMEOUT, deadline - loop.time()), RECONNECT_PAUSE)
            try:
                details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=wait)
                return client, details
            except ttrpc.TtrpcError as exc:
                await client.close()
                reused = exc.code == ttrpc.INVALID_ARGUMENT and exc.message == ttrpc.STREAM_ID_REUSED
                if not (reused or exc.code == ttrpc.DEADLINE_EXCEEDED) or loop.time() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause *= 2

    @property
    def closed(self) -> bool:
        return self._client.closed

    async def call(self, method: str, request: pb_message.Message, timeout: float | None = None):
        response_type = self._responses.get(method)
        if response_type is None:
            raise ValueError(f"AgentService has no call {method!r}")
        sent = time.monotonic()
        limit = call_timeout(method, timeout, sent)
        try:
            return await self._client.call(SERVICE.full_name, method, request, response_type, timeout=limit)
        except ttrpc.TtrpcError as exc:
            if exc.code == ttrpc.DEADLINE_EXCEEDED and stop_deadline.get() is not None and \
                    self.on_silent is not None:
                await self.on_silent(f"its guest's agent did not answer {method} within {limit:.3g} s")
            raise
        finally:
            if log.isEnabledFor(logging.DEBUG):
                # A call's round trip: where a pod's start spends its time
                # (bench/runtime/pod_start_microvm.py --agent-times).
                log.debug("agent request", extra={"fields": {"command": method,
                                                             "ms": round((time.monotonic() - sent) * 1e3, 1)}})

    async def close(self) -> None:
        await self._client.close()


PORT_CHARDEV = "port"


async def port_state(qmp, chardev: str = PORT_CHARDEV) -> str:
    """The agent's port as QEMU's query-chardev tells it: "open" (the
    guest's agent opened it: frontend-open), "closed" (not yet), or
    "absent" (a VM started without the port)."""
    for device in await qmp.execute("query-chardev", timeout=5):
        if device.get("label") == chardev:
            return "open" if device.get("frontend-open") else "closed"
    return "absent"


async def wait_port_open(qmp, chardev: str = PORT_CHARDEV, timeout: float = 60.0) -> None:
    """Until the guest's agent has its virtio-serial port open. What the
    host sends before that, the guest's kernel drops."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        if await port_state(qmp, chardev) == "open":
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the guest did not open its agent port within {timeout:g} s")
        await asyncio.sleep(0.05)
