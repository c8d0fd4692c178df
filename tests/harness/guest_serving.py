"""The guest agent's service served in the test's own event loop over
ttrpc on a unix socket, with the host's AgentClient: a service built with
stand-ins for the guest's directories (a disk's serials, the pod's cgroup)
on real files, devices and sockets."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from crust.guest.agent import make_server, serve_socket
from crust.guest.service import AgentService
from crust.kata.agent.client import AgentClient


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, service: AgentService):
    """(client, its GetGuestDetails answer) of the service, stopped and closed after."""
    server = make_server(service)
    stopping = asyncio.Event()
    path = tmp_path / "agent.sock"
    task = asyncio.create_task(serve_socket(server, str(path), stopping))
    while not path.exists():
        await asyncio.sleep(0.01)
    client, details = await AgentClient.open(str(path), timeout=10)
    try:
        yield client, details
    finally:
        await client.close()
        stopping.set()
        await task
        await server.close()
        await service.close()
