"""The handler's side of a pod's processes on the guest's Python agent
(crust/kata/agent/calls.py), against the agent run as a process on the
host (no VM): a process of the guest (container "", as a sandbox's own
process is), its two streams arrive merged as chunks at their offsets, its
input by offset, its exit pushed to a watch; the agent's
refusals become the handler's errors with their codes, and output the
guest no longer has ends the stream with DATA_LOSS."""

from __future__ import annotations

import asyncio

import pytest

from crust.api import agent_pb2
from crust.common.errors import DataLoss, InvalidArgument, Unimplemented
from crust.kata.agent import calls
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import agent  # noqa: F401 - a fixture

Stream = calls.Stream
ENV = ["PATH=/usr/bin:/bin"]


def shell(script: str) -> dict:
    return {"args": ["sh", "-c", script], "env": ENV, "cwd": "/"}


def cut(why: str) -> DataLoss:
    return DataLoss(f"cut: {why}")


async def collect(client: AgentClient, container_id: str, exec_id: str = "", out: int = 0,
                  err: int = 0) -> dict[int, bytes]:
    streams = {Stream.STDOUT: bytearray(), Stream.STDERR: bytearray()}
    offsets = {Stream.STDOUT: out, Stream.STDERR: err}
    async for chunk in calls.read_output(client, container_id, exec_id, out, err, cut):
        assert chunk.offset == offsets[chunk.stream], chunk
        streams[chunk.stream] += chunk.data
        offsets[chunk.stream] += len(chunk.data)
    return {k: bytes(v) for k, v in streams.items()}


def test_a_containers_process_streams_and_exit_through_the_agent(agent):  # noqa: F811
    async def main():
        client, _details = await AgentClient.open(str(agent))
        exits = calls.ExitWatches()
        try:
            # A process of the guest itself (container "").
            script = "head -c 3000000 /dev/zero | tr '\\0' o; printf 'to stderr' >&2; read line; echo \"got $line\"; exit 5"
            pid = await calls.exec_process(client, "", "guest-1", shell(script), stdin=True)
            assert pid > 0
            recorded = []

            async def on_exit(answer, why):
                recorded.append((answer.exit_code if answer else None, why))

            exits.watch(client, "", "guest-1", on_exit)
            ended = exits.ended("", "guest-1")
            assert ended is not None and not ended.is_set()
            # Input by offset: a resend of what was written writes nothing twice.
            assert await calls.write_input(client, "", "guest-1", 0, b"hel", close=False) == 3
            assert await calls.write_input(client, "", "guest-1", 0, b"hello\n", close=True) == 6
            streams = await collect(client, "", "guest-1")
            await asyncio.wait_for(ended.wait(), 10)
            # The watch recorded the exit once, and forgot itself.
            assert recorded == [(5, "")] and exits.ended("", "guest-1") is None
            # Both streams whole, each chunk at its offset.
            assert streams[Stream.STDOUT] == b"o" * 3000000 + b"got hello\n"
            assert streams[Stream.STDERR] == b"to stderr"
            # Forgotten: what the last answers carried, never acknowledged by
            # a read past it, is counted (none when an answer of the end alone
            # came last); a second removal finds nothing.
            assert 0 <= await calls.remove_process(client, "", "guest-1") <= 3000010 + 9
            assert await calls.remove_process(client, "", "guest-1") == 0
            # Read once and never past: every byte counted as unread.
            await calls.exec_process(client, "", "guest-4", shell("printf 12345"), stdin=False)
            await calls.wait_process(client, "", "guest-4")
            answer = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="guest-4", max_bytes=100))
            assert (answer.offset, answer.data) == (0, b"12345")
            assert await calls.remove_process(client, "", "guest-4") == 5

            # An exec into a container of an agent with no OCI runtime (this
            # one, on the host): UNIMPLEMENTED, with the agent's words.
            with pytest.raises(Unimplemented) as missing:
                await calls.exec_process(client, "nobody", "e1", shell("true"), stdin=False)
            assert "exec e1 of container nobody" in missing.value.message, missing.value.message
            assert "process.exec absent" in missing.value.message, missing.value.message
            # A bad id: INVALID_ARGUMENT naming the field.
            with pytest.raises(InvalidArgument) as bad:
                await calls.exec_process(client, "", "guest 2", shell("true"), stdin=False)
            assert "exec_id" in bad.value.message
            # Output of a process the guest no longer has ends as a cut, never as if whole.
            with pytest.raises(DataLoss) as lost:
                await collect(client, "", "guest-1")
            assert lost.value.message.startswith("cut:")

            # A process that never ends is signalled; its watch records the signal's exit.
            await calls.exec_process(client, "", "guest-3", shell("exec sleep 600"), stdin=False)
            exits.watch(client, "", "guest-3", on_exit)
            ended = exits.ended("", "guest-3")
            assert await calls.signal_process(client, "", "guest-3", 9) == 1
            await asyncio.wait_for(ended.wait(), 10)
            assert recorded[-1] == (137, "")
        finally:
            await exits.close()
            await client.close()

    asyncio.run(main())
