"""The guest agent (crust/guest/) run on the host, without a VM: a real
`python -m crust.guest --listen` process, real child processes and pipes,
the host's AgentClient over ttrpc. What a VM adds (the virtio-serial port,
the guest's devices) is tested through VMs elsewhere."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.oci import OciRuntime
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import (  # noqa: F401 - agent: a fixture
    REPO,
    agent,
    code_of,
    crun_container_agent,
)


def run(coro):
    return asyncio.run(coro)


def process(*args: str, env=("PATH=/usr/bin:/bin",), **extra) -> bytes:
    return json.dumps({"args": list(args), "env": list(env), "cwd": "/", **extra}).encode()


async def exec_(client, exec_id: str, *args: str, stdin: bool = False) -> int:
    rsp = await client.call("ExecProcess", agent_pb2.ExecProcessRequest(exec_id=exec_id, process=process(*args),
                                                                        stdin=stdin), timeout=10)
    return rsp.pid


async def read_all(client, exec_id: str, method: str = "ReadStdout") -> bytes:
    data, offset = bytearray(), 0
    while True:
        rsp = await client.call(method, agent_pb2.ReadStreamRequest(exec_id=exec_id, offset=offset,
                                                                    max_bytes=1 << 20), timeout=30)
        assert rsp.offset == offset
        data += rsp.data
        offset += len(rsp.data)
        if rsp.eof:
            return bytes(data)


def test_details_name_the_capabilities_and_limits(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        d = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
        await client.close()
        return d
    d = run(main())
    assert {"process.guest", "process.stdin"} <= set(d.capabilities)
    assert d.agent_name == "crust-agent" and d.kernel_release == os.uname().release
    assert d.limits.max_message_bytes == 4 << 20 and 0 < d.limits.max_read_bytes < d.limits.max_message_bytes
    assert d.cpus >= 1 and d.memory_bytes > 0 and d.uptime_ms > 0


def test_an_exit_is_answered_once_its_output_is_whole(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        pid = await exec_(client, "e1", "sh", "-c", "echo out; echo err >&2; exit 3")
        assert pid > 0
        exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="e1"), timeout=10)
        out, err = await read_all(client, "e1"), await read_all(client, "e1", "ReadStderr")
        killed = await exec_(client, "e2", "sleep", "100")
        sent = await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id="e2", signal=9), timeout=5)
        exit2 = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="e2"), timeout=10)
        again = await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id="e2", signal=9), timeout=5)
        await client.close()
        return exit_, out, err, killed, sent, exit2, again
    exit_, out, err, _killed, sent, exit2, again = run(main())
    assert (exit_.exit_code, exit_.signal, exit_.output_complete) == (3, 0, True)
    assert (out, err) == (b"out\n", b"err\n")
    assert (exit_.stdout_length, exit_.stderr_length) == (4, 4)
    assert sent.signalled == 1 and (exit2.exit_code, exit2.signal) == (137, 9) and again.signalled == 0


def test_ten_mib_of_output_arrives_whole_and_the_guest_holds_a_bounded_part(agent):  # noqa: F811
    size = 10 << 20
    script = f"head -c {size} /dev/urandom | tee /dev/stderr | sha256sum >&2"

    async def main():
        client = await AgentClient.connect(str(agent))
        await exec_(client, "big", "sh", "-c", script)
        # Nobody reads: the process is held back once the stream is full.
        await asyncio.sleep(1.5)
        listed = await client.call("ListProcesses", agent_pb2.ListProcessesRequest(), timeout=5)
        out_task = asyncio.ensure_future(read_all(client, "big"))
        err = await read_all(client, "big", "ReadStderr")
        out = await out_task
        exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="big"), timeout=30)
        await client.close()
        return listed, out, err, exit_
    listed, out, err, exit_ = run(main())
    (info,) = listed.processes
    limit = 4 << 20
    assert info.state == agent_pb2.ProcessInfo.RUNNING
    assert info.stderr.length <= limit + (1 << 20), "the agent took more than its bound without a reader"
    # stdout carries nothing; stderr the bytes and their digest.
    assert out == b""
    payload, digest = err[:size], err[size:]
    assert len(payload) == size and digest.split()[0].decode() == hashlib.sha256(payload).hexdigest()
    assert exit_.exit_code == 0 and exit_.output_complete and exit_.stderr_length == len(err)


def test_a_process_that_never_ends_delays_no_other_call(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        await exec_(client, "forever", "sleep", "1000")
        waiting = asyncio.ensure_future(
            client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="forever")))
        reading = asyncio.ensure_future(
            client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="forever", max_bytes=10)))
        quick = [f"q{i}" for i in range(10)]
        await asyncio.gather(*(exec_(client, q, "sh", "-c", f"echo {q}") for q in quick))
        exits = await asyncio.gather(*(client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=q),
                                                   timeout=20) for q in quick))
        outs = await asyncio.gather(*(read_all(client, q) for q in quick))
        # The guest ends a wait at the request's deadline.
        deadline = await code_of(client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="forever"),
                                              timeout=0.3))
        still = (waiting.done(), reading.done())
        await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id="forever", signal=15), timeout=5)
        ended, read = await asyncio.wait_for(asyncio.gather(waiting, reading), 10)
        await client.close()
        return exits, outs, deadline, still, ended, read
    exits, outs, deadline, still, ended, read = run(main())
    assert [e.exit_code for e in exits] == [0] * 10
    assert outs == [f"q{i}\n".encode() for i in range(10)]
    assert deadline[0] == ttrpc.DEADLINE_EXCEEDED
    assert still == (False, False)
    assert (ended.exit_code, ended.signal) == (143, 15) and read.eof and read.data == b""


def test_stdin_is_written_at_offsets_and_a_resend_writes_only_what_is_new(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        await exec_(client, "cat", "cat", stdin=True)
        w1 = await client.call("WriteStdin", agent_pb2.WriteStreamRequest(exec_id="cat", offset=0, data=b"hello "),
                               timeout=5)
        # A resend from 0 with more: only "world" is new.
        w2 = await client.call("WriteStdin", agent_pb2.WriteStreamRequest(exec_id="cat", offset=0,
                                                                          data=b"hello world"), timeout=5)
        past = await code_of(client.call("WriteStdin", agent_pb2.WriteStreamRequest(exec_id="cat", offset=99,
                                                                                    data=b"x"), timeout=5))
        await client.call("CloseStdin", agent_pb2.CloseStdinRequest(exec_id="cat"), timeout=5)
        closed = await code_of(client.call("WriteStdin", agent_pb2.WriteStreamRequest(exec_id="cat", offset=11,
                                                                                      data=b"x"), timeout=5))
        exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="cat"), timeout=10)
        out = await read_all(client, "cat")
        no_stdin = await exec_(client, "nostdin", "true")
        refused = await code_of(client.call("WriteStdin", agent_pb2.WriteStreamRequest(exec_id="nostdin",
                                                                                       data=b"x"), timeout=5))
        await client.close()
        return w1, w2, past, closed, exit_, out, no_stdin, refused
    w1, w2, past, closed, exit_, out, _pid, refused = run(main())
    assert (w1.length, w2.length) == (6, 11)
    assert past[0] == ttrpc.OUT_OF_RANGE and closed[0] == ttrpc.FAILED_PRECONDITION
    assert exit_.exit_code == 0 and out == b"hello world"
    assert refused[0] == ttrpc.FAILED_PRECONDITION and "without stdin" in refused[1]


def test_reads_acknowledge_what_they_pass_and_a_read_below_it_is_data_loss(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        await exec_(client, "p", "sh", "-c", "printf 0123456789")
        await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="p"), timeout=10)
        first = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", offset=0, max_bytes=4),
                                  timeout=5)
        retry = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", offset=0, max_bytes=4),
                                  timeout=5)
        onward = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", offset=4, max_bytes=100),
                                   timeout=5)
        lost = await code_of(client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", offset=2,
                                                                                   max_bytes=4), timeout=5))
        accepted = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", offset=2, max_bytes=4,
                                                                               accept_loss=True), timeout=5)
        past = await code_of(client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", offset=11,
                                                                                   max_bytes=4), timeout=5))
        zero = await code_of(client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p"), timeout=5))
        unread = await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id="p"), timeout=5)
        gone = await code_of(client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="p", max_bytes=1),
                                         timeout=5))
        again = await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id="p"), timeout=5)
        await client.close()
        return first, retry, onward, lost, accepted, past, zero, unread, gone, again
    first, retry, onward, lost, accepted, past, zero, unread, gone, again = run(main())
    assert (first.data, retry.data) == (b"0123", b"0123")
    assert onward.data == b"456789" and onward.eof
    assert lost[0] == ttrpc.DATA_LOSS and "offset" in lost[1]
    assert (accepted.offset, accepted.data) == (4, b"4567")
    assert past[0] == ttrpc.OUT_OF_RANGE and "offset" in past[1]
    assert zero[0] == ttrpc.INVALID_ARGUMENT and "max_bytes" in zero[1]
    assert unread.unread_bytes == 6  # held from 4 (the last read's offset) to 10
    assert gone[0] == ttrpc.NOT_FOUND and again.unread_bytes == 0


def test_exited_execs_the_host_never_removes_are_bounded(agent):  # noqa: F811
    """The agent keeps limits.exited_execs_kept exited execs of a container
    the host did not remove; beyond, the oldest are forgotten (NOT_FOUND),
    so a host that never says leaves the guest's table bounded."""
    async def main():
        client = await AgentClient.connect(str(agent))
        kept = (await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
                ).limits.exited_execs_kept
        for batch in range(0, kept + 4, 20):
            ids = [f"x{n}" for n in range(batch, min(batch + 20, kept + 4))]
            await asyncio.gather(*(exec_(client, i, "true") for i in ids))
            await asyncio.gather(*(client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=i), timeout=30)
                                   for i in ids))
        listed = (await client.call("ListProcesses", agent_pb2.ListProcessesRequest(), timeout=10)).processes
        await client.close()
        return kept, listed
    kept, listed = run(main())
    assert kept == 256
    assert len(listed) == kept and all(p.state == agent_pb2.ProcessInfo.EXITED for p in listed)
    # The four forgotten exited first: in the first batch, all of whose others are kept.
    first_batch = {f"x{n}" for n in range(20)}
    assert len(first_batch - {p.exec_id for p in listed}) == 4


def test_bad_requests_name_their_field_and_a_retry_answers_as_the_first_did(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        results = {}
        for name, request in {
            "bad id": agent_pb2.ExecProcessRequest(exec_id="../x", process=process("true")),
            "empty id": agent_pb2.ExecProcessRequest(exec_id="", process=process("true")),
            "no args": agent_pb2.ExecProcessRequest(exec_id="a", process=b'{"args": []}'),
            "not json": agent_pb2.ExecProcessRequest(exec_id="a", process=b"{"),
            "relative cwd": agent_pb2.ExecProcessRequest(exec_id="a", process=process("true", cwd="tmp")),
            "missing binary": agent_pb2.ExecProcessRequest(exec_id="a", process=process("/no/such/program")),
        }.items():
            results[name] = await code_of(client.call("ExecProcess", request, timeout=5))
        results["unknown wait"] = await code_of(client.call("WaitProcess", agent_pb2.WaitProcessRequest(
            exec_id="nobody"), timeout=5))
        first = await exec_(client, "twice", "sleep", "100")
        second = await exec_(client, "twice", "sleep", "100")
        results["other process"] = await code_of(exec_(client, "twice", "sleep", "200"))
        results["remove running"] = await code_of(client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(
            exec_id="twice"), timeout=5))
        await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id="twice", signal=9), timeout=5)
        await client.close()
        return results, first, second
    results, first, second = run(main())
    assert results["bad id"][0] == ttrpc.INVALID_ARGUMENT and results["bad id"][1].startswith("exec_id:")
    assert results["empty id"][0] == ttrpc.INVALID_ARGUMENT and results["empty id"][1].startswith("exec_id:")
    assert results["no args"] == (ttrpc.INVALID_ARGUMENT, results["no args"][1]) and \
        results["no args"][1].startswith("process.args:")
    assert results["not json"][0] == ttrpc.INVALID_ARGUMENT and results["not json"][1].startswith("process:")
    assert results["relative cwd"][0] == ttrpc.INVALID_ARGUMENT and results["relative cwd"][1].startswith("process.cwd")
    assert results["missing binary"][0] == ttrpc.FAILED_PRECONDITION and "/no/such/program" in results["missing binary"][1]
    assert results["unknown wait"][0] == ttrpc.NOT_FOUND
    assert first == second
    assert results["other process"][0] == ttrpc.ALREADY_EXISTS
    assert results["remove running"][0] == ttrpc.FAILED_PRECONDITION


def test_a_descendant_holding_the_output_ends_it_after_the_grace_and_says_so(agent):  # noqa: F811
    async def main():
        client = await AgentClient.connect(str(agent))
        await exec_(client, "leaver", "sh", "-c", "sleep 30 & echo left")
        exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="leaver"), timeout=20)
        out = await read_all(client, "leaver")
        await client.close()
        return exit_, out
    exit_, out = run(main())
    assert exit_.exit_code == 0 and out == b"left\n"
    assert not exit_.output_complete


# -- execs into a container, through the host's crun (the guest's runtime) -------------------------


@pytest.fixture
def container_agent(tmp_path):
    """(agent socket, container id, crun's state) of the agent beside a
    running crun container."""
    with crun_container_agent(tmp_path) as c:
        yield c.socket, c.container_id, c.state


def test_an_exec_runs_in_the_container_through_the_oci_runtime(tmp_path, container_agent):
    path, cid, state = container_agent
    # crun's own files say the container runs (no crun asked); of a
    # container crun does not know, nothing certain.
    assert OciRuntime(root=str(state)).runs(cid)
    assert not OciRuntime(root=str(state)).runs("nobody")

    def exec_request(exec_id: str, *args: str, container_id: str = cid) -> agent_pb2.ExecProcessRequest:
        return agent_pb2.ExecProcessRequest(container_id=container_id, exec_id=exec_id,
                                            process=process(*args, env=("PATH=/bin",)))

    async def main():
        client = await AgentClient.connect(str(path))
        details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
        await client.call("ExecProcess", exec_request("x1", "sh", "-c", "hostname; cat /proc/1/cmdline; echo; exit 7"),
                          timeout=30)
        exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(container_id=cid, exec_id="x1"),
                                  timeout=30)
        out = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(container_id=cid, exec_id="x1",
                                                                          max_bytes=1000), timeout=10)
        pid = (await client.call("ExecProcess", exec_request("x2", "sleep", "100"), timeout=30)).pid
        in_container = os.readlink(f"/proc/{pid}/ns/pid") != os.readlink("/proc/self/ns/pid")
        await client.call("SignalProcess", agent_pb2.SignalProcessRequest(container_id=cid, exec_id="x2",
                                                                          signal=9), timeout=10)
        killed = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(container_id=cid, exec_id="x2"),
                                   timeout=30)
        unknown = await code_of(client.call("ExecProcess", exec_request("x3", "true", container_id="nobody"),
                                            timeout=30))
        refused = await code_of(client.call("ExecProcess", exec_request("x4", "/no/such/program"), timeout=30))
        removed = await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(container_id=cid, exec_id="x1"),
                                    timeout=10)
        await client.close()
        return details, in_container, exit_, out, killed, unknown, refused, removed

    details, in_container, exit_, out, killed, unknown, refused, removed = asyncio.run(main())
    assert "process.exec" in details.capabilities
    assert in_container, "the exec's pid is not in the container's pid namespace"
    assert exit_.exit_code == 7 and out.data == b"in-container\nsleep\x001000\x00\n"
    assert killed.exit_code == 137
    assert unknown[0] == ttrpc.NOT_FOUND and unknown[1] == (
        "container_id: no container 'nobody' (the OCI runtime knows none; the agent's record of its process: none)")
    assert refused[0] == ttrpc.FAILED_PRECONDITION and "/no/such/program" in refused[1], refused
    assert removed.unread_bytes == len(out.data)  # read, never acknowledged by a read past them
    assert not list((tmp_path / "exec" / cid).iterdir()), "an exec's files stayed after its start"


def test_the_agents_options_are_parsed_as_its_usage_says():
    from crust.guest.agent import OPTIONS, UsageError, parse_args

    args = parse_args(["--port-name", "crust.agent", "--oci-root=/run/x"])
    assert args["--port-name"] == "crust.agent" and args["--oci-root"] == "/run/x"
    assert "--listen" not in args and args["--pod-init"] == OPTIONS["--pod-init"][0]
    assert parse_args(["--listen", "/s", "--help"]) is None
    for argv, words in ((["--oci-root", "/x"], "one of --port, --port-name, --listen is required"),
                        (["--listen", "/s", "--port", "/dev/vport0p1"], "not allowed with"),
                        (["--listen", "/s", "--listen", "/t"], "--listen: given twice"),
                        (["--listen"], "--listen: expected one argument"),
                        (["--listen", "/s", "--verbose"], "unrecognized argument: --verbose")):
        with pytest.raises(UsageError, match=words):
            parse_args(argv)
    done = subprocess.run([sys.executable, "-m", "crust.guest", "--listen"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "") and "error: --listen: expected one argument" in done.stderr


def test_protobufs_pure_python_messages_load_only_when_used():
    """With the upb extension the agent never loads protobuf's pure-Python
    implementation (its imports are paid in the guest's boot); a use of it
    loads it then, and messages work throughout."""
    script = """
import sys
from crust.guest.deferred import Deferred, defer_unused
assert defer_unused() == ["google.protobuf.internal.python_message"]
import crust.guest.agent, crust.guest.service
from crust.api import agent_pb2
name = "google.protobuf.internal.python_message"
print(type(sys.modules[name]).__name__, "google.protobuf.text_format" in sys.modules)
details = agent_pb2.GuestDetailsResponse(capabilities=["a"], uptime_ms=5)
assert agent_pb2.GuestDetailsResponse.FromString(details.SerializeToString()) == details
from google.protobuf import descriptor_pool
helper = descriptor_pool.python_message._AttachFieldHelpers
print(type(sys.modules[name]).__name__, callable(helper))
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["Deferred False", "module True"], done.stdout


@pytest.mark.parametrize("offset,data,eof", [(0, b"", False), (0, b"", True), (0, b"x", False),
                                             (300, b"\0" * 200, True), (1 << 40, os.urandom(1 << 20), False),
                                             (127, b"", True)])
def test_a_read_encoded_by_hand_is_the_message_protobuf_reads(offset, data, eof):
    """ReadStdout's answer is written around the output, not through a
    message; as ttrpc sends it (a Response, field 2) it reads back as
    the ReadStreamResponse it stands for."""
    from crust.api.ttrpc_pb2 import Response
    from crust.guest.service import encode_read

    encoded = encode_read(offset, data, eof)
    assert all(encoded.pieces)
    wanted = agent_pb2.ReadStreamResponse(offset=offset, data=data, eof=eof)
    assert agent_pb2.ReadStreamResponse.FromString(b"".join(encoded.pieces)) == wanted
    response = Response.FromString(b"".join(ttrpc.ok_response_pieces(encoded)))
    assert not response.HasField("status")
    assert agent_pb2.ReadStreamResponse.FromString(response.payload) == wanted
