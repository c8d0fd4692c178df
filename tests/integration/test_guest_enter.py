"""An exec the guest agent starts itself in a running container
(crust/guest/enter.py), against `crun exec` of the same process in the
same container: what the process sees of itself (ids, capability sets,
no_new_privs, seccomp, namespaces, cgroup, rlimits, OOM score, umask,
directory, environment, a syscall the filter refuses) must be the same.
Run on the host beside a real crun container (tests/harness/guest_container.py)."""

from __future__ import annotations

import asyncio
import copy
import json
import os

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.guest import enter
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import ContainerAgent, crun_container_agent, parent_of

# What a process reads of itself; each line the same under both paths.
PROBE = r"""
grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp|Seccomp_filters|Speculation_Store_Bypass):' /proc/self/status
cat /proc/self/cgroup
for ns in mnt uts ipc net cgroup pid; do echo "$ns $(readlink /proc/self/ns/$ns)"; done
echo "nofile $(ulimit -n) $(ulimit -Hn)"
echo "oom $(cat /proc/self/oom_score_adj)"
echo "umask $(umask)"
echo "cwd $(pwd)"
echo "host $(hostname)"
env | sort
mkdir /tmp/probe 2>&1 || echo "mkdir refused"
"""

CRI_CAPABILITIES = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
# A filter that lets everything through but mkdir, as a profile's
# refusals do (crun compiles it at the container's create).
SECCOMP = {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"],
           "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}

VARIANTS = {
    # kubelet's default: root, CRI's capabilities, privilege escalation allowed.
    "root": {"user": {"uid": 0, "gid": 0}, "noNewPrivileges": False,
             "capabilities": {k: CRI_CAPABILITIES for k in ("bounding", "effective", "permitted")}},
    # runAsUser, supplemental groups, allowPrivilegeEscalation false, one
    # capability added (ambient, as a non-root process keeps it), limits.
    "user": {"user": {"uid": 1000, "gid": 1000, "additionalGids": [1001, 1002], "umask": 0o027},
             "noNewPrivileges": True, "oomScoreAdj": 500, "cwd": "/home/u",
             "rlimits": [{"type": "RLIMIT_NOFILE", "soft": 512, "hard": 2048}],
             "capabilities": {"bounding": ["CAP_NET_BIND_SERVICE", "CAP_KILL"],
                              "effective": ["CAP_NET_BIND_SERVICE"], "permitted": ["CAP_NET_BIND_SERVICE"],
                              "inheritable": ["CAP_NET_BIND_SERVICE"], "ambient": ["CAP_NET_BIND_SERVICE"]}},
    # crun spec's default: ambient capabilities that are not inheritable,
    # which the kernel does not raise (the runtimes skip them).
    "ambient only": {"user": {"uid": 0, "gid": 0}, "noNewPrivileges": True,
                     "capabilities": {**{k: ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]
                                         for k in ("bounding", "effective", "permitted", "ambient")},
                                      "inheritable": []}},
}


def _adjust(variant: str):
    def adjust(spec, rootfs):
        spec["process"].update(copy.deepcopy(VARIANTS[variant]))
        spec["linux"]["seccomp"] = SECCOMP
        (rootfs / "etc").mkdir()
        (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nu:x:1000:1000::/home/u:/bin/sh\n")
        for d in ("tmp", "root", "home/u"):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        (rootfs / "tmp").chmod(0o1777)
        os.chown(rootfs / "home" / "u", 1000, 1000)
    return adjust


def exec_process(c: ContainerAgent, *args: str, **changes) -> dict:
    """An exec's process as containerd builds it: the container's, its
    command and environment replaced (no HOME: the runtime finds it)."""
    process = copy.deepcopy(c.spec["process"])
    process.update(args=list(args), env=["PATH=/bin", "GREETING=hello"], **changes)
    return process


async def _agent_exec(c: ContainerAgent, exec_id: str, process: dict) -> tuple[int, int, bytes, bytes]:
    """(pid, exit code, stdout, stderr) of an exec through the agent."""
    client = await AgentClient.connect(str(c.socket))
    try:
        key = {"container_id": c.container_id, "exec_id": exec_id}
        pid = (await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
            process=json.dumps(process).encode(), **key), timeout=30)).pid
        parent = parent_of(pid)
        exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)
        out = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=1 << 20, **key), timeout=10)
        err = await client.call("ReadStderr", agent_pb2.ReadStreamRequest(max_bytes=1 << 20, **key), timeout=10)
        await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(**key), timeout=10)
        return parent, exit_.exit_code, out.data, err.data
    finally:
        await client.close()


async def _refusal(c: ContainerAgent, process: dict) -> tuple[int, str]:
    client = await AgentClient.connect(str(c.socket))
    try:
        with pytest.raises(TtrpcError) as failed:
            await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                container_id=c.container_id, exec_id="refused", process=json.dumps(process).encode()), timeout=30)
        return failed.value.code, failed.value.message
    finally:
        await client.close()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_an_exec_the_agent_enters_itself_is_confined_as_crun_confines_it(tmp_path, variant):
    with crun_container_agent(tmp_path, _adjust(variant)) as c:
        # The probe sleeps first so that its parent is read while it runs.
        process = exec_process(c, "sh", "-c", "sleep 0.3;" + PROBE)
        parent, code, out, err = asyncio.run(_agent_exec(c, "probe", process))
        crun = c.crun_exec(process, tmp_path)
        # A process the agent does not enter itself (no capabilities named)
        # still runs, through crun.
        bare = exec_process(c, "sh", "-c", "sleep 0.3; echo through crun")
        del bare["capabilities"]
        crun_parent, crun_code, crun_out, _ = asyncio.run(_agent_exec(c, "bare", bare))
        missing = asyncio.run(_refusal(c, exec_process(c, "/no/such/program")))
        no_cwd = asyncio.run(_refusal(c, exec_process(c, "true", cwd="/nowhere")))

    assert parent == c.agent_pid, "the exec was not forked by the agent itself"
    assert crun.returncode == 0, crun.stderr
    assert (code, err) == (0, b"")
    # The OOM score is the process's, as runc gives an exec (crun 1.8
    # leaves its exec with the score of crun's parent).
    lines = out.decode().splitlines()
    assert f"oom {VARIANTS[variant].get('oomScoreAdj', 0)}" in lines
    assert ([line for line in lines if not line.startswith("oom ")]
            == [line for line in crun.stdout.decode().splitlines() if not line.startswith("oom ")])
    assert "mkdir refused" in lines and "GREETING=hello" in lines
    assert ("HOME=/home/u" if variant == "user" else "HOME=/root") in lines
    assert crun_parent not in (0, c.agent_pid) and (crun_code, crun_out) == (0, b"through crun\n")
    assert missing[0] == ttrpc.FAILED_PRECONDITION and "/no/such/program" in missing[1], missing
    assert no_cwd[0] == ttrpc.FAILED_PRECONDITION and "process.cwd: /nowhere" in no_cwd[1], no_cwd


def test_an_entered_process_takes_input_reports_its_exit_and_dies_by_a_signal(tmp_path):
    def adjust(spec, rootfs):
        spec["process"]["capabilities"] = {k: CRI_CAPABILITIES for k in ("bounding", "effective", "permitted")}

    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            def key(exec_id):
                return {"container_id": c.container_id, "exec_id": exec_id}
            await client.call("ExecProcess", agent_pb2.ExecProcessRequest(process=json.dumps(exec_process(
                c, "sh", "-c", "read line; echo got $line; exit 7")).encode(), stdin=True, **key("io")), timeout=30)
            await client.call("WriteStdin", agent_pb2.WriteStreamRequest(data=b"hello\n", **key("io")), timeout=10)
            await client.call("CloseStdin", agent_pb2.CloseStdinRequest(**key("io")), timeout=10)
            io = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key("io")), timeout=30)
            out = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=100, **key("io")), timeout=10)
            # Ten at once, each its own process with its own output.
            await asyncio.gather(*(client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                process=json.dumps(exec_process(c, "echo", f"n{i}")).encode(), **key(f"n{i}")), timeout=30)
                for i in range(10)))
            outs = [(await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=100, **key(f"n{i}")),
                                       timeout=30)).data for i in range(10)]
            pid = (await client.call("ExecProcess", agent_pb2.ExecProcessRequest(
                process=json.dumps(exec_process(c, "sleep", "100")).encode(), **key("long")), timeout=30)).pid
            alive = parent_of(pid)
            await client.call("SignalProcess", agent_pb2.SignalProcessRequest(signal=9, **key("long")), timeout=10)
            killed = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key("long")), timeout=30)
            return io, out.data, outs, alive, killed
        finally:
            await client.close()

    with crun_container_agent(tmp_path, adjust) as c:
        io, out, outs, alive, killed = asyncio.run(main(c))
        agent_pid = c.agent_pid
    assert (io.exit_code, out) == (7, b"got hello\n")
    assert outs == [f"n{i}\n".encode() for i in range(10)]
    assert alive == agent_pid
    assert (killed.exit_code, killed.signal) == (137, 9)


def _state(tmp_path, linux: dict) -> str:
    """crun's state of a "container" whose first process is this test's."""
    with open("/proc/self/stat", "rb") as f:
        started = int(f.read().rsplit(b")", 1)[1].split()[19])
    (tmp_path / "ctr").mkdir()
    (tmp_path / "ctr" / "status").write_text(json.dumps({"pid": os.getpid(), "process-start-time": started}))
    (tmp_path / "ctr" / "config.json").write_text(json.dumps({"linux": linux}))
    return str(tmp_path)


@pytest.mark.parametrize(("process", "linux", "reason"), [
    ({"terminal": True, "consoleSize": {"height": 0, "width": 80}}, {}, "process.consoleSize"),
    ({"apparmorProfile": "runtime/default"}, {}, "process.apparmorProfile"),
    ({"capabilities": None}, {}, "process.capabilities: none named"),
    ({"capabilities": {"bounding": ["CAP_NOPE"]}}, {}, "process.capabilities.bounding: 'CAP_NOPE'"),
    ({"rlimits": [{"type": "RLIMIT_NOPE", "soft": 1, "hard": 1}]}, {}, "process.rlimits: 'RLIMIT_NOPE'"),
    ({}, {"personality": {"domain": "LINUX32"}}, "linux.personality"),
    ({}, {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "listenerPath": "/run/l.sock"}},
     "linux.seccomp.listenerPath"),
    ({}, {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "flags": ["SECCOMP_FILTER_FLAG_NOPE"]}},
     "linux.seccomp.flags"),
    ({}, {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW"}}, "linux.seccomp: the runtime kept no compiled filter"),
])
def test_what_the_agent_leaves_to_crun_is_named(tmp_path, process, linux, reason):
    full = {"args": ["true"], "capabilities": {"bounding": ["CAP_KILL"]}, **process}
    with pytest.raises(enter.NotHere) as refused:
        enter.prepare("/bin/true", _state(tmp_path, linux), "ctr", full)
    assert str(refused.value).startswith(reason), refused.value
    with pytest.raises(enter.NotHere, match="no /no/enter in the image"):
        enter.prepare("/no/enter", str(tmp_path), "ctr", {"args": ["true"]})


def test_an_entry_names_what_the_enter_program_applies(tmp_path):
    entry = enter.prepare("/bin/true", _state(tmp_path, {}), "ctr", {
        "args": ["sh", "-c", "x"], "env": ["A=1", "B=x=y"], "cwd": "/w", "oomScoreAdj": -5, "noNewPrivileges": True,
        "user": {"uid": 7, "gid": 8, "additionalGids": [9, 10], "umask": 0o077},
        "rlimits": [{"type": "RLIMIT_NOFILE", "soft": 10, "hard": 20}],
        "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"], "effective": ["CAP_KILL"],
                         "ambient": ["CAP_CHECKPOINT_RESTORE"]}})
    try:
        options = dict(a.split("=", 1) for a in entry.argv[1:entry.argv.index("--")])
        assert entry.argv[entry.argv.index("--") + 1:] == ["sh", "-c", "x"]
        assert entry.env == {"A": "1", "B": "x=y"}
        assert {k: options[k] for k in ("uid", "gid", "groups", "umask", "cwd", "nnp", "oom", "rlimit", "bounding",
                                        "effective", "permitted", "ambient")} == {
            "uid": "7", "gid": "8", "groups": "9,10", "umask": str(0o077), "cwd": "/w", "nnp": "1", "oom": "-5",
            "rlimit": "7:10:20", "bounding": "21", "effective": "20", "permitted": "0", "ambient": format(1 << 40, "x")}
        # Only the namespaces this test's process does not share: none.
        assert options["ns"] == "0" and int(options["pidfd"]) in entry.fds
    finally:
        entry.close()
    assert entry.fds == []
