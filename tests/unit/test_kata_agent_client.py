"""The host's AgentClient.open against the guest agent's service on a unix
socket, reached through a relay that can leave connections unanswered (as
a port may leave a first call sent the moment the host connects): the host
leaves and comes back with its call, and one that never gets an answer
fails with DEADLINE_EXCEEDED within its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.guest.agent import make_server, serve_socket
from crust.guest.service import AgentService
from crust.kata.agent import client as agent_client
from crust.kata.agent.client import AgentClient


@contextlib.asynccontextmanager
async def relayed(tmp_path, swallowed: int):
    """A relay's socket path to the agent's; the first `swallowed`
    connections' bytes are read and dropped, never answered. Yields the
    count of connections the relay took."""
    service = AgentService()
    server = make_server(service)
    stopping = asyncio.Event()
    agent_path = str(tmp_path / "agent.sock")
    serving = asyncio.create_task(serve_socket(server, agent_path, stopping))
    while not os.path.exists(agent_path):
        await asyncio.sleep(0.01)
    taken = []

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def relay(reader, writer):
        taken.append(1)
        if len(taken) <= swallowed:
            while await reader.read(65536):
                pass
            writer.close()
            return
        agent_reader, agent_writer = await asyncio.open_unix_connection(agent_path)
        await asyncio.gather(pipe(reader, agent_writer), pipe(agent_reader, writer))

    relay_path = str(tmp_path / "relay.sock")
    relay_server = await asyncio.start_unix_server(relay, relay_path)
    try:
        yield relay_path, taken
    finally:
        relay_server.close()
        stopping.set()
        await serving
        await server.close()
        await service.close()


def test_a_first_call_left_unanswered_is_asked_again_on_a_new_connection(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_client, "FIRST_ANSWER_TIMEOUT", 0.5)

    async def scenario():
        async with relayed(tmp_path, swallowed=1) as (path, taken):
            client, details = await AgentClient.open(path, timeout=10)
            try:
                assert details.agent_name == "crust-agent" and len(taken) == 2
            finally:
                await client.close()

    asyncio.run(scenario())


def test_an_agent_that_never_answers_is_a_deadline_within_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(agent_client, "FIRST_ANSWER_TIMEOUT", 0.5)

    async def scenario():
        async with relayed(tmp_path, swallowed=1000) as (path, taken):
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TtrpcError) as refused:
                await AgentClient.open(path, timeout=2)
            assert refused.value.code == ttrpc.DEADLINE_EXCEEDED
            assert len(taken) >= 2 and loop.time() - started < 10

    asyncio.run(scenario())
