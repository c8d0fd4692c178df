"""The built image's `crust node` run under containerd + runc exactly as the
DaemonSet in deploy/kubernetes says (rendered from the manifests, not
restated here): its command and args, privileged as root, the hostPath
volumes with their mount propagation, the ConfigMap as /etc/crust/node.yaml
in kubelet's layout, the service account's token for the API server. The
kubelet directory is a directory of the test, at the same path on the host
and in the container (as the manifests are relocated for a kubelet with
another --root-dir); the other host paths are directories of the test too.

From the host, kubelet's replay registers the driver the container serves
and drives two volumes: one staged and published on the host (the staging
mount made inside the container is seen by the host, and a runc pod that
bind-mounts the target reads and writes it) and one deferred (a fail-closed
placeholder at the target, mountInfo.json in the host's watched directory;
xfs, so the image's xfsprogs formats it).
Mid-life the node container is killed and a new one started (a DaemonSet
rollout): nothing is lost. Uninstalling (the container stopped as kubelet
stops it) leaves no mount and no loop device behind.

Both installs run: the base manifests and the host-handler overlay (the
image without QEMU, no handler in the pod; the overlay adds the RuntimeClass
of the microVM handler on the host, which no pod asks for here). The image
variant is the one the DaemonSet's tag names. The sidecars (csi-provisioner, csi-resizer,
csi-snapshotter, livenessprobe) are not run: their images are upstream's and
no registry is reachable here, and all but the livenessprobe need an API
server with their objects (PVCs, PVs, VolumeSnapshots); kubelet's replay
makes the CSI calls they would cause.

An image is built when the cache has none for this tree (tools/image.py:
the base about 2 minutes once per machine, then 45 s for the plain image
and 90 s for -microvm)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import yaml
from pyroute2 import IPRoute

from crust.api import csi_pb2, csi_pb2_grpc
from crust.kubelet import Kubelet, PersistentVolume, Pod
from crust.kubelet.containerd import Containerd, available
from crust.kubelet.ctr import CtrContainers
from crust.kubelet.image import archive_config
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness import podspec
from tests.harness.daemons import MIB, Root, cleanup_root, mount_cap
from tests.harness.kustomize import render
from tests.harness.kube_api import KubeAPI, pki, serving  # noqa: F401 - pki: the module's CA and certificates

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import image as image_tool  # noqa: E402 - tools/image.py, the one command that builds the image

pytestmark = pytest.mark.slow

BASE = REPO / "deploy" / "kubernetes"
KUBELET_ROOT = "/var/lib/kubelet"
# The node's name is its pool's directory (pools/<node>/): unique per run, so
# the loop devices of this run are known by their backing file's path even
# where the kernel names it from a mount namespace that is gone.
NODE = f"node-image-{os.getpid()}"
TOKEN = "service-account-token"
CLONE_NEWNET = 0x40000000
DRIVER = "loop.csi.crust.dev"


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def relocated(docs: list[dict], kubelet_root: Path) -> list[dict]:
    """The manifests for a kubelet whose --root-dir is kubelet_root: every
    string naming /var/lib/kubelet (host paths, mount paths, node.yaml)."""
    text = json.dumps(docs).replace(f'"{KUBELET_ROOT}', f'"{kubelet_root}').replace(
        f" {KUBELET_ROOT}", f" {kubelet_root}").replace(f"{KUBELET_ROOT}/", f"{kubelet_root}/")
    return json.loads(text)


def our_loop_devices() -> list[str]:
    """Loop devices backed by a file of this run's pool. The kernel names the
    file as the process that attached it saw it (the container's
    /var/lib/crust/..., or relative to the bind mount once that namespace is
    gone), so the pool's directory is what is matched."""
    marker = f"/pools/{NODE}/volumes/"
    return sorted(device for device, backing in sysloop.attached().items() if marker in backing)


def in_netns(netns: Path, work):
    """Run work() in a thread that entered the network namespace (the
    sockets it opens stay there)."""
    result: dict = {}

    def run() -> None:
        try:
            fd = os.open(netns, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            result["value"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result.get("value")


def loopback_up() -> None:
    with IPRoute() as ipr:
        (lo,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=lo, state="up")


def wait_for(check, timeout: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"{what} within {timeout} s\n{tail}")


ARCHIVES: dict[bool, Path] = {}


def image_archive(with_qemu: bool) -> Path:
    """The image of this tree (plain or -microvm), as an OCI archive (built
    when missing)."""
    reason = available()
    assert not reason, reason
    if with_qemu not in ARCHIVES:
        started = time.monotonic()
        ARCHIVES[with_qemu] = image_tool.ensure_archive(with_qemu=with_qemu)
        print(f"image archive {ARCHIVES[with_qemu].name} ready in {time.monotonic() - started:.1f} s",
              file=sys.stderr)
    return ARCHIVES[with_qemu]


class Cluster:
    """One node as kubelet + containerd would run the DaemonSet's pod on it."""

    def __init__(self, root: Path, pki_dir: Path, manifests: Path):
        self.root = root
        self.pki = pki_dir
        self.host = root / "h"
        self.kubelet_root = self.host / KUBELET_ROOT.lstrip("/")
        self.docs = relocated(render(manifests), self.kubelet_root)
        self.pod_spec = one(self.docs, "DaemonSet")["spec"]["template"]["spec"]
        # The variant the DaemonSet names (its tag) is the one built and run.
        self.archive = image_archive(self.node_container()["image"].endswith("-microvm"))
        self.config_maps = {d["metadata"]["name"]: d for d in self.docs if d["kind"] == "ConfigMap"}
        # The node container runs from a spec of its own through ctr: no CRI.
        self.containerd = Containerd(root / "c", cri=False)
        self.containers = CtrContainers(self.containerd)
        self.netns_holder: subprocess.Popen | None = None
        self.api: KubeAPI | None = None
        self.lives = 0
        self.current = ""

    # -- what kubelet sets up before the pod ---------------------------------
    def host_path(self, path: str) -> Path:
        if path == "/dev":
            return Path(path)
        if path.startswith(str(self.host) + "/") or path == str(self.host):
            return Path(path)
        return self.host / path.lstrip("/")

    def start(self) -> None:
        self.kubelet_root.mkdir(parents=True)
        # The host's directories are on a shared mount, as / is on a systemd
        # host (containerd refuses Bidirectional over anything else).
        subprocess.run(["mount", "--bind", str(self.host), str(self.host)], check=True)
        subprocess.run(["mount", "--make-shared", str(self.host)], check=True)
        (self.kubelet_root / "plugins_registry").mkdir()
        # The pod's network namespace, held as the pod sandbox holds it, with
        # the API server's address (127.0.0.1) in it.
        self.netns_holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"])
        self.netns = Path(f"/proc/{self.netns_holder.pid}/ns/net")
        wait_for(lambda: os.readlink(self.netns) != os.readlink("/proc/self/ns/net"), 5, "the pod network")
        in_netns(self.netns, loopback_up)
        self.api = in_netns(self.netns, lambda: KubeAPI(tls=serving(self.pki), token=TOKEN).start())
        account = self.root / "sa"
        account.mkdir()
        (account / "token").write_text(TOKEN)
        (account / "ca.crt").write_bytes((self.pki / "ca.crt").read_bytes())
        (account / "namespace").write_text("crust-system")
        self.service_account = account
        self.containerd.start()
        self.image = self.containers.import_image(self.archive)
        self.image_config = archive_config(self.archive)
        self.base_spec = podspec.default_spec(self.containers.ctr)

    def node_container(self) -> dict:
        return next(c for c in self.pod_spec["containers"] if c["name"] == "crust-node")

    def start_node(self) -> str:
        """A new crust-node container (a new pod of the DaemonSet)."""
        self.lives += 1
        name = f"crust-node-{self.lives}"
        rootfs = self.containers.mount_rootfs(self.image, name)
        port = self.api.server.server_address[1]
        ctx = podspec.PodContext(
            pod_name=f"crust-node-{self.lives:05d}", namespace="crust-system", node_name=NODE,
            workdir=self.root / "pods" / name, host_path=self.host_path, config_maps=self.config_maps,
            extra_env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(port)},
            extra_mounts=[{"destination": "/var/run/secrets/kubernetes.io/serviceaccount", "type": "bind",
                           "source": str(self.service_account), "options": ["rbind", "rprivate", "ro"]}])
        spec = podspec.oci_spec(self.pod_spec, "crust-node", ctx, image_config=self.image_config, rootfs=rootfs,
                                base=self.base_spec, netns=self.netns, cgroup=f"/crust-test/{os.getpid()}-{name}")
        self.log = self.root / f"{name}.log"
        self.containers.run(name, spec, self.log)
        self.current = name
        return name

    def run_app(self, name: str, target: Path) -> None:
        """A pod's container that bind-mounts the volume's target at /data."""
        pod = {"containers": [{"name": "app", "command": ["sleep", "3600"], "securityContext": {"runAsUser": 0},
                               "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
               "volumes": [{"name": "data", "hostPath": {"path": str(target), "type": "Directory"}}]}
        rootfs = self.containers.mount_rootfs(self.image, name)
        ctx = podspec.PodContext(pod_name=name, namespace="default", node_name=NODE,
                                 workdir=self.root / "pods" / name, host_path=Path)
        spec = podspec.oci_spec(pod, "app", ctx, image_config=self.image_config, rootfs=rootfs,
                                base=self.base_spec, netns=self.netns, cgroup=f"/crust-test/{os.getpid()}-{name}")
        self.containers.run(name, spec, self.root / f"{name}.log")

    def close(self) -> None:
        try:
            try:
                self.containers.close()
            finally:
                self.containerd.close()
        finally:
            if self.api is not None:
                self.api.stop()
            if self.netns_holder is not None:
                self.netns_holder.kill()
                self.netns_holder.wait()
            cleanup_root(self.root)     # the mounts first: a mounted loop device is busy
            for device in our_loop_devices():
                subprocess.run(["losetup", "-d", device], capture_output=True)


@pytest.fixture(params=[BASE, BASE / "overlays" / "host-handler"], ids=["base", "host-handler"])
def cluster(request, pki):  # noqa: F811 - pki is the fixture imported above
    root = Root()
    node = Cluster(root.path, pki, request.param)
    try:
        node.start()
        yield node
    finally:
        node.close()
        root.close()


def controller(kubelet: Kubelet) -> csi_pb2_grpc.ControllerStub:
    return csi_pb2_grpc.ControllerStub(grpc.insecure_channel(f"unix://{kubelet.endpoint}"))


def test_the_daemonset_runs_the_image_through_a_volume_life_a_rollout_and_an_uninstall(cluster):
    daemonset = one(cluster.docs, "DaemonSet")
    node_image = cluster.node_container()["image"]
    assert node_image.rsplit(":", 1)[1] == cluster.image.rsplit(":", 1)[1], \
        f"the DaemonSet runs {node_image}, the image built here is {cluster.image}"
    sidecars = [c["image"] for c in cluster.pod_spec["containers"] if c["name"] != "crust-node"]
    assert all(i.startswith("registry.k8s.io/sig-storage/") for i in sidecars), sidecars

    first = cluster.start_node()
    kubelet = Kubelet(cluster.kubelet_root, NODE, retry_seconds=60)
    registration = cluster.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock"
    wait_for(registration.is_socket, 90, f"the container's {registration.name}", cluster.log)
    assert wait_for(lambda: _registered(kubelet), 30, "kubelet to register the driver", cluster.log) == DRIVER
    assert cluster.containers.status(first) == "RUNNING"
    # Inside: every child the ConfigMap's node.yaml asks for runs.
    status = wait_for(lambda: _status(cluster, first), 120, "crust status to report every child serving",
                      cluster.log)
    node_yaml = yaml.safe_load(cluster.config_maps["crust-node"]["data"]["node.yaml"])
    wanted = ["driver", "shim", "proxy"] + ([] if node_yaml["handler"]["runtime"] == "none" else ["handler"])
    children = json.loads(status.stdout)["supervisor"]["children"]
    assert [c["name"] for c in children] == wanted and all(c["running"] for c in children), children

    # A volume staged and published on the host.
    ctl = controller(kubelet)
    plain = ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="pv-host", capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MIB),
        volume_capabilities=[mount_cap("ext4")]), timeout=60).volume
    pv_host = PersistentVolume(name="pv-host", volume_handle=plain.volume_id, attributes=dict(plain.volume_context))
    pod_host = Pod(uid="uid-host", name="app-host")
    cluster.api.add("default", "app-host", None)
    target = kubelet.start_pod(pv_host, pod_host)
    staging = kubelet.staging_path(pv_host)
    staged = sysmount.at(str(staging))
    assert staged is not None and staged.fs_type == "ext4", \
        "the staging mount made in the container is not seen by the host"
    assert sysmount.at(str(target)) is not None, "the published target is not a mount on the host"
    cluster.run_app("app-1", target)
    written = cluster.containers.exec("app-1", "write", "sh", "-c",
                                      "echo written-by-the-pod > /data/hello && grep -c ' /data ' /proc/self/mountinfo")
    assert written.returncode == 0, written.stderr
    assert (target / "hello").read_text() == "written-by-the-pod\n"

    # A deferred volume: the placeholder on the target, the description in
    # the host's watched directory.
    deferred = ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="pv-deferred", capacity_range=csi_pb2.CapacityRange(required_bytes=320 * MIB),  # xfs' least
        volume_capabilities=[mount_cap("xfs")], parameters={"crust.dev/defer": "true"}), timeout=60).volume
    pv_def = PersistentVolume(name="pv-deferred", volume_handle=deferred.volume_id, fs_type="xfs",
                              attributes=dict(deferred.volume_context))
    pod_def = Pod(uid="uid-deferred", name="app-deferred", fs_group=2000)
    cluster.api.add("default", "app-deferred", None, fs_group=2000)
    deferred_target = kubelet.start_pod(pv_def, pod_def)
    assert sysmount.at(str(deferred_target)).fs_type == "tmpfs"
    volumes_dir = cluster.host_path("/run/crust") / "volumes"
    descriptions = list(volumes_dir.rglob("mountInfo.json"))
    assert len(descriptions) == 1, sorted(str(p) for p in volumes_dir.rglob("*"))
    description = json.loads(descriptions[0].read_text())
    assert description["metadata"].get("fsGroup") == "2000", description
    assert Path(description["device"]).is_block_device(), description  # the container's /dev is the host's
    # Formatted at staging inside the container (mkfs.xfs of the image's xfsprogs).
    assert description["fstype"] == "xfs"
    assert subprocess.run(["blkid", "-o", "value", "-s", "TYPE", description["device"]],
                          capture_output=True, text=True).stdout.strip() == "xfs"
    assert cluster.api.asked("default", "app-deferred") >= 1, "the proxy did not read the pod from the API"

    # A DaemonSet rollout mid-life: the container is killed, a new one starts.
    cluster.containers.remove(first, signal.SIGKILL)
    assert sysmount.at(str(staging)) is not None and sysmount.at(str(target)) is not None
    read = cluster.containers.exec("app-1", "read", "grep", "-qx", "written-by-the-pod", "/data/hello")
    assert read.returncode == 0, f"the pod no longer reads its file after the rollout: {read.stderr}"
    second = cluster.start_node()
    wait_for(lambda: _registered(kubelet) == DRIVER, 90, "the new container to register the driver", cluster.log)
    usage = kubelet.retried(kubelet.volume_stats, pv_host, pod_host)
    assert usage.usage and usage.usage[0].total > 0
    again = cluster.containers.exec("app-1", "append", "sh", "-c", "echo after-the-rollout >> /data/hello")
    assert again.returncode == 0, again.stderr
    assert json.loads(descriptions[0].read_text()) == description

    # The pods end; kubelet tears their volumes down through the new container.
    cluster.containers.remove("app-1", signal.SIGKILL)
    kubelet.stop_pod(pv_host, pod_host)
    kubelet.stop_pod(pv_def, pod_def)
    assert sysmount.at(str(staging)) is None and not target.exists()
    assert list(volumes_dir.rglob("mountInfo.json")) == []
    # The data stayed on the volume: staged and read on the host again.
    reread = kubelet.start_pod(pv_host, pod_host)
    assert (reread / "hello").read_text() == "written-by-the-pod\nafter-the-rollout\n"
    kubelet.stop_pod(pv_host, pod_host)
    for volume in (plain, deferred):
        ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume.volume_id), timeout=60)

    # Uninstall: kubelet stops the container (SIGTERM, then its grace period).
    grace = daemonset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert cluster.containers.stop_container(second, grace) == "exited"
    prefix = str(cluster.root) + "/"
    left = [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)
            and not m.mount_point.startswith(str(cluster.containerd.directory) + "/")
            and m.mount_point != str(cluster.host)]
    assert left == [], f"mounts left after uninstall: {left}"
    assert our_loop_devices() == [], "loop devices left after uninstall"


def _status(cluster: Cluster, container: str) -> subprocess.CompletedProcess | None:
    """`crust status` in the node container (as `kubectl exec` runs it), once
    it exits 0: every child runs and every socket serves."""
    status = cluster.containers.exec(container, f"status-{time.monotonic_ns()}", "crust", "status", "--config",
                                     "/etc/crust/node.yaml", "--json")
    return status if status.returncode == 0 and status.stdout else None


def _registered(kubelet: Kubelet) -> str:
    try:
        return kubelet.register()
    except Exception:  # noqa: BLE001 - not yet: the plugin is still starting
        return ""
