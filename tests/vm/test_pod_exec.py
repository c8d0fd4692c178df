"""ExecSync as kubelet uses it (exec probes, `kubectl exec`), the same pod
under runc (the baseline) and under crust-microvm, whose execs the guest's
Python agent runs (specs/agent.proto: one call starts one, output and the
exit pushed back over its port):

- 10 MiB of stdout and then a line of stderr arrive whole, with the exit
  code (kubelet takes up to 16 MiB);
- ten execs at once all answer, each with its own output;
- an exec that never ends (cut by its CRI timeout) delays no other;
- a command the container does not have fails as under runc, naming it;
- 50 MiB a container writes to its stdout reach its CRI log whole, in
  order, and the exit after them.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from crust.api import cri_pb2 as cri
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import KEEP_RUNNING, node  # noqa: F401 - node is the fixture

pytestmark = pytest.mark.slow
MiB = 1024 * 1024


def started_in_guest(node, container_id: str = "") -> list[str]:  # noqa: F811
    """The exec ids (the container's own process: "") the microVM handler
    started through the guest's agent, of one container or of all."""
    started = []
    for line in node.handler_log.read_text(errors="replace").splitlines():
        if '"process started"' in line:
            record = json.loads(line)
            if container_id in ("", record.get("container")):
                started.append(record.get("exec", ""))
    return started


def test_exec_output_whole_many_at_once_and_never_ending_beside_quick(node):  # noqa: F811
    pod = node.pod("execs", volumes={}, containers=[node.container("app", KEEP_RUNNING)])
    with node.running(pod):
        app = node.status(pod, "app").id
        runtime = node.runtime

        # 10 MiB of stdout, then stderr written after it, and the exit code.
        script = "head -c 10485760 /dev/zero | tr '\\0' x; echo tail-on-stderr >&2; exit 7"
        out = runtime.exec_sync(app, ["sh", "-c", script], timeout=120)
        assert (out.exit_code, len(out.stdout), out.stderr) == (7, 10 * MiB, b"tail-on-stderr\n")
        assert hashlib.sha256(out.stdout).digest() == hashlib.sha256(b"x" * (10 * MiB)).digest()

        # Ten at once, each with its own output.
        with ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda i: runtime.exec_sync(app, ["sh", "-c", f"echo exec-{i}"], timeout=60),
                                    range(10)))
        assert [(a.exit_code, a.stdout) for a in answers] == [(0, f"exec-{i}\n".encode()) for i in range(10)]

        # One that never ends, cut by its timeout, beside quick ones that
        # answer meanwhile.
        with ThreadPoolExecutor(1) as pool:
            never = pool.submit(runtime.exec_sync, app, ["sleep", "3600"], 8)
            quick = [runtime.exec_sync(app, ["echo", "quick"], timeout=30) for _ in range(3)]
            assert not never.done(), "the never-ending exec ended before the quick ones"
            assert [(q.exit_code, q.stdout) for q in quick] == [(0, b"quick\n")] * 3
            with pytest.raises(grpc.RpcError) as cut:
                never.result(timeout=120)
        assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, cut.value

        # A command the container does not have: an error naming it (runc:
        # "executable file not found"; crun in the guest: its own words).
        with pytest.raises(grpc.RpcError) as missing:
            runtime.exec_sync(app, ["/no/such/program"], timeout=30)
        assert "/no/such/program" in missing.value.details(), missing.value.details()

        if node.runtime_class == "crust-microvm":
            # The container and every exec but the missing program's were started.
            started = started_in_guest(node, app)
            assert "" in started and len(started) >= 16, node.handler_log.read_text(errors="replace")[-4000:]


def test_fifty_mib_of_a_containers_output_reach_its_log_whole(node):  # noqa: F811
    line = "x" * 1000
    lines = 51200   # 51200 lines of 1001 bytes: 50 MiB
    pod = node.pod("logs", volumes={}, containers=[node.container(
        "writer", f"yes {line} | head -n {lines} | nl -ba -w 6 -s ' '; echo done >&2; exit 3")])
    with node.running(pod):
        wait_until(lambda: node.status(pod, "writer").state == cri.CONTAINER_EXITED, timeout=300,
                   what="the writer's exit")
        status = node.status(pod, "writer")
        assert status.exit_code == 3
        out, err = [], []
        with open(status.log_path, "rb") as log:
            for entry in log:
                _stamp, stream, tag, text = entry.rstrip(b"\n").split(b" ", 3)
                assert tag == b"F", entry[:200]   # every line whole (CRI splits only above 16 KiB)
                (out if stream == b"stdout" else err).append(text)
        assert len(out) == lines and err == [b"done"]
        # In order, none lost or doubled: nl numbered them.
        assert all(text == f"{n + 1:6d} {line}".encode() for n, text in enumerate(out)), "lines out of order"
