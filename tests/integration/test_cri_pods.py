"""Pods started through CRI by a private containerd with crust's OCI
runtime: kubelet's CRI side replayed from its public source (its sandbox and
container configs, its order of calls), a pod's deferred volume mounted only
inside its container, a killed runtime process reported exited with its claim
released, a clear failure for a deferred target without a usable entry, two
containers of one pod sharing the claim, and `crust demo --cri`."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from crust.api import csi_pb2
from crust.contract.mountinfo import digest
from crust.kubelet import Container, Kubelet, PersistentVolume, Pod, VolumeMount
from crust.kubelet.cri import KubeletRuntime, SyncError
from tests.harness.demo_run import run_demo
from tests.harness.cri import (CONTAINERDS, containerd_binary, cri_node, private_containerd, shim_pids,
                               shims_killed_here)
from tests.harness.daemons import wait_until


# -- kubelet's CRI side, replayed --------------------------------------------------------------------


def _kubelet_runtime(containerd, **kw):
    root = containerd.directory / "node"
    kubelet = Kubelet(root / "kubelet", "node-a")
    runtime = KubeletRuntime(kubelet, containerd.endpoint, cgroup_root=containerd.cgroup_root,
                             pod_logs_dir=root / "pod-logs", **kw)
    runtime.connect()
    return runtime


def test_sandbox_and_container_configs_are_kubelets(tmp_path):
    """generatePodSandboxConfig / generateContainerConfig for a host-network
    pod with an fsGroup and a CSI volume (no runtime needed)."""
    kubelet = Kubelet(tmp_path / "kubelet", "node-a")
    kubelet.driver_name = "loop.csi.crust.dev"
    runtime = KubeletRuntime(kubelet, "unix:///nonexistent.sock", cgroup_root="/crust-x",
                             runtime_classes={"crust-runc": "crust-runc"}, pod_logs_dir=tmp_path / "logs")
    pv = PersistentVolume(name="pv-1", volume_handle="vol-1")
    pod = Pod(uid="u-1", name="p", fs_group=2000, supplemental_groups=[3000], host_network=True,
              runtime_class_name="crust-runc", volumes={"data": pv},
              containers=[Container("app", "localhost/crust/busybox:1.35.0", command=["/bin/sh", "-c", "echo $(GREETING)"],
                                    env={"GREETING": "hi"}, volume_mounts=[VolumeMount("data", "/data")])])
    config = runtime.sandbox_config(pod, attempt=0)
    assert runtime.handler_of(pod) == "crust-runc"
    assert config.metadata.uid == "u-1" and config.hostname == ""
    assert config.labels["io.kubernetes.pod.uid"] == "u-1"
    assert config.log_directory == str(tmp_path / "logs" / "default_p_u-1")
    assert config.linux.cgroup_parent == "/crust-x/kubepods/besteffort/podu-1"
    sc = config.linux.security_context
    assert list(sc.supplemental_groups) == [2000, 3000]
    assert (sc.namespace_options.network, sc.namespace_options.pid, sc.namespace_options.ipc) == (
        cri.NODE, cri.CONTAINER, cri.POD)
    assert sc.seccomp.profile_type == cri.SecurityProfile.RuntimeDefault
    assert (config.linux.resources.cpu_shares, config.linux.resources.cpu_period) == (2, 100000)
    container = runtime.container_config(pod, pod.containers[0], 0, "sha256:abc", 0, "")
    assert list(container.command) == ["/bin/sh", "-c", "echo hi"] and container.log_path == "app/0.log"
    volume = container.mounts[0]
    assert volume.host_path == str(kubelet.target_path(pod, pv)) and volume.container_path == "/data"
    assert (volume.readonly, volume.selinux_relabel, volume.propagation) == (False, False, cri.PROPAGATION_PRIVATE)
    assert [m.container_path for m in container.mounts] == ["/data", "/etc/hosts", "/dev/termination-log"]
    csc = container.linux.security_context
    assert list(csc.supplemental_groups) == [2000, 3000] and csc.run_as_user.value == 0
    assert container.linux.resources.oom_score_adj == 1000
    pod.runtime_class_name = "missing"
    with pytest.raises(SyncError, match='RuntimeClass "missing" not found'):
        runtime.handler_of(pod)


def test_kubelet_runs_stops_and_removes_a_pod_through_cri_in_its_order():
    with private_containerd() as (containerd, image):
        runtime = _kubelet_runtime(containerd, runtime_classes={"plain": "runc"}, retry_seconds=0)
        assert runtime.calls == ["Version", "RuntimeConfig", "Status"]
        pod = Pod(uid="uid-order", name="order", host_network=True, runtime_class_name="plain", fs_group=2000,
                  restart_policy="Never",
                  containers=[Container("c", image.name, command=["/bin/sh", "-c", "id -G; exit 5"])])
        runtime.calls.clear()
        sandbox_id = runtime.run_pod(pod)
        assert runtime.calls == ["ListPodSandbox", "ListContainers", "RunPodSandbox", "PodSandboxStatus",
                                 "ImageStatus", "ImageStatus", "CreateContainer", "StartContainer"]
        container_id = runtime.pod_status(pod).latest("c").id
        status = runtime.wait_container(container_id)
        assert (status.state, status.exit_code) == (cri.CONTAINER_EXITED, 5)
        # The pod's fsGroup reached the process as a supplemental group.
        assert "0 2000" in Path(status.log_path).read_text()
        # Nothing more to start (restartPolicy Never): a second sync starts nothing.
        runtime.calls.clear()
        assert runtime.sync_pod(pod) == sandbox_id
        assert "CreateContainer" not in runtime.calls
        runtime.kill_pod(pod)
        runtime.remove_pod(pod)
        assert not containerd.runtime_service.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items
        runtime.close()


# -- crust's OCI runtime under containerd ------------------------------------------------------------

# The pod's process: write into the volume, print what it sees, then wait
# for kubelet's SIGTERM and exit with a code of its own.
WORKLOAD = ("head -c 1048576 /dev/urandom > /data/payload && sync && ls -ln /data/payload && "
            "trap 'exit 42' TERM; sleep infinity & wait")


def _stats(node, pv, pod) -> dict[str, int]:
    rsp = node.kubelet.volume_stats(pv, pod)
    assert not rsp.volume_condition.abnormal, rsp.volume_condition.message
    usage = {u.unit: u for u in rsp.usage}
    b = usage[csi_pb2.VolumeUsage.BYTES]
    return {"total": b.total, "used": b.used, "available": b.available}


def _df(node, container_id: str) -> dict[str, int]:
    """df of /data, run in the container through CRI's ExecSync."""
    out = node.runtime.exec_sync(container_id, ["/bin/df", "-P", "-B1", "/data"])
    assert out.exit_code == 0, out.stderr
    fields = out.stdout.decode().splitlines()[-1].split()
    return {"total": int(fields[1]), "used": int(fields[2]), "available": int(fields[3])}


def _running_pod(node, pv, name: str, script: str = WORKLOAD):
    pod = node.pod(name, pv, script)
    node.kubelet.start_pod(pv, pod)
    node.runtime.run_pod(pod)
    container = node.container(pod)
    wait_until(lambda: "payload" in Path(container.log_path).read_text(errors="replace"),
               what="the pod's first write in its volume")
    return pod, container


@pytest.mark.parametrize("containerd", CONTAINERDS)
def test_a_pod_through_cri_mounts_its_deferred_volume_only_inside_its_container(root, containerd):
    """Kubelet -> containerd -> runc shim -> crust's OCI runtime -> runc, with
    a deferred xfs volume: written by the container with the pod's fsGroup,
    measured (ExecSync df = NodeGetVolumeStats) and grown online while it
    runs, never on the host, a second pod refused, containerd restarted
    under it, and the exit code and the claim's release when kubelet stops
    and removes it. Through Debian's containerd 1.6 and a containerd 2.x."""
    with cri_node(root, containerd_binary(containerd)) as node:
        pv = node.pv("pv-cri", "xfs")
        pod = node.pod("cri", pv, WORKLOAD)
        node.kubelet.start_pod(pv, pod)
        entry = node.entry(pod, pv)
        node.runtime.calls.clear()
        sandbox_id = node.runtime.run_pod(pod)
        assert node.runtime.calls == ["ListPodSandbox", "ListContainers", "RunPodSandbox", "PodSandboxStatus",
                                      "ImageStatus", "ImageStatus", "CreateContainer", "StartContainer"]
        container = node.container(pod)
        assert container.state == cri.CONTAINER_RUNNING
        wait_until(lambda: "payload" in Path(container.log_path).read_text(errors="replace"), what="the write")
        # The file the container wrote carries the pod's fsGroup (2000).
        assert " 0        2000 " in Path(container.log_path).read_text(), Path(container.log_path).read_text()
        target = str(node.kubelet.target_path(pod, pv))
        assert node.claims() == {(target, "mountns", sandbox_id)}
        assert node.host_mounts_of(entry) == [], "the host mounted the deferred file system"

        # Stats through the Runtime API equal df inside the container.
        assert _stats(node, pv, pod) == _df(node, container.id)

        # Online growth of the mounted xfs while the container runs.
        before = _df(node, container.id)["total"]
        grown = 640 * 1024**2
        node.proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=pv.volume_handle, capacity_range=csi_pb2.CapacityRange(required_bytes=grown)), timeout=60)
        node.kubelet.expand(pv, pod, grown)
        after = _df(node, container.id)
        assert after["total"] > before + 256 * 1024**2 and _stats(node, pv, pod) == after
        assert node.host_mounts_of(entry) == []

        # A second pod with the same single-writer volume is refused, clearly:
        # its volume cannot be set up (kubelet never gets to start it).
        second = node.pod("cri-second", pv, "sleep 600")
        node.kubelet.retry_seconds = 0
        with pytest.raises(grpc.RpcError) as refused:
            node.kubelet.start_pod(pv, second)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"already deferred to a sandbox at {target}" in refused.value.details(), refused.value.details()
        assert node.claims() == {(target, "mountns", sandbox_id)}
        assert not node.runtime.pod_status(second).sandboxes
        node.kubelet.tear_down(pv, second)

        # containerd restarts under the running pod: nothing is lost.
        node.containerd.restart(signal.SIGKILL)
        assert node.container(pod).state == cri.CONTAINER_RUNNING
        assert _stats(node, pv, pod) == _df(node, container.id) == after
        assert node.claims() == {(target, "mountns", sandbox_id)}

        # Kubelet stops the pod: SIGTERM, the workload's own exit code, the claim released.
        node.runtime.kill_pod(pod)
        stopped = node.container(pod)
        assert (stopped.state, stopped.exit_code) == (cri.CONTAINER_EXITED, 42)
        assert node.claims() == set()
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)
        assert node.host_mounts_of(entry) == []


def test_a_killed_runtime_process_is_reported_exited_and_its_claim_released(root):
    """SIGKILL the runc shim that runs the pod (the runtime process under
    containerd): containerd reports the container exited, and the claim is
    released (the shim's cleanup runs crust's runtime's delete). Before
    that, a handler killed and restarted under the running container keeps
    answering for its volume."""
    with cri_node(root) as node:
        pv = node.pv("pv-kill", "ext4", size=128 * 1024**2)
        pod, container = _running_pod(node, pv, "kill")
        sandbox = node.runtime.pod_status(pod).sandboxes[0].id
        # The handler restarts under the running container: back under its
        # lease, it still answers for the container's volume.
        node.restart_handler()
        (held,) = node.handler_containers()
        assert (held.container_id, held.state, held.alive) == (container.id, "created", True)
        assert _stats(node, pv, pod) == _df(node, container.id)
        assert {c[2] for c in node.claims()} == {sandbox}
        shims = [pid for pid in shim_pids(node.containerd) if sandbox.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(shims) == 1
        with shims_killed_here(node.containerd):
            os.kill(shims[0], signal.SIGKILL)
            status = wait_until(lambda: (s := node.container(pod)).state == cri.CONTAINER_EXITED and s,
                                timeout=30, what="containerd to report the container exited")
            assert status.exit_code != 0
            wait_until(lambda: node.claims() == set(), timeout=30, what="the claim's release")
            entry = node.entry(pod, pv)
            assert node.host_mounts_of(entry) == []
            node.runtime.kill_pod(pod)
            node.runtime.remove_pod(pod)
            node.kubelet.stop_pod(pv, pod)

        # No delete comes at all: containerd and the shim are killed, then the
        # container's process dies. The handler's reaper releases the claim
        # once nothing of the container is left.
        pv2 = node.pv("pv-orphan", "ext4", size=128 * 1024**2)
        orphan, orphan_container = _running_pod(node, pv2, "orphan")
        (held,) = node.handler_containers()
        with shims_killed_here(node.containerd):
            node.containerd.stop(signal.SIGKILL)
            for pid in shim_pids(node.containerd):
                os.kill(pid, signal.SIGKILL)
            assert len(node.claims()) == 1, "a container still running keeps its claim"
            os.kill(held.pid, signal.SIGKILL)
            # The reaper releases the claim, then forgets the container (in
            # that order: a record left by a crash between the two only claims
            # again for a container that is gone, and is reaped again).
            wait_until(lambda: node.claims() == set() and node.handler_containers() == [], timeout=30,
                       what="the reaper's release")
            node.containerd.start()
            node.runtime.kill_pod(orphan)
            node.runtime.remove_pod(orphan)
            node.kubelet.stop_pod(pv2, orphan)


def test_create_fails_clearly_for_a_deferred_target_without_a_usable_entry(root):
    """No entry, or an unreadable one, behind the shim's placeholder:
    CreateContainer fails naming the reason, nothing is claimed, and the
    container never sees the empty placeholder. A volume published on the
    host (no deferral) goes to runc unchanged."""
    with cri_node(root) as node:
        pv = node.pv("pv-noentry", "ext4", size=128 * 1024**2)
        pod = node.pod("noentry", pv, "ls /data; sleep 600")
        pod.restart_policy = "OnFailure"  # kubelet tries again
        node.runtime.crash_backoff = 0.0
        node.kubelet.start_pod(pv, pod)
        entry_dir = node.proxy.volumes_dir / digest(str(node.kubelet.target_path(pod, pv)))
        saved = (entry_dir / "mountInfo.json").read_bytes()
        # Damaged while the handler was down, so it never read a good copy
        # (a running handler keeps the last good one, the proxy's own).
        node.env.handler.stop()
        (entry_dir / "mountInfo.json").write_text("{not json")
        node.env.handler.start()
        with pytest.raises(SyncError) as failed:
            node.runtime.run_pod(pod)
        # containerd makes the task (runc create) at StartContainer.
        assert failed.value.step == "StartContainer", failed.value
        assert "OCI runtime create failed" in failed.value.message
        assert "unreadable" in failed.value.message and "placeholder" in failed.value.message, failed.value.message
        shutil.rmtree(entry_dir)
        with pytest.raises(SyncError) as failed:
            node.runtime.run_pod(pod)
        assert "has no entry for it" in failed.value.message, failed.value.message
        assert node.claims() == set()
        assert not [c for c in node.runtime.pod_status(pod).containers if c.state == cri.CONTAINER_RUNNING]
        entry_dir.mkdir(mode=0o700)
        (entry_dir / "mountInfo.json").write_bytes(saved)
        node.runtime.kill_pod(pod)
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)

        host = node.pv("pv-host", "ext4", size=128 * 1024**2, defer=False)
        plain = node.pod("host", host, "echo on-the-host > /data/note && cat /data/note")
        node.kubelet.start_pod(host, plain)
        node.runtime.run_pod(plain)
        status = node.runtime.wait_container(node.container(plain).id)
        assert status.exit_code == 0 and "on-the-host" in Path(status.log_path).read_text()
        assert (node.kubelet.target_path(plain, host) / "note").read_text() == "on-the-host\n"
        node.runtime.kill_pod(plain)
        node.runtime.remove_pod(plain)
        node.kubelet.stop_pod(host, plain)


# -- the demo -------------------------------------------------------------------------------------------


def test_cri_demo_runs_every_step_and_leaves_nothing(root):
    """`crust demo --cri --json` as a user runs it: a real pod started by
    containerd with crust-runc, every step held, the CRI facts reported, and
    nothing of it left (its root, containerd, shims, mounts)."""
    result = run_demo(root, "--cri")
    assert "kubelet starts the pod through CRI (writes data)" in [s["name"] for s in result["steps"]]
    facts = result["cri"]
    assert facts["runtime"].startswith("containerd 1.") and facts["runtime_handler"] == "crust-runc"


def test_two_containers_of_one_pod_share_the_claim(root):
    """Both containers of a pod mount the volume (each in its own mount
    namespace): one claim, the pod's; when one stops the other keeps it and
    still answers stats; the claim goes with the last."""
    with cri_node(root) as node:
        pv = node.pv("pv-two", "ext4", size=128 * 1024**2)
        pod = node.pod("two", pv, "")
        pod.containers = [Container(name, node.image.name, volume_mounts=[VolumeMount("data", "/data")],
                                    command=["/bin/sh", "-c", f"echo {name} > /data/{name} && echo written && "
                                             "trap 'exit 0' TERM; sleep infinity & wait"])
                          for name in ("first", "second")]
        node.kubelet.start_pod(pv, pod)
        sandbox_id = node.runtime.run_pod(pod)
        status = node.runtime.pod_status(pod)
        first, second = status.latest("first"), status.latest("second")
        for c in (first, second):
            wait_until(lambda c=c: "written" in Path(c.log_path).read_text(errors="replace"), what="the writes")
        target = str(node.kubelet.target_path(pod, pv))
        assert node.claims() == {(target, "mountns", sandbox_id)}
        assert sorted(c.container_id for c in node.handler_containers()) == sorted([first.id, second.id])
        # Each sees the other's file: one file system, mounted in each container.
        out = node.runtime.exec_sync(second.id, ["/bin/cat", "/data/first"])
        assert out.stdout == b"first\n"
        node.runtime._stop_container(first.id, 2)
        wait_until(lambda: [c.container_id for c in node.handler_containers()] == [second.id],
                   what="the first container's record to go")
        assert node.claims() == {(target, "mountns", sandbox_id)}
        assert _stats(node, pv, pod) == _df(node, second.id)
        node.runtime.kill_pod(pod)
        assert node.claims() == set()
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)
