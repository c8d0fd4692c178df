"""Pods started through CRI by a real containerd (own root, state, socket and
config), real runc, and crust's OCI runtime; kubelet's CRI side replayed
from its public source."""

from __future__ import annotations

import hashlib
import io
import signal
import tarfile
import time
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import Container, Kubelet, PersistentVolume, Pod, VolumeMount
from crust.kubelet import image as images
from crust.kubelet.cri import KubeletRuntime, SyncError
from tests.cri_harness import leftovers_of, private_containerd, processes_naming


def _host_network_pod(containerd, name: str, uid: str) -> cri.PodSandboxConfig:
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, namespace="default", uid=uid),
        log_directory=str(containerd.directory / "logs" / uid),
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{containerd.cgroup_root}/pod{uid}",
            security_context=cri.LinuxSandboxSecurityContext(namespace_options=cri.NamespaceOption(
                network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD))))


def _wait_exited(rs, container_id: str, timeout: float = 20) -> cri.ContainerStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = rs.ContainerStatus(cri.ContainerStatusRequest(container_id=container_id), timeout=10).status
        if status.state == cri.CONTAINER_EXITED or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


# -- the image ------------------------------------------------------------------------------


def test_busybox_image_is_deterministic_and_complete(tmp_path):
    first = images.build(tmp_path / "a")
    second = images.build(tmp_path / "b")
    assert first.archive.read_bytes() == second.archive.read_bytes()
    assert first.name == f"{images.REPOSITORY}:{first.busybox_version}"
    with tarfile.open(first.archive) as tar:
        names = set(tar.getnames())
        config = tar.extractfile(f"blobs/sha256/{first.image_id.split(':')[1]}").read()
    assert {"oci-layout", "index.json"} <= names
    # The image id is the config's digest, as CRI's ImageStatus reports it.
    assert "sha256:" + hashlib.sha256(config).hexdigest() == first.image_id
    layer = images.layer_tar(images.find_busybox())
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["bin/busybox"].isfile() and members["bin/sh"].issym()
    assert members["tmp"].mode == 0o1777 and "etc/passwd" in members


def test_a_dynamic_busybox_is_refused(tmp_path):
    with pytest.raises(images.ImageError, match="dynamically linked"):
        images.build(tmp_path, busybox=Path("/bin/ls"))


# -- the private containerd -----------------------------------------------------------------------


def test_private_containerd_runs_a_host_network_pod_and_leaves_nothing():
    with private_containerd() as (containerd, image):
        rs = containerd.runtime_service
        assert containerd.version().runtime_api_version == "v1"
        config = _host_network_pod(containerd, "p1", "uid-p1")
        sandbox = rs.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler="runc"),
                                   timeout=60).pod_sandbox_id
        container = rs.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sandbox, sandbox_config=config,
            config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name="c"), image=cri.ImageSpec(image=image.name),
                                       command=["/bin/sh", "-c", "echo hello from busybox; exit 7"],
                                       log_path="c/0.log")), timeout=60).container_id
        rs.StartContainer(cri.StartContainerRequest(container_id=container), timeout=60)
        status = _wait_exited(rs, container)
        assert (status.state, status.exit_code) == (cri.CONTAINER_EXITED, 7)
        assert "hello from busybox" in (containerd.directory / "logs" / "uid-p1" / "c" / "0.log").read_text()
        # The pod is left running: close() removes it.
    assert not leftovers_of(containerd)


def test_close_cleans_up_after_containerd_was_killed():
    """SIGKILL containerd while a container runs: its shim and the container
    live on (by design); close() still finds and removes everything."""
    with private_containerd() as (containerd, image):
        rs = containerd.runtime_service
        config = _host_network_pod(containerd, "p2", "uid-p2")
        sandbox = rs.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=60).pod_sandbox_id
        container = rs.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sandbox, sandbox_config=config,
            config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name="c"), image=cri.ImageSpec(image=image.name),
                                       command=["/bin/sleep", "600"], log_path="c/0.log")), timeout=60).container_id
        rs.StartContainer(cri.StartContainerRequest(container_id=container), timeout=60)
        containerd.stop(signal.SIGKILL)
        assert processes_naming(str(containerd.socket)), "the shim should outlive containerd"
        forced = containerd.close()
        assert any(f.startswith("shim pid") for f in forced) and any(f.startswith("container ") for f in forced)
    assert not leftovers_of(containerd)


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
