"""A container's own process through the guest agent (crust/guest/
containers.py): CreateContainer makes it with crun (held by the agent's
hook before its exec), StartContainer lets it run, RemoveContainer kills,
deletes and forgets it. Run on the host beside a real crun
(tests/harness/guest_container.py); ConfigureGuest on a stand-in /proc/sys."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest import guestconf
from crust.guest.errors import AgentError
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import (  # noqa: F401 - pod_cgroup_cleaned: a fixture
    ContainerAgent, code_of, container_spec, crun_container_agent, crun_knows, pod_cgroup_cleaned, unified_hierarchy)

pytestmark = pytest.mark.usefixtures("pod_cgroup_cleaned")


def _held(c: ContainerAgent, container_id: str) -> bool:
    """Whether the agent holds a descriptor of the container's mount
    namespace (its process's, in crun's cgroup)."""
    procs = unified_hierarchy() / "crust" / container_id / "ctr" / "cgroup.procs"
    pids = procs.read_text().split() if procs.exists() else []
    if not pids:
        return False
    own = os.readlink(f"/proc/{pids[0]}/ns/mnt")
    return own in _holds(c)


def _holds(c: ContainerAgent) -> list[str]:
    """The mount namespaces the agent holds descriptors of."""
    links = [os.readlink(fd) for fd in Path(f"/proc/{c.agent_pid}/fd").iterdir()]
    return [link for link in links if link.startswith("mnt:")]


def in_group(pid: int) -> list[str]:
    """The live processes of pid's process group (crun and its hook); a
    zombie left to init is none."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid=,stat=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if int(line.split()[1]) == pid and line.split()[2][0] != "Z"]


def test_a_container_is_made_started_and_removed_by_the_agent(tmp_path, pod_cgroup_cleaned):  # noqa: F811
    cid, idle = f"made-{os.getpid()}", f"idle-{os.getpid()}"

    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            key = {"container_id": cid, "exec_id": ""}
            create = agent_pb2.CreateContainerRequest(
                container_id=cid, stdin=True,
                oci_spec=container_spec(c, cid, "sh", "-c", "read name; echo hello $name from $(hostname); exit 3"))
            pid = (await client.call("CreateContainer", create, timeout=30)).pid
            again = (await client.call("CreateContainer", create, timeout=30)).pid
            listed = [p for p in (await client.call("ListProcesses", agent_pb2.ListProcessesRequest(),
                                                    timeout=10)).processes if p.container_id == cid]
            made = {p.exec_id: (p.state, p.stdout.length) for p in listed}
            known_before = crun_knows(c, cid)
            other = await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=container_spec(c, cid, "true")), timeout=30))
            started = (await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=cid),
                                         timeout=30)).pid
            held_ns = _held(c, cid)   # from its start
            await client.call("WriteStdin", agent_pb2.WriteStreamRequest(data=b"you\n", **key), timeout=10)
            await client.call("CloseStdin", agent_pb2.CloseStdinRequest(**key), timeout=10)
            exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)
            out = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=100, **key), timeout=10)
            restarted = (await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=cid),
                                           timeout=30)).pid
            removed = await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=cid),
                                        timeout=30)
            released = _holds(c) == [] and not (tmp_path / "holds" / cid).exists()
            gone = await code_of(client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=10))

            # Made and never started: removing it leaves neither crun nor its hook waiting.
            idle_pid = (await client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=idle, oci_spec=container_spec(c, idle, "true")), timeout=30)).pid
            held = in_group(idle_pid)
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=idle), timeout=30)
            # Killed before its start, it exited before it started: a start says so.
            gone_early = f"early-{os.getpid()}"
            await client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=gone_early, oci_spec=container_spec(c, gone_early, "true")), timeout=30)
            await client.call("SignalProcess", agent_pb2.SignalProcessRequest(container_id=gone_early, signal=9),
                              timeout=10)
            await client.call("WaitProcess", agent_pb2.WaitProcessRequest(container_id=gone_early), timeout=30)
            early = await code_of(client.call("StartContainer", agent_pb2.StartContainerRequest(
                container_id=gone_early), timeout=30))
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=gone_early),
                              timeout=30)
            assert early[0] == ttrpc.FAILED_PRECONDITION and "exited before it started" in early[1], early
            assert held_ns and released, (held_ns, released)
            return (details, pid, again, made, other, started, exit_, out, restarted, known_before, removed,
                    gone, held, in_group(idle_pid))
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        (details, pid, again, made, other, started, exit_, out, restarted, known_before, removed, gone, held,
         left) = asyncio.run(main(c))
        crun_after = crun_knows(c, cid) or crun_knows(c, idle)
        cgroups_after = [(pod_cgroup_cleaned / i).exists() for i in (cid, idle)]
        gates = list((tmp_path / "containers").iterdir()) if (tmp_path / "containers").exists() else []
    assert "container.create" in details.capabilities
    assert pid == again == started == restarted and made == {"": (1, 0)}   # CREATED, nothing written
    assert other[0] == ttrpc.ALREADY_EXISTS, other
    assert (exit_.exit_code, out.data) == (3, b"hello you from in-container\n")
    assert known_before and not crun_after
    assert removed.unread_bytes == len(out.data) and gone[0] == ttrpc.NOT_FOUND   # read, never acknowledged
    assert len(held) >= 2, held    # crun and its hook, waiting for the start
    assert left == [] and gates == [] and cgroups_after == [False, False]


def test_a_spec_crun_refuses_is_answered_with_its_words_and_leaves_nothing(tmp_path, pod_cgroup_cleaned):  # noqa: F811
    cid = f"refused-{os.getpid()}"

    async def main(c: ContainerAgent):
        spec = json.loads(container_spec(c, cid, "true"))
        spec["mounts"].append({"destination": "/data", "type": "bind", "source": "/no/such/source",
                               "options": ["rbind"]})
        client = await AgentClient.connect(str(c.socket))
        try:
            refused = await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=json.dumps(spec).encode()), timeout=30))
            bad = await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=b"[1]"), timeout=30))
            placed = await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=json.dumps(spec).encode(),
                binds=[agent_pb2.Bind(mount_index=0)]), timeout=30))
            return refused, bad, placed
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        refused, bad, placed = asyncio.run(main(c))
        known = crun_knows(c, cid)
        gates = list((tmp_path / "containers").iterdir()) if (tmp_path / "containers").exists() else []
    assert refused[0] == ttrpc.FAILED_PRECONDITION and "/no/such/source" in refused[1], refused
    assert bad == (ttrpc.INVALID_ARGUMENT, "oci_spec: not a JSON object")
    assert placed == (ttrpc.INVALID_ARGUMENT, "binds[0].mount_index: 0 is not a bind mount of the spec"), placed
    assert not known and gates == []
    assert not (pod_cgroup_cleaned / cid).exists()


def test_guest_settings_are_applied_in_order_and_the_first_refused_is_named(tmp_path):
    proc_sys = tmp_path / "sys"
    (proc_sys / "net" / "ipv4").mkdir(parents=True)
    (proc_sys / "net" / "ipv4" / "ip_forward").write_text("0")
    (proc_sys / "kernel").mkdir()
    (proc_sys / "kernel" / "msgmax").write_text("8192")
    guestconf.configure("", [("net.ipv4.ip_forward", "1"), ("kernel/msgmax", "65536")], str(proc_sys))
    assert (proc_sys / "net" / "ipv4" / "ip_forward").read_text() == "1"
    assert (proc_sys / "kernel" / "msgmax").read_text() == "65536"
    with pytest.raises(AgentError) as refused:
        guestconf.configure("", [("net.ipv4.ip_forward", "0"), ("net.nope", "1")], str(proc_sys))
    assert (refused.value.code, refused.value.message) == (ttrpc.INVALID_ARGUMENT, "sysctls[1] net.nope: no such key")
    assert (proc_sys / "net" / "ipv4" / "ip_forward").read_text() == "0"
    for key in ("../etc/passwd", "net..x"):
        with pytest.raises(AgentError, match=r"sysctls\[0\] .*: not a sysctl name"):
            guestconf.configure("", [(key, "1")], str(proc_sys))
    with pytest.raises(AgentError, match="hostname: 'bad host' is no host name"):
        guestconf.configure("bad host", [], str(proc_sys))


def test_signal_to_all_reaches_every_process_of_the_containers_cgroup(tmp_path):
    cid = f"all-{os.getpid()}"

    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            key = {"container_id": cid, "exec_id": ""}
            await client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=container_spec(c, cid, "sh", "-c", "sleep 100 & sleep 100 & wait")),
                timeout=30)
            await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=cid), timeout=30)
            counted = 0
            for _ in range(200):   # until the shell started both sleeps
                counted = (await client.call("SignalProcess", agent_pb2.SignalProcessRequest(
                    signal=0, all=True, **key), timeout=10)).signalled
                if counted == 3:
                    break
                await asyncio.sleep(0.05)
            killed = (await client.call("SignalProcess", agent_pb2.SignalProcessRequest(
                signal=9, all=True, **key), timeout=10)).signalled
            exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)
            left = (await client.call("SignalProcess", agent_pb2.SignalProcessRequest(
                signal=0, all=True, **key), timeout=10)).signalled
            no_container = await code_of(client.call("SignalProcess", agent_pb2.SignalProcessRequest(
                signal=0, all=True), timeout=10))
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=cid), timeout=30)
            return counted, killed, exit_, left, no_container
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        counted, killed, exit_, left, no_container = asyncio.run(main(c))
    assert (counted, killed, left) == (3, 3, 0)
    assert exit_.exit_code == 128 + 9, exit_   # as crun run reports a killed container
    assert no_container[0] == ttrpc.INVALID_ARGUMENT and no_container[1].startswith("all:"), no_container


def test_crun_starts_at_fixed_addresses_and_the_process_is_randomized_again(tmp_path, pod_cgroup_cleaned):  # noqa: F811
    """The agent starts crun without address randomization (its
    translations reused under emulation: crust.sys.personality); the spec's
    personality, the default one unless the host's names another, gives
    the container's process its randomization back."""
    seen = tmp_path / "hook-personality"

    async def run(c: ContainerAgent, cid: str, personality: dict | None) -> bytes:
        spec = json.loads(container_spec(c, cid, "cat", "/proc/self/personality"))
        spec.setdefault("hooks", {})["createRuntime"] = [
            {"path": "/bin/sh", "args": ["sh", "-c", f"cat /proc/self/personality > {seen}"]}]
        if personality is not None:
            spec["linux"]["personality"] = personality
        client = await AgentClient.connect(str(c.socket))
        try:
            key = {"container_id": cid, "exec_id": ""}
            await client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=cid, oci_spec=json.dumps(spec).encode()), timeout=30)
            await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=cid), timeout=30)
            await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)
            out = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=100, **key), timeout=10)
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=cid), timeout=30)
            return out.data
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        default = asyncio.run(run(c, f"pers-{os.getpid()}", None))
        hook = seen.read_text()
        own = asyncio.run(run(c, f"pers32-{os.getpid()}", {"domain": "LINUX32"}))
    assert hook == "00040000\n", hook   # crun (and its hooks): ADDR_NO_RANDOMIZE
    assert default == b"00000000\n", default
    assert own == b"00000008\n", own    # PER_LINUX32, as the host's spec asks, randomized


def test_huge_page_limits_of_sizes_the_kernel_has_not_are_dropped(tmp_path):
    """CRI-O writes a limit per huge page size of the host; crun fails on
    one the guest's kernel has no cgroup file for: only the guest's sizes
    are kept (malformed entries stay, for crun to refuse)."""
    from crust.guest.containers import Gate, guest_bundle, huge_page_sizes

    pages = tmp_path / "hugepages"
    for kib in (2048, 1048576, 64):
        (pages / f"hugepages-{kib}kB").mkdir(parents=True)
    controllers = tmp_path / "cgroup.controllers"
    controllers.write_text("cpuset cpu io memory hugetlb pids\n")
    assert huge_page_sizes(pages, controllers) == {"2MB", "1GB", "64KB"}
    controllers.write_text("cpu memory pids\n")
    assert huge_page_sizes(pages, controllers) == set()
    assert huge_page_sizes(tmp_path / "none", tmp_path / "none") == set()
    spec = {"root": {"path": "/run/r"}, "process": {"args": ["sh"]}, "linux": {"resources": {"hugepageLimits": [
        {"pageSize": "2MB", "limit": 0}, {"pageSize": "1GB", "limit": 0}, "odd"]}}}
    gate = Gate(tmp_path / "gate")
    try:
        made = guest_bundle(json.dumps(spec).encode(), gate, page_sizes=lambda: {"2MB"})
    finally:
        gate.close()
    assert made["linux"]["resources"]["hugepageLimits"] == [{"pageSize": "2MB", "limit": 0}, "odd"]
