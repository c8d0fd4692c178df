"""Execs on a terminal (`kubectl exec -it`) opened and closed again and
again in one microVM container, driven as containerd's shim drives the
handler (PodRuntime over its socket): each exec's terminal is gone with it.
After 100, the container's /dev/pts in the guest lists only the terminal
of the one exec held open all along (as after the first 10), the handler
answers NOT_FOUND for every one of them once deleted, and its RSS is flat.
"""

from __future__ import annotations

import json
import os

import grpc
import pytest

from crust.api import handler_pb2
from tests.harness.churn import rss_kib
from tests.harness.pod_runtime_client import container_bundle, pod_env  # noqa: F401 - pod_env is a fixture

pytestmark = pytest.mark.slow

TERMINALS = int(os.environ.get("CRUST_TERMINAL_LIFETIME_EXECS", "100"))
WARM = 10
RSS_RATIO = 1.10


def terminals_in_the_guest(client, container_id: str, n: int) -> int:
    """The pseudo-terminals the guest's devpts shows the container (a
    terminal-less exec of ls: it adds none)."""
    code, out, err = client.exec(container_id, f"count-{n}", ["/bin/ls", "/dev/pts"])
    assert code == 0, err
    client.stub.DeleteProcess(handler_pb2.DeleteProcessRequest(container_id=container_id, exec_id=f"count-{n}"),
                              timeout=30)
    return len([name for name in out.split() if name.isdigit()])


def test_terminal_execs_leave_no_terminal_behind(pod_env):  # noqa: F811 - the fixture
    kenv, client, _ = pod_env
    sandbox_bundle = kenv.path / "bundles" / "tty-sandbox"
    sandbox_bundle.mkdir(parents=True)
    (sandbox_bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                            "process": {"args": ["/pause"]}}))
    client.create_pod("tty", sandbox_bundle)
    bundle = container_bundle(kenv.path, "app", ["/bin/sleep", "600"], [])
    client.create_container("tty", "app", bundle)
    client.start("app")
    # Held open all along: the count below sees a terminal that is there.
    client.start("app", "held", args=["/bin/sleep", "600"], env=["PATH=/bin"], terminal=True)
    samples = []
    for n in range(1, TERMINALS + 1):
        exec_id = f"tty-{n}"
        code, out, _ = client.exec("app", exec_id, ["/bin/sh", "-c", "tty && echo on-a-terminal"],
                                   terminal=True)
        assert code == 0 and b"/dev/pts/" in out and b"on-a-terminal" in out, (code, out)
        client.stub.DeleteProcess(handler_pb2.DeleteProcessRequest(container_id="app", exec_id=exec_id),
                                  timeout=30)
        if n in (WARM, TERMINALS):
            samples.append({"pts": terminals_in_the_guest(client, "app", n),
                            "rss": rss_kib(kenv.handler.proc.pid)})
    facts = f"{TERMINALS} terminal execs: {samples}; load {os.getloadavg()}"
    print(facts)
    warm, last = samples
    assert last["pts"] == warm["pts"] == 1, facts
    assert last["rss"] <= warm["rss"] * RSS_RATIO, facts
    for exec_id in ("tty-1", f"tty-{TERMINALS}"):
        with pytest.raises(grpc.RpcError) as gone:
            client.state("app", exec_id)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND, gone.value.details()
    client.delete_container("app")
    client.delete_pod("tty")
