"""A pod probed by exec for weeks: every exec is forgotten once containerd
deletes it, so nothing grows with the number of execs a pod ran. runc in
the same containerd is the baseline, its execs interleaved with the
microVM's so that the machine's load weighs on both alike:

- execs of `true` into one container whose env is 40 KB (Kubernetes'
  service-link variables of a namespace with a few hundred Services):
  the pod's record on the host keeps its size, the handler's RSS stays
  flat, and the median latency of 50 more is within 10% of the first 50
  of a pod started then, the two taking turns (ratios measured here,
  never absolute times; the first 50 against the last 50 of the same pod
  is printed, and moves with the machine's load);
- after the last exec, no record of any is left: not in the handler (its
  PodRuntime answers NOT_FOUND for one, a second Delete too), not in the
  pod's record, not in the guest (a restarted handler takes back the execs
  the guest's agent still lists: only the one running then);
- that running exec, taken back by the restarted handler, ends with its
  exit code and is forgotten once containerd deletes it.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import grpc
import pytest

from crust.api import handler_pb2
from tests.harness.churn import rss_kib
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import KEEP_RUNNING, pod_node, service_links
from tests.harness.pod_runtime_client import PodClient

pytestmark = pytest.mark.slow

# 500 in the issue; under tcg on a shared machine 200 keep the test to a
# few minutes (the bench runs 10,000).
EXECS = int(os.environ.get("CRUST_EXEC_LIFETIME_EXECS", "200"))
WINDOW = 50
LATENCY_RATIO = 1.10
RSS_RATIO = 1.10


def log_entries(path, message: str) -> list[dict]:
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines()
            if f'"{message}"' in line]


def timed_exec(runtime, container_id: str) -> float:
    started = time.monotonic()
    answer = runtime.exec_sync(container_id, ["true"], timeout=60)
    took = time.monotonic() - started
    assert answer.exit_code == 0, answer
    return took


def test_execs_are_forgotten_once_deleted_and_the_last_cost_what_the_first_did(root):
    with pod_node("crust-microvm", root) as node:
        env = service_links(40 * 1024)
        vm_pod = node.pod("probed", volumes={}, containers=[node.container("app", KEEP_RUNNING, env=env)])
        runc_pod = node.pod("probed-runc", volumes={}, runtime_class="runc",
                            containers=[node.container("app", KEEP_RUNNING, env=env)])
        records = node.handler.state_dir / "pods"
        with node.running(vm_pod), node.running(runc_pod):
            vm, runc = node.status(vm_pod, "app").id, node.status(runc_pod, "app").id
            assert b"SERVICE_0000_SERVICE_HOST=10.96.0.1" in node.run(vm, "env")
            for _ in range(5):   # the first execs of a container pay for what later ones find ready
                timed_exec(node.runtime, vm), timed_exec(node.runtime, runc)
            record_sizes, rss = [], []
            took: dict[str, list[float]] = {"vm": [], "runc": []}
            for i in range(EXECS):
                took["vm"].append(timed_exec(node.runtime, vm))
                took["runc"].append(timed_exec(node.runtime, runc))
                if i + 1 in (WINDOW, EXECS):
                    record_sizes.append(sum(p.stat().st_size for p in records.glob("*.json")))
                    rss.append(rss_kib(node.handler.proc.pid))
            ratios = {name: statistics.median(t[-WINDOW:]) / statistics.median(t[:WINDOW])
                      for name, t in took.items()}
            medians = {name: (round(statistics.median(t[:WINDOW]), 3), round(statistics.median(t[-WINDOW:]), 3))
                       for name, t in took.items()}
            facts = (f"{EXECS} execs: medians first/last {WINDOW} {medians}, ratios {ratios}; record bytes "
                     f"{record_sizes}; handler RSS {rss}; load {os.getloadavg()}")
            print(facts)
            assert record_sizes[0] == record_sizes[1], facts
            assert rss[1] <= rss[0] * RSS_RATIO, facts
            # The last execs against the first execs of a pod started now,
            # taking turns with them: the machine's load (which moves the
            # first/last ratio above by more than 10% on a shared machine)
            # weighs on both alike.
            fresh_pod = node.pod("fresh", volumes={}, containers=[node.container("app", KEEP_RUNNING, env=env)])
            with node.running(fresh_pod):
                fresh = node.status(fresh_pod, "app").id
                for _ in range(5):
                    timed_exec(node.runtime, fresh)
                paired: dict[str, list[float]] = {"aged": [], "fresh": []}
                for _ in range(WINDOW):
                    paired["aged"].append(timed_exec(node.runtime, vm))
                    paired["fresh"].append(timed_exec(node.runtime, fresh))
            # Each exec against the fresh pod's taken right after it: a pair
            # sees the same load, and the median of the pairs' ratios is not
            # moved by a load that changes while they run.
            aged_over_fresh = statistics.median(a / f for a, f in zip(paired["aged"], paired["fresh"]))
            facts += f"; {WINDOW} more beside a fresh pod's first {WINDOW}: x{aged_over_fresh:.3f}"
            print(facts)
            assert aged_over_fresh <= LATENCY_RATIO, facts

            # containerd deleted every exec: the handler knows none of them.
            started = [e["exec"] for e in log_entries(node.handler_log, "process started")
                       if e.get("container") == vm and e.get("exec")]
            deleted = {e["exec"] for e in log_entries(node.handler_log, "exec deleted") if e.get("container") == vm}
            assert len(started) == EXECS + WINDOW + 6 and set(started) == deleted
            client = PodClient(node.handler.socket)
            try:
                for call, request in [("GetProcess", handler_pb2.GetProcessRequest(container_id=vm,
                                                                                  exec_id=started[0])),
                                      ("DeleteProcess", handler_pb2.DeleteProcessRequest(container_id=vm,
                                                                                        exec_id=started[-1]))]:
                    with pytest.raises(grpc.RpcError) as gone:
                        getattr(client.stub, call)(request, timeout=30)
                    assert gone.value.code() == grpc.StatusCode.NOT_FOUND, (call, gone.value.details())
            finally:
                client.close()
            (record,) = [json.loads(p.read_text()) for p in records.glob("*.json")]
            assert [list(c["processes"]) for c in record["containers"].values()] == [[""]]

            # The guest forgot them too: a handler restarted while one exec
            # runs takes back from the guest's agent that one only.
            answer: dict = {}
            before = len(log_entries(node.handler_log, "process started"))
            running = threading.Thread(target=lambda: answer.update(
                out=node.runtime.exec_sync(vm, ["sh", "-c", "sleep 20; exit 3"], timeout=180)))
            running.start()
            wait_until(lambda: len(log_entries(node.handler_log, "process started")) > before,
                       timeout=60, what="the long exec's start")
            node.handler.kill()
            node.handler.start(timeout=120)
            taken = wait_until(lambda: log_entries(node.handler_log, "execs taken back from the guest"),
                               timeout=120, what="the restarted handler's look at the guest's execs")
            assert [e["execs"] for e in taken] == [1], taken
            running.join(timeout=240)
            assert answer["out"].exit_code == 3, answer
            wait_until(lambda: len([e for e in log_entries(node.handler_log, "exec deleted")
                                    if e.get("container") == vm]) == len(deleted) + 1,
                       timeout=60, what="containerd's Delete of the exec the handler took back")
