"""The host's side of the guest agent's protocol (specs/agent.proto): a
ttrpc client whose calls are named as the service names them.

    client = await AgentClient.connect(path)  # the port's unix socket
    details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest())

Calls overlap on the one connection (the agent serves each as its own
task), so a WaitProcess that blocks for an hour delays nothing else. A
call's timeout is sent to the guest too (ttrpc's timeout_nano), which ends
its wait there with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio

from google.protobuf import message as pb_message
from google.protobuf import message_factory

from crust.api import agent_pb2
from crust.common import ttrpc

SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]


class AgentClient:
    def __init__(self, client: ttrpc.Client):
        self._client = client
        self._responses = {m.name: message_factory.GetMessageClass(m.output_type) for m in SERVICE.methods}

    @classmethod
    async def connect(cls, path: str) -> AgentClient:
        return cls(await ttrpc.Client.connect(path))

    @property
    def closed(self) -> bool:
        return self._client.closed

    async def call(self, method: str, request: pb_message.Message, timeout: float | None = None):
        response_type = self._responses.get(method)
        if response_type is None:
            raise ValueError(f"AgentService has no call {method!r}")
        return await self._client.call(SERVICE.full_name, method, request, response_type, timeout=timeout)

    async def close(self) -> None:
        await self._client.close()


async def wait_port_open(qmp, chardev: str = "port", timeout: float = 60.0) -> None:
    """Until the guest's agent has its virtio-serial port open (QEMU's
    query-chardev: frontend-open). What the host sends before that, the
    guest's kernel drops."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        for device in await qmp.execute("query-chardev"):
            if device.get("label") == chardev and device.get("frontend-open"):
                return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the guest did not open its agent port within {timeout:g} s")
        await asyncio.sleep(0.05)
