"""Pods started through CRI by a real containerd (own root, state, socket and
config), real runc, and crust's OCI runtime; kubelet's CRI side replayed
from its public source."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import io
import os
import shutil
import subprocess
import stat
import signal
import tarfile
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from crust.api import csi_pb2
from crust.contract.mountinfo import digest
from crust.kubelet import Container, Kubelet, PersistentVolume, Pod, VolumeMount
from crust.kubelet import image as images
from crust.kubelet.cri import KubeletRuntime, SyncError
from crust.sys import mount as sysmount
from tests.demo_run import run_demo
from tests.cri_harness import (OCI_RUNTIME, PYTHON_OCI_RUNTIME, cri_node, host_network_pod, leftovers_of,
                               private_containerd, processes_naming, shim_pids, shims_killed_here)
from tests.harness import device_held
from tests.handler_env import make_env  # noqa: F401 - make_env is a fixture
from tests.harness import wait_until


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


def test_a_pod_through_cri_mounts_its_deferred_volume_only_inside_its_container(root):
    """Kubelet -> containerd -> runc shim -> crust's OCI runtime -> runc, with
    a deferred xfs volume: written by the container with the pod's fsGroup,
    measured (ExecSync df = NodeGetVolumeStats) and grown online while it
    runs, never on the host, a second pod refused, containerd restarted
    under it, and the exit code and the claim's release when kubelet stops
    and removes it."""
    with cri_node(root) as node:
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


# -- the runtime's command line (no runc needed) ------------------------------------------------------


def test_runc_command_lines_are_split_as_runc_does():
    from crust.oci_runtime.main import CREATE_VALUE_FLAGS, command_options, split_command_line

    args = ["--root", "/run/x", "--log=/b/log.json", "--log-format", "json", "--systemd-cgroup", "create",
            "--bundle", "/b", "--pid-file=/b/init.pid", "--no-pivot", "cid"]
    flags, command, rest = split_command_line(args)
    assert flags == {"--root": "/run/x", "--log": "/b/log.json", "--log-format": "json", "--systemd-cgroup": "true"}
    assert command == "create"
    assert command_options(rest, CREATE_VALUE_FLAGS) == (
        {"--bundle": "/b", "--pid-file": "/b/init.pid", "--no-pivot": "true"}, "cid")
    assert split_command_line(["delete", "--force", "cid"])[1:] == ("delete", ["--force", "cid"])
    assert command_options(["--force", "cid"], set()) == ({"--force": "true"}, "cid")


def test_the_bundle_is_rewritten_in_place_for_deferred_mounts_only():
    from crust.api import handler_pb2
    from crust.oci_runtime.main import deferred_candidates, rewrite

    target = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount"
    spec = {"mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/data", "type": "bind", "source": target, "options": ["rbind", "rprivate", "rw"]},
        {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/kubelet/pods/u/etc-hosts",
         "options": ["rbind", "rprivate", "rw"]}]}
    assert deferred_candidates(spec) == [spec["mounts"][1]]
    device = handler_pb2.DeferredContainerMount(destination="/data", target_path=target, device="/dev/loop7",
                                                fs_type="xfs", options=["rw", "nouuid"])
    out = rewrite(spec, [device])
    assert out["mounts"][0] == spec["mounts"][0] and out["mounts"][2] == spec["mounts"][2]
    assert out["mounts"][1] == {"destination": "/data", "type": "xfs", "source": "/dev/loop7",
                                "options": ["rw", "nouuid"]}
    assert json.loads(out["annotations"]["dev.crust.deferred-volumes"])[0]["target"] == target
    assert spec["mounts"][1]["source"] == target, "the original spec is left as it was"


# -- crust's OCI runtime under hostile bundles ---------------------------------------------------------


def _runtime(bundle: Path, log: Path, state: Path, runc: str = "/bin/false", handler: str = "",
             runc_root: Path | None = None, container_id: str = "hostile",
             runtime: Path = OCI_RUNTIME) -> subprocess.CompletedProcess:
    """crust's runtime's `create` as containerd's runc shim runs it (JSON
    log): crust-runc, the front end, unless another runtime is named."""
    env = {**os.environ, "CRUST_OCI_RUNTIME_CONFIG": str(state / "no-such-config.json"), "CRUST_RUNC": runc,
           "CRUST_OCI_RUNTIME_STATE": str(state), "CRUST_HANDLER_ENDPOINT": handler or f"unix://{state}/none.sock"}
    root = ["--root", str(runc_root)] if runc_root else []
    # Output to a file: a container that runc made would hold a pipe open.
    with open(log.with_suffix(".out"), "w+") as out:
        done = subprocess.run([str(runtime), *root, "--log", str(log), "--log-format", "json", "create",
                               "--bundle", str(bundle), "--pid-file", str(bundle / "init.pid"), container_id],
                              stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=120, env=env)
        out.seek(0)
        done.stderr = out.read()
    return done


def _last_error(log: Path) -> str:
    """The message of the last error line of runc's JSON log (what the shim reports)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    errors = [line["msg"] for line in lines if line.get("level") == "error"]
    assert errors, f"no error line in {log}: {lines}"
    return errors[-1]


@pytest.mark.parametrize("config, words", [
    ("[]", "a JSON object"),
    ("null", "a JSON object"),
    ("{not json", "config.json"),
    ('{"mounts": "/data"}', "mounts"),
    ('{"mounts": {"destination": "/data"}}', "mounts"),
    ('{"mounts": [1, 2]}', "mounts[0]"),
    ('{"mounts": [{"destination": "/data", "type": "bind", "source": 7, "options": ["rbind"]}]}', "mounts[0].source"),
    ('{"mounts": [{"destination": "/data", "type": "bind", "source": "/x", "options": "rbind"}]}', "mounts[0].options"),
    ('{"annotations": ["io.kubernetes.cri.sandbox-id"]}', "annotations"),
])
def test_a_malformed_config_json_is_refused_in_runcs_log_never_with_a_traceback(tmp_path, config, words):
    """The Python runtime reads every spec it is handed (crust-runc hands it
    those that may bind a CSI volume, and runc refuses the others itself)."""
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(config)
    log = tmp_path / "log.json"
    done = _runtime(bundle, log, tmp_path / "state", runtime=PYTHON_OCI_RUNTIME)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    message = _last_error(log)
    assert words in message and "config.json" in message, message
    assert (bundle / "config.json").read_text() == config, "the bundle was changed"


@pytest.mark.parametrize("runc", [None, "/bin/false"])
def test_a_malformed_spec_is_refused_by_the_program_the_front_end_hands_it_to(tmp_path, runc):
    """Through crust-runc: a malformed spec that names a CSI volume's path is
    the Python runtime's to refuse (its message, the field named); one that
    does not is runc's (runc's own message)."""
    for name, config, whose in (
            ("csi", '{"mounts": [{"destination": "/d", "source": "/var/lib/kubelet/pods/u/volumes/'
                    'kubernetes.io~csi/pv/mount", "options": "rbind"}]}', "mounts[0].options"),
            ("plain", '{"mounts": "/data"}', "" if runc == "/bin/false" else "json")):
        bundle = tmp_path / name
        (bundle / "rootfs").mkdir(parents=True)
        (bundle / "config.json").write_text(config)
        log = tmp_path / f"{name}.json"
        done = _runtime(bundle, log, tmp_path / "state", runc=runc or shutil.which("runc"))
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        if whose:
            assert whose in _last_error(log), _last_error(log)
        else:   # /bin/false wrote nothing: runc, not crust, had the call
            assert not log.exists() or not log.read_text().strip()
        assert (bundle / "config.json").read_text() == config, "the bundle was changed"


def _runc_bundle(path: Path, mounts: list[dict], sandbox_id: str) -> Path:
    """A bundle runc runs: `runc spec`'s defaults, a busybox root, the mounts added."""
    (path / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy2(images.find_busybox(), path / "rootfs" / "bin" / "busybox")
    subprocess.run(["runc", "spec"], cwd=path, check=True)
    spec = json.loads((path / "config.json").read_text())
    spec["process"].update(terminal=False, args=["/bin/busybox", "sleep", "600"])
    spec["mounts"] += mounts
    spec["annotations"] = {"io.kubernetes.cri.sandbox-id": sandbox_id, "io.kubernetes.cri.container-type": "container"}
    (path / "config.json").write_text(json.dumps(spec))
    return path


def test_a_link_to_another_pods_deferred_target_is_refused_and_its_placeholder_never_bound(make_env, tmp_path):
    """A pod's bind source that is a symbolic link to another pod's deferred
    target, as a kubelet CSI path and as any other path: `create` fails with
    the reason in runc's log, nothing is claimed, no container is made, and
    the placeholder is in no container. The volume's own pod still gets it."""
    env = make_env()
    victim = env.volume("pv-victim")
    runc_root = tmp_path / "runc"
    links = {"kubelet-csi-path": env.proxy.target("pod-evil", "pv-evil"), "other-path": tmp_path / "innocent"}
    try:
        for name, link in links.items():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(victim.target)
            bundle = _runc_bundle(tmp_path / name, [{"destination": "/data", "type": "bind", "source": str(link),
                                                     "options": ["rbind", "rw"]}], "pod-evil")
            log = tmp_path / f"{name}.json"
            done = _runtime(bundle, log, tmp_path / "state", runc=shutil.which("runc"),
                            handler=f"unix://{env.handler.socket}", runc_root=runc_root, container_id=name)
            bound = ""
            if done.returncode == 0:
                pid = int((bundle / "init.pid").read_text())
                bound = "; the container got " + " ".join(
                    line for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines() if " /data " in line)
            assert done.returncode != 0, f"{name}: create succeeded{bound}"
            assert "Traceback" not in done.stderr, done.stderr
            message = _last_error(log)
            assert str(link) in message and str(victim.target) in message and "placeholder" in message, message
            assert env.claim_set() == set()
            listed = subprocess.run(["runc", "--root", str(runc_root), "list", "-q"], capture_output=True, text=True)
            assert name not in listed.stdout.split(), "runc made the container"
    finally:
        for name in links:
            subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", name], capture_output=True)
    env.unpublish(victim)


FAILING_RUNTIME = """#!/bin/sh
echo "$@" >> "{calls}"
exit 1
"""


def _front_end_without_python(tmp_path: Path) -> tuple[Path, Path]:
    """crust-runc whose Python runtime is a stand-in that records its call
    and fails: a create that succeeds never started it."""
    from crust.oci_runtime import frontend

    calls = tmp_path / "python.calls"
    stand_in = tmp_path / "python-runtime"
    stand_in.write_text(FAILING_RUNTIME.format(calls=calls))
    stand_in.chmod(0o755)
    binary = tmp_path / "fe" / "crust-runc"
    frontend.build(binary, stand_in)
    return binary, calls


def test_crust_runc_creates_a_deferred_container_with_the_handler_and_no_interpreter(make_env, tmp_path):
    """The pod-start path of crust-runc: `create` of a bundle that binds a
    deferred volume is done by the front end and the handler (PrepareBundle,
    runc, ContainerCreated), never by the Python runtime. The container has
    the device mounted at its destination, the bundle and the marker are the
    Python runtime's own (its `delete` releases the claim), and a runc or a
    handler that fails leaves no claim and no marker behind."""
    env = make_env()
    vol = env.volume("pv-front")
    binary, python_calls = _front_end_without_python(tmp_path)
    state, runc_root = tmp_path / "state", tmp_path / "runc"
    handler = f"unix://{env.handler.socket}"
    bind = {"destination": "/data", "type": "bind", "source": str(vol.target), "options": ["rbind", "rw"]}
    bundle = _runc_bundle(tmp_path / "b1", [bind], "pod-front")
    original = json.loads((bundle / "config.json").read_text())
    log = tmp_path / "b1.json"
    try:
        done = _runtime(bundle, log, state, runc=shutil.which("runc"), handler=handler, runc_root=runc_root,
                        container_id="front1", runtime=binary)
        assert done.returncode == 0, (done.stderr, log.read_text() if log.exists() else "")
        assert not python_calls.exists(), python_calls.read_text()
        init = int((bundle / "init.pid").read_text())
        mounted = [line.split() for line in Path(f"/proc/{init}/mountinfo").read_text().splitlines()
                   if line.split()[4] == "/data"]
        assert [(m[2], m[-3]) for m in mounted] == [("%d:%d" % vol.majmin, "ext4")], mounted
        assert json.loads((bundle / "config.crust-original.json").read_text()) == original
        (data,) = [m for m in json.loads((bundle / "config.json").read_text())["mounts"] if m["destination"] == "/data"]
        assert (data["type"], data["source"]) == ("ext4", vol.device)
        assert json.loads((state / "front1").read_text()) == {"sandbox_id": "pod-front", "bundle": str(bundle)}
        assert {(c[0], c[2]) for c in env.claim_set()} == {(str(vol.target), "pod-front")}
        # The bundle joins no pod's namespaces by /proc path: the init holds the claim.
        assert [c.sandbox_pid for c in env.claims()] == [init]
        (held,) = _json_call(Path(f"{env.handler.socket}.json"),
                             b'{"method": "ListContainers", "request": {}}\n')["response"]["containers"]
        assert (held["containerId"], held["state"], int(held["pid"])) == ("front1", "created", init)
        lines = [json.loads(line)["msg"] for line in log.read_text().splitlines()]
        assert any(f"/data: ext4 on {vol.device}" in line for line in lines), lines
        assert any(line.startswith("crust: create took ") for line in lines), lines

        # delete: runc deletes, the claim and the marker go; the Python
        # runtime's delete of a container the front end created, the same.
        settings = {**os.environ, "CRUST_RUNC": shutil.which("runc"), "CRUST_HANDLER_ENDPOINT": handler,
                    "CRUST_OCI_RUNTIME_STATE": str(state), "CRUST_OCI_RUNTIME_CONFIG": str(state / "none.json")}
        for runtime in (binary, PYTHON_OCI_RUNTIME):
            if runtime == PYTHON_OCI_RUNTIME:
                done = _runtime(bundle, log, state, runc=shutil.which("runc"), handler=handler,
                                runc_root=runc_root, container_id="front1", runtime=binary)
                assert done.returncode == 0, done.stderr
            done = subprocess.run([str(runtime), "--root", str(runc_root), "delete", "--force", "front1"],
                                  env=settings, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            assert env.claim_set() == set() and not (state / "front1").exists()
            assert subprocess.run(["runc", "--root", str(runc_root), "state", "front1"],
                                  capture_output=True).returncode != 0, "runc still has the container"
        assert not python_calls.exists(), python_calls.read_text()

        # runc fails: its exit code, no claim, no marker.
        failing = _runc_bundle(tmp_path / "b2", [bind], "pod-front")
        done = _runtime(failing, tmp_path / "b2.json", state, runc="/bin/false", handler=handler,
                        container_id="front2", runtime=binary)
        assert done.returncode == 1
        assert env.claim_set() == set() and not (state / "front2").exists()
        # The handler refuses (a deferred target whose entry is gone): its reason in runc's log.
        entry_dir = env.proxy.volumes_dir / digest(str(vol.target))
        saved = entry_dir.with_name(entry_dir.name + ".saved")
        entry_dir.rename(saved)
        try:
            refused = _runc_bundle(tmp_path / "b3", [bind], "pod-front")
            done = _runtime(refused, tmp_path / "b3.json", state, runc=shutil.which("runc"), handler=handler,
                            runc_root=runc_root, container_id="front3", runtime=binary)
        finally:
            saved.rename(entry_dir)
        assert done.returncode != 0
        message = _last_error(tmp_path / "b3.json")
        assert message.startswith("crust handler: FAILED_PRECONDITION: ") and "has no entry" in message, message
        assert env.claim_set() == set() and not (state / "front3").exists()
        assert not python_calls.exists(), python_calls.read_text()
    finally:
        for name in ("front1", "front3"):
            subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", name], capture_output=True)
    env.unpublish(vol)


def test_the_pods_sandbox_process_holds_the_claim_and_the_handler_lets_go_of_the_device(make_env, tmp_path):
    """A container that joins its pod's namespaces by /proc/PID/ns paths,
    as containerd's CRI plugin writes them: the claim names that process
    from PrepareBundle on (the handler's record too), and ContainerCreated
    leaves it so. The file system the handler read ahead of runc (a
    detached mount) is let go of: once the container is deleted, and when
    runc fails, nothing holds the device."""
    env = make_env()
    vol = env.volume("pv-podpid", "xfs")
    binary, python_calls = _front_end_without_python(tmp_path)
    state, runc_root = tmp_path / "state", tmp_path / "runc"
    handler = f"unix://{env.handler.socket}"
    own_ipc = os.readlink("/proc/self/ns/ipc")
    pod = subprocess.Popen(["unshare", "--ipc", "sleep", "600"])  # the pod's sandbox process
    bundles = []
    try:
        wait_until(lambda: os.readlink(f"/proc/{pod.pid}/ns/ipc") != own_ipc, timeout=10, what="the pod's ipc")
        bind = {"destination": "/data", "type": "bind", "source": str(vol.target), "options": ["rbind", "rw"]}
        for name in ("pid1", "pid2"):
            bundle = _runc_bundle(tmp_path / name, [bind], "pod-pid")
            spec = json.loads((bundle / "config.json").read_text())
            spec["linux"]["namespaces"] = [
                {"type": "ipc", "path": f"/proc/{pod.pid}/ns/ipc"} if n["type"] == "ipc" else n
                for n in spec["linux"]["namespaces"]]
            (bundle / "config.json").write_text(json.dumps(spec))
            bundles.append(bundle)
        done = _runtime(bundles[0], tmp_path / "pid1.json", state, runc=shutil.which("runc"), handler=handler,
                        runc_root=runc_root, container_id="pid1", runtime=binary)
        assert done.returncode == 0, done.stderr
        init = int((bundles[0] / "init.pid").read_text())
        assert os.readlink(f"/proc/{init}/ns/ipc") == os.readlink(f"/proc/{pod.pid}/ns/ipc")
        (claim,) = env.claims()
        assert (claim.target_path, claim.sandbox_id, claim.sandbox_pid) == (str(vol.target), "pod-pid", pod.pid)
        record = json.loads((env.handler.state_dir / "containers" / "pid1.json").read_text())
        assert (record["state"], record["pid"], record["pod_pid"]) == ("created", init, pod.pid)
        mounted = [line.split() for line in Path(f"/proc/{init}/mountinfo").read_text().splitlines()
                   if line.split()[4] == "/data"]
        assert [(m[2], m[-3]) for m in mounted] == [(f"{vol.majmin[0]}:{vol.majmin[1]}", "xfs")], mounted
        assert device_held(vol.device) and sysmount.of_device(*vol.majmin) == []  # the host mounts it nowhere

        settings = {**os.environ, "CRUST_RUNC": shutil.which("runc"), "CRUST_HANDLER_ENDPOINT": handler,
                    "CRUST_OCI_RUNTIME_STATE": str(state), "CRUST_OCI_RUNTIME_CONFIG": str(state / "none.json")}
        done = subprocess.run([str(binary), "--root", str(runc_root), "delete", "--force", "pid1"], env=settings,
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert env.claims() == [] and not device_held(vol.device)

        # runc fails after the handler prepared (and read the file system ahead): nothing is held.
        done = _runtime(bundles[1], tmp_path / "pid2.json", state, runc="/bin/false", handler=handler,
                        container_id="pid2", runtime=binary)
        assert done.returncode == 1
        assert env.claims() == [] and not device_held(vol.device) and not (state / "pid2").exists()
        assert not python_calls.exists(), python_calls.read_text()
    finally:
        subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", "pid1"], capture_output=True, check=False)
        pod.kill()
        pod.wait()
    env.unpublish(vol)


def test_crust_runc_hands_create_to_the_python_runtime_when_the_handler_cannot_do_it(tmp_path):
    """A handler without PrepareBundle (UNIMPLEMENTED), one that cannot see
    the bundle (NOT_FOUND), no handler at all, or a create without a pid
    file: the Python runtime gets the call, with its arguments."""
    import socket
    import threading

    binary, python_calls = _front_end_without_python(tmp_path)
    csi = tmp_path / "var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount"
    csi.mkdir(parents=True)
    bundle = _runc_bundle(tmp_path / "b", [{"destination": "/data", "type": "bind", "source": str(csi),
                                            "options": ["rbind"]}], "pod")
    socket_path = tmp_path / "h.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{socket_path}.json")
    listener.listen(4)
    answers = []

    def answer_each() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                request = conn.makefile("rb").readline()
                answers.append(json.loads(request))
                conn.sendall(answers_to_give.pop(0))

    answers_to_give = [b'{"error":{"code":"UNIMPLEMENTED","message":"method \'PrepareBundle\': no"}}\n',
                       b'{"error":{"code":"NOT_FOUND","message":"bundle /x is not a directory the handler sees"}}\n']
    thread = threading.Thread(target=answer_each, daemon=True)
    thread.start()
    try:
        for handler, args in ((f"unix://{socket_path}", ["--pid-file", "p"]),
                              (f"unix://{socket_path}", ["--pid-file", "p"]),
                              (f"unix://{tmp_path}/none.sock", ["--pid-file", "p"]),
                              (f"unix://{socket_path}", [])):
            python_calls.unlink(missing_ok=True)
            done = subprocess.run([str(binary), "create", "--bundle", str(bundle), *args, "c1"],
                                  env={**os.environ, "CRUST_HANDLER_ENDPOINT": handler, "CRUST_RUNC": "/bin/false",
                                       "CRUST_OCI_RUNTIME_STATE": str(tmp_path / "state"),
                                       "CRUST_OCI_RUNTIME_CONFIG": str(tmp_path / "none.json")},
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode == 1
            assert python_calls.read_text().split() == ["create", "--bundle", str(bundle), *args, "c1"], handler
        # The two answered calls asked for PrepareBundle with the request's fields.
        assert [a["method"] for a in answers] == ["PrepareBundle", "PrepareBundle"]
        assert answers[0]["request"]["containerId"] == "c1" and answers[0]["request"]["bundle"] == str(bundle)
        assert int(answers[0]["request"]["runtimePid"]) > 0
    finally:
        listener.close()
        thread.join(5)


def _json_call(path: Path, line: bytes) -> dict:
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(line)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    return json.loads(reply)


def test_the_handlers_json_socket_answers_as_its_grpc_service(make_env, tmp_path):
    """ContainerVolumes on `<endpoint>.json` (crust-oci-runtime's way in,
    without gRPC): the service's answers and codes as JSON, a bad line or
    method refused naming it, root's socket only (mode 0600; another user
    that reaches it anyway is refused)."""
    env = make_env()
    path = Path(f"{env.handler.socket}.json")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    listed = _json_call(path, b'{"method": "ListContainers", "request": {}}\n')
    assert listed == {"response": {}}, listed
    huge = tmp_path / "huge-bundle"
    huge.mkdir()
    with open(huge / "config.json", "wb") as spec:
        spec.truncate((64 << 20) + 1)   # sparse: the handler must refuse it by its size, unread
    malformed = tmp_path / "malformed-bundle"
    malformed.mkdir()
    (malformed / "config.json").write_text('{"mounts": [{"destination": "/d", "source": "/var/lib/kubelet/pods/u/'
                                           'volumes/kubernetes.io~csi/pv/mount", "options": "rbind"}]}')
    for line, code, words in (
            (b'{"method": "PrepareContainer", "request": {"sandboxId": "p"}}\n', "INVALID_ARGUMENT", "container_id"),
            (b'{"method": "PrepareContainer", "request": {"containerId": 7}}\n', "INVALID_ARGUMENT", "containerId"),
            (b'{"method": "PrepareBundle", "request": {"containerId": "c", "bundle": "b", "stateDir": "/s"}}\n',
             "INVALID_ARGUMENT", "bundle 'b' must be an absolute path"),
            (b'{"method": "PrepareBundle", "request": {"containerId": "c", "bundle": "/b"}}\n', "INVALID_ARGUMENT",
             "state_dir"),
            (b'{"method": "PrepareBundle", "request": {"containerId": "c", "bundle": "/nonexistent/b", '
             b'"stateDir": "/s"}}\n', "NOT_FOUND", "/nonexistent/b"),
            (json.dumps({"method": "PrepareBundle", "request": {"containerId": "c", "bundle": str(huge),
                                                               "stateDir": "/s"}}).encode() + b"\n",
             "INVALID_ARGUMENT", "more than the 67108864 the handler reads"),
            (json.dumps({"method": "PrepareBundle", "request": {"containerId": "c", "bundle": str(malformed),
                                                               "stateDir": "/s"}}).encode() + b"\n",
             "INVALID_ARGUMENT", "mounts[0].options must be a list of strings"),
            (b'{"method": "DeleteEverything", "request": {}}\n', "UNIMPLEMENTED", "DeleteEverything"),
            (b'{"method": "ReleaseContainer", "request": []}\n', "INVALID_ARGUMENT", "request"),
            (b'not json\n', "INVALID_ARGUMENT", "JSON")):
        answer = _json_call(path, line)
        assert answer["error"]["code"] == code and words in answer["error"]["message"], (line, answer)
    # Released twice, unknown: idempotent, as over gRPC.
    assert _json_call(path, b'{"method": "ReleaseContainer", "request": {"containerId": "none"}}\n') == {"response": {}}
    # Another user reaching the socket anyway (the socket and the test's
    # directories opened up for the moment): refused by its credentials.
    top = Path(tempfile.gettempdir())
    opened = [path] + [d for d in path.parents if d.is_relative_to(top) and d != top]
    modes = {p: stat.S_IMODE(os.stat(p).st_mode) for p in opened}
    for p, mode in modes.items():
        os.chmod(p, mode | (0o666 if p == path else 0o011))
    try:
        # A child that becomes nobody, asks, and hands the answer back.
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                try:
                    answer = _json_call(path, b'{"method": "ListContainers", "request": {}}\n')
                except OSError as exc:
                    answer = {"connect": str(exc)}
                os.write(write_end, json.dumps(answer).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as answer_pipe:
            answer = json.loads(answer_pipe.read() or b"{}")
        os.waitpid(pid, 0)
        assert answer.get("error", {}).get("code") == "PERMISSION_DENIED", answer
    finally:
        for p, mode in modes.items():
            os.chmod(p, mode)


# -- deploy/: the runtime's configuration for containerd, CRI-O and Kubernetes -----------------------------


def test_deploy_configures_crust_runc_for_containerd_cri_o_and_kubernetes(tmp_path):
    import tomllib

    import yaml

    from crust.oci_runtime.main import settings
    from tests.integration.test_deploy import validate

    deploy = Path(__file__).resolve().parents[2] / "deploy"
    drop_in = deploy / "containerd" / "crust-runc.toml"
    # containerd itself merges the drop-in (config dump reads, starts nothing).
    config = tmp_path / "config.toml"
    config.write_text(f'version = 2\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n'
                      f'imports = ["{drop_in}"]\n[grpc]\n  address = "{tmp_path}/c.sock"\n')
    dump = subprocess.run(["containerd", "--config", str(config), "config", "dump"], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    merged = tomllib.loads(dump)
    runtime = merged["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crust-runc"]
    assert runtime["runtime_type"] == "io.containerd.runc.v2"
    binary = runtime["options"]["BinaryName"]
    assert binary == "/usr/local/bin/crust-runc"   # the front end, as docs/install-node.md builds it
    crio = tomllib.loads((deploy / "crio" / "crust-runc.conf").read_text())["crio"]["runtime"]["runtimes"]
    assert crio["crust-runc"]["runtime_path"] == binary and crio["crust-runc"]["runtime_type"] == "oci"
    runtime_class = yaml.safe_load((deploy / "kubernetes" / "runtimeclass-crust-runc.yaml").read_text())
    validate(runtime_class)
    assert runtime_class["metadata"]["name"] == runtime_class["handler"] == "crust-runc"
    # The runtime's own file is read as the runtime reads it.
    values = settings({"CRUST_OCI_RUNTIME_CONFIG": str(deploy / "oci-runtime.json")})
    assert values["handlerEndpoint"] == "unix:///run/crust/handler.sock" and values["runc"] == "/usr/sbin/runc"
    # ... and as the front end reads it: simply, so a call crust has no work
    # in goes straight to the runc it names.
    done = subprocess.run([str(OCI_RUNTIME), "--version"], capture_output=True, text=True, timeout=30,
                          env={"CRUST_OCI_RUNTIME_CONFIG": str(deploy / "oci-runtime.json"), "PATH": "/nonexistent"})
    assert done.returncode == 0 and done.stdout.startswith("runc version"), (done.stdout, done.stderr)
    (tmp_path / "bad.json").write_text('{"handlerEndpont": "x"}')
    with pytest.raises(Exception, match="unknown key"):
        settings({"CRUST_OCI_RUNTIME_CONFIG": str(tmp_path / "bad.json")})


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
