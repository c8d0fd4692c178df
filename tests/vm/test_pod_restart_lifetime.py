"""A crash-looping container in a pod that lives on: kubelet restarts it
again and again in the same sandbox and its garbage collection removes
all but the newest dead copy (MaxPerPodContainer, 1 by default). Nothing
the handler keeps grows with the number of restarts: the pod's record
holds the live container only, at the same size (containerd deletes an
ended container's task, which is the handler's DeleteContainer: the dead
copies CRI lists are containerd's), and the handler's RSS stays flat.
runc's pod beside it in the same containerd is the baseline: containerd
lists as many containers for either pod.

The attempts that are sampled wait for a file on a hostPath to go before
they exit: the record is read while the sampled container certainly
lives. The others exit at once (an attempt lives a fraction of a second
under tcg, less than a sample takes on a loaded machine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import HostPath, VolumeMount
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
# An attempt lives on while this file is in its pod's gate directory (the
# live share: the host's changes are seen at once in the guest).
HOLD = "hold"
SCRIPT = f"echo up; while [ -e /gate/{HOLD} ]; do sleep 0.1; done; exit 3"


def restart(node, pod, gate: Path, hold: bool) -> cri.ContainerStatus:
    """One crash and restart, as kubelet's pod worker and its garbage
    collector go: the container ends, the dead copies but the newest go,
    and SyncPod starts it again (hold: the new attempt lives on until the
    gate's file goes). The new attempt's status."""
    ended = wait_until(lambda: (s := node.status(pod, "app")).state == cri.CONTAINER_EXITED and s,
                       timeout=120, what=f"{pod.name}'s container to crash")
    assert ended.exit_code == 3, ended
    node.runtime.collect_dead_containers(pod)
    if hold:
        (gate / HOLD).touch()
    node.runtime.sync_pod(pod)
    started = node.status(pod, "app")
    assert started.metadata.attempt == ended.metadata.attempt + 1, (started.metadata, ended.metadata)
    return started


def pod_records(records: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in records.glob("*.json")}


def test_a_crash_looping_container_leaves_only_its_newest_dead_copy(root):
    with pod_node("crust-microvm", root) as node:
        node.runtime.crash_backoff = 0
        crashing = node.container("app", SCRIPT, VolumeMount("gate", "/gate", read_only=True))
        gates = {name: node.host_dir / f"gate-{name}" for name in ("crashing", "crashing-runc")}
        vm_pod = node.pod("crashing", volumes={"gate": HostPath(str(gates["crashing"]), "DirectoryOrCreate")},
                          containers=[crashing], restart_policy="Always")
        runc_pod = node.pod("crashing-runc",
                            volumes={"gate": HostPath(str(gates["crashing-runc"]), "DirectoryOrCreate")},
                            containers=[crashing], restart_policy="Always", runtime_class="runc")
        records = node.handler.state_dir / "pods"
        with node.running(vm_pod), node.running(runc_pod):
            samples = []
            for n in range(1, RESTARTS + 1):
                sampled = n in (WARM, RESTARTS)
                newest = [restart(node, pod, gates[pod.name], sampled) for pod in (vm_pod, runc_pod)][0]
                if not sampled:
                    continue
                # The handler recorded the container before its create was
                # answered, and forgets it only once it ended: it is there.
                held = pod_records(records)
                assert [r for r in held.values() if newest.id in r["containers"]], \
                    f"restart {n}: the live container {newest.id} is in no record: {held}"
                samples.append({
                    "record_bytes": sum(p.stat().st_size for p in records.glob("*.json")),
                    "record_containers": sum(len(r["containers"]) for r in held.values()),
                    "rss": rss_kib(node.handler.proc.pid),
                    "listed": {pod.name: len(node.runtime.pod_status(pod).containers)
                               for pod in (vm_pod, runc_pod)}})
                for gate in gates.values():
                    (gate / HOLD).unlink()
            # The last attempts ended before the pods are stopped: this test
            # is about what restarts leave, not about a stop racing an exit.
            for pod in (vm_pod, runc_pod):
                wait_until(lambda: node.status(pod, "app").state == cri.CONTAINER_EXITED, timeout=120,
                           what=f"{pod.name}'s last attempt to end")
            # containerd deletes an ended container's task: the handler
            # keeps nothing of it (containerd 1.6 deletes it before CRI
            # says it exited; waited for, as other versions may not).
            wait_until(lambda: all(r["containers"] == {} for r in pod_records(records).values()),
                       what="the handler to forget the ended container")
            facts = f"{RESTARTS} restarts: {samples}; load {os.getloadavg()}"
            print(facts)
            warm, last = samples
            assert node.status(vm_pod, "app").metadata.attempt == RESTARTS, facts
            # The live container and the newest dead one, for both runtimes alike.
            assert last["listed"] == warm["listed"] == {"crashing": 2, "crashing-runc": 2}, facts
            # The handler's record: the live container only.
            assert last["record_containers"] == warm["record_containers"] == 1, facts
            assert last["record_bytes"] <= warm["record_bytes"] + RECORD_SLACK, facts
            assert last["rss"] <= warm["rss"] * RSS_RATIO, facts
