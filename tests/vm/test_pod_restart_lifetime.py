"""A crash-looping container in a pod that lives on: kubelet restarts it
again and again in the same sandbox and its garbage collection removes
all but the newest dead copy (MaxPerPodContainer, 1 by default). Nothing
the handler keeps grows with the number of restarts: the pod's record
holds the live and the newest dead container only, at the same size, and
the handler's RSS stays flat. runc's pod beside it in the same containerd
is the baseline: containerd lists as many containers for either pod.
"""

from __future__ import annotations

import json
import os

import pytest

from crust.api import cri_pb2 as cri
from tests.harness.churn import rss_kib
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import pod_node

pytestmark = pytest.mark.slow

# The first sample is taken after WARM restarts, the second after RESTARTS
# (about 80 s under tcg for both pods).
RESTARTS = int(os.environ.get("CRUST_RESTART_LIFETIME_RESTARTS", "100"))
WARM = 10
# A record's numbers (guest pids, times) may gain a digit over the restarts.
RECORD_SLACK = 64
RSS_RATIO = 1.10


def restart(node, pod) -> cri.ContainerStatus:
    """One crash and restart, as kubelet's pod worker and its garbage
    collector go: the container ends, the dead copies but the newest go,
    and SyncPod starts it again. The new attempt's status."""
    ended = wait_until(lambda: (s := node.status(pod, "app")).state == cri.CONTAINER_EXITED and s,
                       timeout=120, what=f"{pod.name}'s container to crash")
    assert ended.exit_code == 3, ended
    node.runtime.collect_dead_containers(pod)
    node.runtime.sync_pod(pod)
    started = node.status(pod, "app")
    assert started.metadata.attempt == ended.metadata.attempt + 1, (started.metadata, ended.metadata)
    return started


def test_a_crash_looping_container_leaves_only_its_newest_dead_copy(root):
    with pod_node("crust-microvm", root) as node:
        node.runtime.crash_backoff = 0
        crashing = node.container("app", "echo up; exit 3")
        vm_pod = node.pod("crashing", volumes={}, containers=[crashing], restart_policy="Always")
        runc_pod = node.pod("crashing-runc", volumes={}, containers=[crashing], restart_policy="Always",
                            runtime_class="runc")
        records = node.handler.state_dir / "pods"
        with node.running(vm_pod), node.running(runc_pod):
            samples = []
            for n in range(1, RESTARTS + 1):
                newest = [restart(node, pod) for pod in (vm_pod, runc_pod)][0]
                if n in (WARM, RESTARTS):
                    # Sampled once the handler's record has the newest
                    # container: each sample of the record in the same state.
                    try:
                        record = wait_until(lambda: next((r for r in (json.loads(p.read_text())
                                                                      for p in records.glob("*.json"))
                                                          if newest.id in r["containers"]), None),
                                            timeout=60, what="the newest container in the pod's record")
                    except AssertionError as exc:
                        # What the records and the handler held instead, for the defect's cause.
                        held = {p.name: sorted(json.loads(p.read_text())["containers"]) for p in records.glob("*.json")}
                        tail = node.handler_log.read_text(errors="replace")[-3000:] if node.handler_log else ""
                        raise AssertionError(f"{exc}: restart {n}, newest {newest.id}, records {held}; "
                                             f"handler log's end: {tail}") from None
                    samples.append({
                        "record_bytes": sum(p.stat().st_size for p in records.glob("*.json")),
                        "record_containers": len(record["containers"]),
                        "rss": rss_kib(node.handler.proc.pid),
                        "listed": {pod.name: len(node.runtime.pod_status(pod).containers)
                                   for pod in (vm_pod, runc_pod)}})
            # The last attempts ended before the pods are stopped: this test
            # is about what restarts leave, not about a stop racing an exit.
            for pod in (vm_pod, runc_pod):
                wait_until(lambda: node.status(pod, "app").state == cri.CONTAINER_EXITED, timeout=120,
                           what=f"{pod.name}'s last attempt to end")
            facts = f"{RESTARTS} restarts: {samples}; load {os.getloadavg()}"
            print(facts)
            warm, last = samples
            assert node.status(vm_pod, "app").metadata.attempt == RESTARTS, facts
            # The live container and the newest dead one, for both runtimes alike.
            assert last["listed"] == warm["listed"] == {"crashing": 2, "crashing-runc": 2}, facts
            assert last["record_containers"] == warm["record_containers"] <= 2, facts
            assert last["record_bytes"] <= warm["record_bytes"] + RECORD_SLACK, facts
            assert last["rss"] <= warm["rss"] * RSS_RATIO, facts
