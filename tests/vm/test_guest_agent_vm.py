"""The Python guest agent in a real microVM (tcg): served on its
virtio-serial port, reached through the port's unix socket on the host.
Figures are printed beside the outcomes (speed targets live in bench/)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
import statistics
import subprocess
import time

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.kata.agent.client import AgentClient
from crust.kata.vmm.qemu import Vm
from tests.harness.guest_vm import Guest, guest_config


def process(*args: str) -> bytes:
    return json.dumps({"args": list(args), "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "cwd": "/"}).encode()


async def connect(g: Guest) -> tuple[AgentClient, agent_pb2.GuestDetailsResponse]:
    """The VM's own connection (a port takes one host at a time; the VM
    opened it at its start)."""
    client = await g.vm.port.ready(wait=120)
    return client, g.vm.port.details


async def run_to_end(client: AgentClient, exec_id: str, *args: str) -> tuple[agent_pb2.WaitProcessResponse, bytes]:
    await client.call("ExecProcess", agent_pb2.ExecProcessRequest(exec_id=exec_id, process=process(*args)),
                      timeout=30)
    out, offset = bytearray(), 0
    while True:
        rsp = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id=exec_id, offset=offset,
                                                                          max_bytes=1 << 20), timeout=60)
        out += rsp.data
        offset += len(rsp.data)
        if rsp.eof:
            break
    exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=exec_id), timeout=30)
    await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id=exec_id), timeout=10)
    return exit_, bytes(out)


def test_the_agent_serves_the_port_many_calls_at_once_and_a_host_that_reconnects(root):
    async def main():
        async with Guest(root.path) as g:
            client, details = await connect(g)

            # Many calls in flight: a wait that never ends beside ten quick processes.
            await client.call("ExecProcess", agent_pb2.ExecProcessRequest(exec_id="forever",
                                                                          process=process("sleep", "1000")), timeout=30)
            forever = asyncio.ensure_future(client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="forever")))
            started = time.monotonic()
            quick = await asyncio.gather(*(run_to_end(client, f"q{i}", "echo", f"q{i}") for i in range(10)))
            ten_at_once = time.monotonic() - started

            singles = []
            for i in range(5):
                started = time.monotonic()
                exit_, _ = await run_to_end(client, f"t{i}", "true")
                singles.append(time.monotonic() - started)
                assert exit_.exit_code == 0

            size = 10 << 20
            started = time.monotonic()
            big_exit, big = await run_to_end(client, "big", "head", "-c", str(size), "/dev/zero")
            big_seconds = time.monotonic() - started

            # A host that goes away and comes back: the processes stay, the
            # wait it left is answered to no one, a new connection is served.
            assert not forever.done()
            await g.vm.port.close()
            client, _ = await AgentClient.open(str(g.vm.port_socket))
            listed = await client.call("ListProcesses", agent_pb2.ListProcessesRequest(), timeout=30)
            await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id="forever", signal=9),
                              timeout=30)
            ended = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="forever"), timeout=30)
            missing = None
            try:
                await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="nobody"), timeout=30)
            except TtrpcError as exc:
                missing = exc.code
            await client.close()
            return details, quick, ten_at_once, singles, big_exit, big, big_seconds, listed, ended, missing

    details, quick, ten_at_once, singles, big_exit, big, big_seconds, listed, ended, missing = asyncio.run(main())
    print(f"\nten processes at once {ten_at_once:.2f} s; one `true` median {statistics.median(singles) * 1000:.0f} ms; "
          f"10 MiB of output {big_seconds:.2f} s ({10 / big_seconds:.1f} MiB/s)")
    assert "process.guest" in details.capabilities and details.agent_name == "crust-agent"
    assert details.memory_bytes > 0 and details.kernel_release
    assert [(e.exit_code, out) for e, out in quick] == [(0, f"q{i}\n".encode()) for i in range(10)]
    assert big_exit.exit_code == 0 and big_exit.output_complete and big == bytes(10 << 20)
    assert [p.exec_id for p in listed.processes] == ["forever"]
    assert (ended.exit_code, ended.signal) == (137, 9)
    assert missing == ttrpc.NOT_FOUND


def test_output_spliced_onto_the_port_arrives_whole_held_within_the_bound_and_resent_at_the_held_offset(root):
    """A process writing 12 MiB nobody reads waits once its stream holds
    the bound (its pipe, in the guest); what the port then carries (the
    pipe's pages spliced onto it) is every byte in order, and a read
    repeated at the offset still held answers the same bytes again."""
    size = 12 << 20
    # The bytes on stdout, their digest on stderr.
    script = f"{{ head -c {size} /dev/urandom | tee /proc/self/fd/3 | sha256sum >&2; }} 3>&1"

    async def read_to_end(client, method: str, offset: int, out: bytearray) -> None:
        while True:
            rsp = await client.call(method, agent_pb2.ReadStreamRequest(exec_id="big", offset=offset,
                                                                        max_bytes=1 << 20), timeout=60)
            assert rsp.offset == offset
            out += rsp.data
            offset += len(rsp.data)
            if rsp.eof:
                return

    async def main():
        async with Guest(root.path) as g:
            client, details = await connect(g)
            await client.call("ExecProcess", agent_pb2.ExecProcessRequest(exec_id="big", process=process(
                "sh", "-c", script)), timeout=30)
            await asyncio.sleep(3)   # nobody reads
            unread = (await client.call("ListProcesses", agent_pb2.ListProcessesRequest(), timeout=30)).processes
            first = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="big", max_bytes=1 << 20),
                                      timeout=60)
            again = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(exec_id="big", max_bytes=1 << 20),
                                      timeout=60)
            out, err = bytearray(first.data), bytearray()
            await asyncio.gather(read_to_end(client, "ReadStdout", len(first.data), out),
                                 read_to_end(client, "ReadStderr", 0, err))
            exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="big"), timeout=30)
            await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id="big"), timeout=10)
            return details, unread, first, again, bytes(out), bytes(err), exit_

    details, unread, first, again, out, err, exit_ = asyncio.run(main())
    (info,) = unread
    bound = details.limits.stream_buffer_bytes
    assert info.state == agent_pb2.ProcessInfo.RUNNING, "the writer was not held back"
    assert 0 < info.stdout.length <= bound and info.stdout.held_from == 0
    assert len(first.data) >= 64 << 10 and again.data == first.data and again.offset == first.offset == 0
    assert len(out) == size and hashlib.sha256(out).hexdigest() == err.split()[0].decode()
    assert exit_.exit_code == 0 and exit_.output_complete and exit_.stdout_length == size


def test_a_guest_powered_off_by_its_agent_leaves_its_volumes_clean(root):
    """PowerOff through the port (what the handler's VM stop asks): the
    guest's processes killed, a mounted volume unmounted before the power
    goes, the answer received, QEMU gone; the volume's ext4 says clean,
    which it would not if the guest had died with it mounted."""
    image = root.path / "vol.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, timeout=60)

    async def main():
        async with Guest(root.path) as g:
            await g.attach(image, "vol")
            client = await g.vm.port.ready(wait=120)
            await client.call("MountVolume", agent_pb2.MountVolumeRequest(storage=agent_pb2.Storage(
                volume_id="vol", disk=agent_pb2.Disk(serial="vol"), fs_type="ext4", mount_point="/mnt/vol")),
                timeout=60)
            written, _ = await run_to_end(client, "writer", "sh", "-c", "echo data > /mnt/vol/f")
            assert written.exit_code == 0
            # A process whose working directory is in the volume: killed first, or the unmount fails.
            holder = {"args": ["sleep", "1000"], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "cwd": "/mnt/vol"}
            await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                exec_id="holder", process=json.dumps(holder).encode()), timeout=30)
            code = await g.vm.stop()
            return code, g.vm.console_log.read_text(errors="replace")

    code, console = asyncio.run(main())
    assert code == 0, console[-2000:]
    assert re.search(r"powering off: [1-9][0-9]* file systems unmounted, 0 would not go", console), console[-2000:]
    state = subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"^Filesystem state:\s+clean$", state, re.M), state
    assert subprocess.run(["debugfs", "-R", "cat /f", str(image)], capture_output=True, text=True,
                          check=True).stdout == "data\n"


def test_a_vm_given_two_cpus_runs_its_guest_on_both_and_refuses_none(root):
    """VmConfig.cpus (the handler's --cpus): the guest's kernel brings up
    that many CPUs and a process can run on the second; no CPU at all is
    refused before QEMU starts."""
    config = dataclasses.replace(guest_config(), cpus=2)

    async def main():
        async with Guest(root.path, config=config) as g:
            return await g.sh("nproc; taskset -c 1 cat /proc/self/stat | cut -d' ' -f39")

    code, out = asyncio.run(main())
    assert (code, out.split()) == (0, ["2", "1"]), out
    with pytest.raises(ValueError, match="cpus 0"):
        Vm("none", root.path / "none", dataclasses.replace(config, cpus=0))
