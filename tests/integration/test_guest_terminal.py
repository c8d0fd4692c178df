"""An exec on a terminal through the guest agent (crust/guest/terminal.py):
the agent's enter program (or crun) makes the terminal in the container and
hands its master over; the agent reads the process's output from it, writes its
input to it and sets its size. Run on the host beside a real crun
(tests/harness/guest_container.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import (  # noqa: F401 - pod_cgroup_cleaned: a fixture
    ContainerAgent, code_of, container_spec, crun_container_agent, parent_of, pod_cgroup_cleaned)

pytestmark = pytest.mark.usefixtures("pod_cgroup_cleaned")

SCRIPT = "tty; stat -c 'owner %u' $(tty); stty size; read line; echo got $line; stty size; exit 4"


async def _read_until(client: AgentClient, key: dict, wanted: bytes, offset: int = 0) -> tuple[bytes, int]:
    """The output from offset on, read until it holds wanted."""
    out = b""
    while wanted not in out:
        answer = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=4096, offset=offset, **key),
                                   timeout=30)
        assert not answer.eof or wanted in out + answer.data, out + answer.data
        out += answer.data
        offset = answer.offset + len(answer.data)
    return out, offset


async def _converse(client: AgentClient, key: dict) -> tuple[bytes, bytes, agent_pb2.WaitProcessResponse]:
    """SCRIPT's run on its terminal: its size read, the terminal resized,
    a line typed, the new size read, its exit."""
    first, offset = await _read_until(client, key, b"24 80")
    await client.call("TtyWinResize", agent_pb2.TtyWinResizeRequest(rows=30, columns=100, **key), timeout=10)
    await client.call("WriteStdin", agent_pb2.WriteStreamRequest(data=b"hello\r", **key), timeout=10)
    rest, _ = await _read_until(client, key, b"30 100", offset)
    return first, rest, await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)


@pytest.mark.parametrize("path", ["enter", "crun"])
def test_an_exec_on_a_terminal_is_read_written_and_resized_through_its_master(tmp_path, path):
    """The agent's enter program makes the terminal; crun does for a
    process enter leaves to it (one that names no capabilities)."""
    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            # An id as long as containerd's: the console socket's path must not grow with it.
            key = {"container_id": c.container_id, "exec_id": "e" * 64}
            process = copy.deepcopy(c.spec["process"])
            process.update(args=["sh", "-c", SCRIPT], terminal=True, consoleSize={"height": 24, "width": 80})
            if path == "crun":
                del process["capabilities"]
            process["user"] = {"uid": 1000, "gid": 1000}
            pid = (await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                process=json.dumps(process).encode(), stdin=True, **key), timeout=30)).pid
            parent = parent_of(pid)   # the script waits for its line meanwhile
            first, rest, exit_ = await _converse(client, key)
            err = await client.call("ReadStderr", agent_pb2.ReadStreamRequest(max_bytes=4096, **key), timeout=10)
            gone = await code_of(client.call("TtyWinResize", agent_pb2.TtyWinResizeRequest(
                rows=30, columns=100, **key), timeout=10))
            bad = await code_of(client.call("TtyWinResize", agent_pb2.TtyWinResizeRequest(
                rows=0, columns=100, **key), timeout=10))
            await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(**key), timeout=10)
            return details, parent, first, rest, exit_, err, gone, bad
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        details, parent, first, rest, exit_, err, gone, bad = asyncio.run(main(c))
        agent_pid = c.agent_pid
    assert "process.terminal" in details.capabilities
    assert (parent == agent_pid) == (path == "enter"), (parent, agent_pid)
    if path == "enter":   # the terminal is the process's user's, as runc leaves it (crun leaves it root's)
        assert b"\r\nowner 1000\r\n" in first, first
    assert first.startswith(b"/dev/pts/") and b"\r\n24 80\r\n" in first, first
    assert b"got hello\r\n30 100\r\n" in rest, rest   # the terminal echoes the input before it
    assert (exit_.exit_code, exit_.output_complete, err.data) == (4, True, b"")
    assert gone[0] == ttrpc.FAILED_PRECONDITION and bad == (ttrpc.INVALID_ARGUMENT, "rows: 0 is not 1..65535")


def test_a_containers_own_process_on_a_terminal_is_read_written_and_resized(tmp_path, pod_cgroup_cleaned):  # noqa: F811
    cid = "c" * 63 + str(os.getpid() % 10)

    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            key = {"container_id": cid, "exec_id": ""}
            spec = json.loads(container_spec(c, cid, "sh", "-c", SCRIPT))
            spec["process"].update(terminal=True, consoleSize={"height": 24, "width": 80})
            await client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, stdin=True, oci_spec=json.dumps(spec).encode()), timeout=30)
            await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=cid), timeout=30)
            first, rest, exit_ = await _converse(client, key)
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=cid), timeout=30)
            bad = json.loads(container_spec(c, cid, "true"))
            bad["process"]["terminal"] = "yes"
            refused = await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=json.dumps(bad).encode()), timeout=30))
            return details, first, rest, exit_, refused
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        details, first, rest, exit_, refused = asyncio.run(main(c))
        consoles = list((tmp_path / "exec" / ".tty").iterdir())
    assert "container.terminal" in details.capabilities
    assert first.startswith(b"/dev/pts/") and b"\r\n24 80\r\n" in first, first
    assert b"got hello\r\n30 100\r\n" in rest, rest
    assert (exit_.exit_code, exit_.output_complete) == (4, True)
    assert refused == (ttrpc.INVALID_ARGUMENT, "oci_spec.process.terminal: not a boolean")
    assert consoles == []


@pytest.mark.parametrize("path", ["enter", "crun"])
def test_a_quick_process_on_a_terminal_leaves_its_output_whole(tmp_path, path):
    """A process that writes and exits at once: its terminal's master ends
    in EIO right behind the output, which must still reach the stream
    (critest's exec with tty=true runs `echo -n hello`)."""
    async def main(c: ContainerAgent) -> list[bytes]:
        client = await AgentClient.connect(str(c.socket))
        outs = []
        try:
            for i in range(30):
                key = {"container_id": c.container_id, "exec_id": f"quick-{i}"}
                process = copy.deepcopy(c.spec["process"])
                process.update(args=["echo", "-n", "hello"], terminal=True)
                if path == "crun":
                    del process["capabilities"]
                await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                    process=json.dumps(process).encode(), stdin=True, **key), timeout=30)
                await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)
                outs.append((await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=4096, **key),
                                                timeout=10)).data)
                await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(**key), timeout=10)
        finally:
            await client.close()
        return outs

    with crun_container_agent(tmp_path) as c:
        outs = asyncio.run(main(c))
    assert outs == [b"hello"] * 30, outs
