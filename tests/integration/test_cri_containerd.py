"""The ground the CRI tests stand on: the busybox and pause images made here
(deterministic, static, a pause that exits on SIGTERM as a namespace's first
process), and a private containerd (own root, state, socket and config) with
real runc: a host-network pod, its clean-up after containerd was killed, a
pod network and a registry mirror of our own, containers run through ctr."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import io
import os
import shutil
import subprocess
import signal
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import image as images
from tests.harness.cri import host_network_pod, leftovers_of, private_containerd, processes_naming
from tests.harness.daemons import wait_until


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


def test_the_pause_image_exits_on_sigterm_as_a_namespaces_first_process(tmp_path):
    """/pause as the first process of a PID namespace (as in a pod's infra
    container) ends on SIGTERM, its sleep with it; the image's own stop
    signal, which CRI-O stops an infra container with, is SIGKILL (a
    SIGTERM before the trap is set would be lost)."""
    pause = images.pause_image()
    assert images.PAUSE_COMMAND == "/pause"
    manifest = json.loads(pause.manifest)
    with tarfile.open(fileobj=io.BytesIO(pause.blobs[manifest["layers"][-1]["digest"]])) as tar:
        member = tar.getmember("pause")
        script = tar.extractfile(member).read().decode()
    assert member.mode == 0o755 and script == images.PAUSE_SCRIPT
    config = json.loads(pause.blobs[manifest["config"]["digest"]])
    assert config["config"]["Cmd"] == ["/pause"] and config["config"]["StopSignal"] == "SIGKILL"
    first = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", script])
    try:
        inner = wait_until(lambda: next(iter(Path(f"/proc/{first.pid}/task/{first.pid}/children").read_text()
                                             .split()), None), timeout=10, what="the namespace's first process")
        wait_until(lambda: b"sleep" in subprocess.run(["pgrep", "-a", "-P", inner], capture_output=True,
                                                      check=False).stdout, timeout=10, what="its sleep")
        os.kill(int(inner), signal.SIGTERM)
        assert first.wait(10) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


# -- the private containerd -----------------------------------------------------------------------


def test_private_containerd_runs_a_host_network_pod_and_leaves_nothing():
    with private_containerd() as (containerd, image):
        rs = containerd.runtime_service
        assert containerd.version().runtime_api_version == "v1"
        config = host_network_pod(containerd, "p1", "uid-p1")
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
        config = host_network_pod(containerd, "p2", "uid-p2")
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


def test_a_pod_network_and_a_registry_mirror_of_our_own():
    """`pod_network`: a pod not on the host's network gets an address on the
    containerd's own bridge, reachable from the host (a web server in it
    answers), and its host port is mapped; `mirrors`: an image named after
    a registry on the internet is pulled from the local registry standing
    in for it. close() takes the bridge, the registry its directory."""
    import urllib.request

    from crust.kubelet.registry import LocalRegistry

    base = Path(tempfile.mkdtemp(prefix="crust-net-"))
    registry = LocalRegistry(base / "registry")
    try:
        registry.start()
        busybox = images.find_busybox()
        web = images.assemble([images.layer_tar(busybox)], {"Env": [f"PATH={images.PATH}"],
                              "Cmd": ["sh", "-c", "mkdir -p /www && echo served-from-the-pod > /www/index.html "
                                      "&& exec httpd -f -p 8080 -h /www"]}, created_by="test")
        registry.push(web, "mirrored/web", ["1"])
        with private_containerd(mirrors={"registry.example.org": registry.url}, pod_network=True) as (containerd, _):
            network = containerd.network
            assert network is not None and Path(f"/sys/class/net/{network.bridge}").exists()
            rs, images_service = containerd.runtime_service, containerd.image_service
            pulled = images_service.PullImage(cri.PullImageRequest(
                image=cri.ImageSpec(image="registry.example.org/mirrored/web:1")), timeout=120).image_ref
            assert pulled == web.config_digest
            config = cri.PodSandboxConfig(
                metadata=cri.PodSandboxMetadata(name="net", namespace="default", uid="uid-net"),
                log_directory=str(containerd.directory / "logs" / "uid-net"),
                port_mappings=[cri.PortMapping(container_port=8080, host_port=18080, host_ip="127.0.0.1")],
                linux=cri.LinuxPodSandboxConfig(cgroup_parent=f"{containerd.cgroup_root}/poduid-net"))
            sandbox = rs.RunPodSandbox(cri.RunPodSandboxRequest(config=config), timeout=60).pod_sandbox_id
            address = rs.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox),
                                          timeout=10).status.network.ip
            assert ipaddress.ip_address(address) in network.subnet
            container = rs.CreateContainer(cri.CreateContainerRequest(
                pod_sandbox_id=sandbox, sandbox_config=config, config=cri.ContainerConfig(
                    metadata=cri.ContainerMetadata(name="web"),
                    image=cri.ImageSpec(image="registry.example.org/mirrored/web:1"), log_path="web/0.log")),
                timeout=60).container_id
            rs.StartContainer(cri.StartContainerRequest(container_id=container), timeout=60)
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            for url in (f"http://{address}:8080/", "http://127.0.0.1:18080/"):
                body = wait_until(lambda: _get(opener, url), timeout=20, what=url)
                assert body == b"served-from-the-pod\n", url
        assert not Path(f"/sys/class/net/{network.bridge}").exists()
    finally:
        registry.close()
        shutil.rmtree(base, ignore_errors=True)
    assert not (base / "registry").exists()


def _get(opener, url: str) -> bytes | None:
    try:
        with opener.open(url, timeout=5) as response:
            return response.read()
    except OSError:
        return None


def test_containers_run_through_ctr_are_removed_by_close(tmp_path):
    """crust.kubelet.ctr: a container run from a spec of our own on a
    containerd without CRI; close() (no orderly removal first) kills it,
    deletes its task and unmounts its root file system."""
    from crust.kubelet.containerd import Containerd
    from crust.kubelet.ctr import CtrContainers
    from crust.kubelet.image import archive_name

    image = images.build(tmp_path / "images")
    short = Path(tempfile.mkdtemp(prefix="crust-ctr-"))   # short: containerd's socket paths
    containerd = Containerd(short / "c", cri=False)
    try:
        containerd.start()
        assert "io.containerd.grpc.v1.cri" in containerd.config()
        containers = CtrContainers(containerd)
        name = containers.import_image(image.archive)
        assert name == archive_name(image.archive)
        rootfs = containers.mount_rootfs(image.name, "c1")
        spec = json.loads(containers.ctr("oci", "spec").stdout)
        spec["root"] = {"path": str(rootfs)}
        spec["process"]["args"] = ["/bin/sleep", "600"]
        spec["process"]["terminal"] = False
        pid = containers.run("c1", spec, tmp_path / "c1.log")
        assert containers.status("c1") == "RUNNING" and Path(f"/proc/{pid}").exists()
        assert containers.exec("c1", "e1", "/bin/grep", "-qz", "^/bin/sleep$", "/proc/1/cmdline").returncode == 0
    finally:
        forced = containerd.close()
        if not any(short.iterdir()):   # containerd's close took its root; anything else is a leftover below
            short.rmdir()
    assert "ctr task c1" in forced
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/cmdline").read_bytes()[:10] != b"/bin/sleep"
    assert not leftovers_of(containerd)
