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
from crust.kubelet import image as images
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
