"""What crust reads from the specs containerd's CRI plugin and CRI-O write,
and what the shim answers the calls only CRI-O makes: the sandbox and the
pod of a container, the pod's uid and network, Kill's signal 0, an OOM kill
marked in the bundle (crust.common.cri_annotations, the shim, the microVM
handler's pods, crust-runc)."""

from __future__ import annotations

import asyncio
import json

import pytest

from crust.api import containerd_task_pb2 as task_pb
from crust.api import handler_pb2
from crust.common import cri_annotations, ttrpc
from crust.common.ttrpc import TtrpcError
from crust.containerd_shim.events import Publisher
from crust.containerd_shim.main import group_of
from crust.containerd_shim.process import RUNNING, STOPPED, Container, Process
from crust.containerd_shim.task import TaskService
from crust.containerd_shim.translate import is_sandbox
from crust.kata.pod.pods import network_namespace, pod_uid
from crust.oci_runtime.bundle import sandbox_of

UID = "0c6d8a2e-5b8f-4e0c-9d3a-1f2e3d4c5b6a"
NETNS = [{"type": "network", "path": "/var/run/netns/4b1c"}]

# As each runtime writes them (the keys that matter here, real values).
CONTAINERD_SANDBOX = {"annotations": {"io.kubernetes.cri.container-type": "sandbox",
                                      "io.kubernetes.cri.sandbox-id": "sb1", "io.kubernetes.cri.sandbox-uid": UID},
                      "linux": {"namespaces": NETNS}}
CONTAINERD_CONTAINER = {"annotations": {"io.kubernetes.cri.container-type": "container",
                                        "io.kubernetes.cri.sandbox-id": "sb1"}}
CRIO_SANDBOX = {"annotations": {"io.kubernetes.cri-o.ContainerType": "sandbox", "io.kubernetes.cri-o.SandboxID": "sb2",
                                "io.kubernetes.cri-o.HostNetwork": "false", "io.kubernetes.pod.uid": UID,
                                "io.container.manager": "cri-o"},
                "linux": {"namespaces": NETNS}}
CRIO_CONTAINER = {"annotations": {"io.kubernetes.cri-o.ContainerType": "container",
                                  "io.kubernetes.cri-o.SandboxID": "sb2"}}


def with_annotations(spec: dict, **more: str) -> dict:
    return {**spec, "annotations": {**spec["annotations"], **{k.replace("_", "."): v for k, v in more.items()}}}


@pytest.mark.parametrize("spec, kind, sandbox", [
    (CONTAINERD_SANDBOX, "sandbox", "sb1"), (CONTAINERD_CONTAINER, "container", "sb1"),
    (CRIO_SANDBOX, "sandbox", "sb2"), (CRIO_CONTAINER, "container", "sb2"),
    ({"annotations": {}}, "sandbox", ""), ({}, "sandbox", ""), ({"annotations": "not a map"}, "sandbox", ""),
], ids=["containerd-sandbox", "containerd-container", "crio-sandbox", "crio-container", "ctr-run", "no-annotations",
        "annotations-not-a-map"])
def test_each_runtimes_spec_is_read_with_its_own_keys(tmp_path, spec, kind, sandbox):
    assert cri_annotations.container_type(spec) == kind
    assert is_sandbox(spec) == (kind == "sandbox")
    assert cri_annotations.sandbox_id(spec) == sandbox
    # The shim serving a container is its pod's; sandboxless, its own.
    (tmp_path / "config.json").write_text(json.dumps(spec))
    assert group_of(tmp_path, "c9") == (sandbox or "c9")
    assert sandbox_of(spec, "c9") == (sandbox or "c9")


def test_a_containerd_key_on_a_spec_cri_o_wrote_came_from_the_pods_author_and_is_ignored(tmp_path):
    """CRI-O copies the pod's annotations into its specs: a pod that names
    another pod's sandbox in containerd's keys does not join that pod."""
    forged = with_annotations(CRIO_CONTAINER, **{"io_kubernetes_cri_sandbox-id": "victim",
                                                 "io_kubernetes_cri_container-type": "sandbox"})
    assert forged["annotations"]["io.kubernetes.cri.sandbox-id"] == "victim"
    assert cri_annotations.container_type(forged) == "container" and not is_sandbox(forged)
    assert cri_annotations.sandbox_id(forged) == sandbox_of(forged, "c9") == "sb2"
    (tmp_path / "config.json").write_text(json.dumps(forged))
    assert group_of(tmp_path, "c9") == "sb2"


def test_a_pods_uid_and_network_from_either_runtimes_sandbox_spec():
    assert pod_uid(CONTAINERD_SANDBOX) == pod_uid(CRIO_SANDBOX) == UID
    assert network_namespace(CONTAINERD_SANDBOX) == network_namespace(CRIO_SANDBOX) == "/var/run/netns/4b1c"
    # CRI-O pins the host's network namespace for a host-network pod: its
    # annotation, not the path's absence, says so.
    assert network_namespace(with_annotations(CRIO_SANDBOX, **{"io_kubernetes_cri-o_HostNetwork": "true"})) == ""
    assert cri_annotations.host_network(CRIO_SANDBOX) is False
    assert cri_annotations.host_network(CONTAINERD_SANDBOX) is None
    # containerd's fallback (the uid from the pod's log directory) is not read on CRI-O's spec.
    log_dir = {"io.kubernetes.cri.sandbox-log-directory": f"/var/log/pods/ns_web_{UID}"}
    crio_without_uid = {"annotations": {"io.kubernetes.cri-o.ContainerType": "sandbox", **log_dir}}
    assert pod_uid(crio_without_uid) == ""
    assert pod_uid({"annotations": log_dir}) == UID


class _OomHandler:
    """PodRuntime as the shim sees it: the container's process was killed
    by the OOM killer; no output."""

    async def call(self, method, request, timeout=None):
        assert method == "GetProcess"
        return handler_pb2.ProcessState(status=handler_pb2.ProcessState.STOPPED, exit_code=137, exited_at_ns=1,
                                        oom_killed=True)

    async def _stream(self, request):
        return
        yield

    def read_output(self, request):
        return self._stream(request)


async def test_kill_with_signal_0_asks_whether_the_process_is_there(tmp_path):
    """CRI-O's probe before it reopens a container's log: OK while it
    runs, NOT_FOUND once it ended; signals past 64 are still refused."""
    service = TaskService("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"))
    init = Process("c", "", status=RUNNING)
    service.containers["c"] = Container("c", str(tmp_path), sandbox=False, init=init)
    try:
        await service.Kill(task_pb.KillRequest(id="c", signal=0), None)
        assert init.status == RUNNING
        with pytest.raises(TtrpcError) as refused:
            await service.Kill(task_pb.KillRequest(id="c", signal=65), None)
        assert refused.value.code == ttrpc.INVALID_ARGUMENT
        init.status = STOPPED
        with pytest.raises(TtrpcError) as gone:
            await service.Kill(task_pb.KillRequest(id="c", signal=0), None)
        assert gone.value.code == ttrpc.NOT_FOUND
    finally:
        init.deleted.set()
        await service.close()


async def test_an_oom_killed_container_is_marked_in_its_bundle_for_cri_o(tmp_path, monkeypatch):
    """CRI-O takes no events: it reads an OOM kill from a file `oom` in the
    container's bundle, which the shim makes before it reports the exit."""
    service = TaskService("unix:///nonexistent/handler.sock", Publisher("", "k8s.io"))
    handler = _OomHandler()
    monkeypatch.setattr(TaskService, "pods", property(lambda _: handler))
    init = Process("c", "", status=RUNNING)
    service.containers["c"] = Container("c", str(tmp_path), sandbox=False, init=init)
    try:
        assert not (tmp_path / "oom").exists()
        await asyncio.wait_for(service._watch_process(init), 5)
        assert (tmp_path / "oom").is_file()
        answer = await service.Wait(task_pb.WaitRequest(id="c"), None)
        assert answer.exit_status == 137
    finally:
        init.deleted.set()
        await service.close()
