"""`crust proxy`'s kubelet-facing CSI endpoint, end to end.

Real `crust driver` -> `crust shim` -> `crust proxy` processes on real unix
sockets (tests.harness Root.stack()); the test plays kubelet on the proxy's
CSI socket and checks what the kernel and the disk say afterwards: mounts in
/proc/self/mountinfo, loop devices, the watched directory's mountInfo.json
files and their modes, the proxy's decision and volume records, gRPC codes
and messages, Prometheus metrics and `crust status` output.

The one stand-in is a small HTTP server playing the Kubernetes API server
(GET of a pod), because the runtime-class rule looks pods up with the
official kubernetes client. Runtime handlers are tests.handler_server
(a real Handler gRPC server) registered through the proxy's real registry.
Everything lives under the `root` fixture's temporary directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import ssl
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc
from crust.contract.mountinfo import kata_name
from crust.sys import blockdev as sysblock
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.handler_server import HandlerServer, stats_response
from tests.harness import MIB, block_cap, mount_cap, scrape_metrics

Code = grpc.StatusCode
RPC = csi_pb2.NodeServiceCapability.RPC
Usage = csi_pb2.VolumeUsage

POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
PLACEHOLDER = "crust-deferred"
DEFER_PARAM = "crust.dev/defer"
SIZE = 32 * MIB


# -- a stand-in for the Kubernetes API server ---------------------------------------------


def pod_json(namespace: str, name: str, runtime_class: str | None, fs_group: int | None = None,
             change_policy: str | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "x"}]}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if fs_group is not None:
        spec["securityContext"] = {"fsGroup": fs_group}
        if change_policy:
            spec["securityContext"]["fsGroupChangePolicy"] = change_policy
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"}, "spec": spec}


def status_json(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class KubeAPI:
    """GET /api/v1/namespaces/<ns>/pods/<name> like the API server: the pod's
    JSON, a 404 Status for an unknown pod, or the HTTP error set for it.
    With tls, HTTPS (tls may require a client certificate); with token, a 401
    for any other bearer token."""

    PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)$")

    def __init__(self, tls: ssl.SSLContext | None = None, token: str = "") -> None:
        self.tls = tls
        self.token = token
        self.pods: dict[tuple[str, str], dict] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.requests: list[str] = []
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"

    def add(self, namespace: str, name: str, runtime_class: str | None, fs_group: int | None = None,
            change_policy: str | None = None) -> None:
        self.pods[(namespace, name)] = pod_json(namespace, name, runtime_class, fs_group, change_policy)

    def start(self) -> "KubeAPI":
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                api.requests.append(self.path)
                if api.token and self.headers.get("Authorization") != f"Bearer {api.token}":
                    return self._answer(401, status_json(401, "Unauthorized", "Unauthorized"))
                match = KubeAPI.PATH.match(self.path.split("?", 1)[0])
                if match is None:
                    return self._answer(404, status_json(404, "NotFound", "the server could not find the resource"))
                key = (match.group(1), match.group(2))
                if key in api.errors:
                    code = api.errors[key]
                    return self._answer(code, status_json(code, "InternalError", "etcdserver: request timed out"))
                if key not in api.pods:
                    return self._answer(404, status_json(404, "NotFound", f'pods "{key[1]}" not found'))
                return self._answer(200, api.pods[key])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)
            self.server = None

    def asked(self, namespace: str, name: str) -> int:
        return self.requests.count(f"/api/v1/namespaces/{namespace}/pods/{name}")


@pytest.fixture
def kube():
    api = KubeAPI().start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def handler(root):
    h = HandlerServer(socket=root.path / "handler.sock", name="mountns",
                      default_stats=stats_response(total=987_654_321, used=123_456_789, inodes=40_000,
                                                   inodes_used=1_234, message="measured inside sb"))
    h.start()
    try:
        yield h
    finally:
        h.stop()


# -- set-up and kubelet-side shortcuts ----------------------------------------------------------


def start_stack(root, policy: str | None = None, proxy_extra=(), shim_extra=()):
    extra = list(proxy_extra)
    if policy is not None:
        path = root.path / "policy.yaml"
        path.write_text(policy)
        extra += ["--policy", str(path)]
    return root.stack(proxy_extra=extra, shim_extra=shim_extra)


@dataclass
class Vol:
    id: str
    pv: str
    staging: Path
    cap: csi_pb2.VolumeCapability


def new_volume(proxy, pv: str, cap=None, size: int = SIZE) -> Vol:
    """CreateVolume and NodeStageVolume, as the CO does, through the proxy."""
    cap = cap or mount_cap("ext4")
    vol = proxy.create(pv, size, cap=cap)
    staging = proxy.staging(pv)
    staging.parent.mkdir(parents=True, exist_ok=True)
    proxy.stage(vol.volume_id, staging, cap=cap)
    return Vol(vol.volume_id, pv, staging, cap)


def target_of(proxy, vol: Vol, pod: str) -> Path:
    target = proxy.target(pod, vol.pv)
    target.parent.mkdir(parents=True, exist_ok=True)  # kubelet makes the parent, the plugin the target
    return target


def publish_request(vol: Vol, target: Path, ctx=None, defer=False, cap=None) -> csi_pb2.NodePublishVolumeRequest:
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=vol.id, staging_target_path=str(vol.staging), target_path=str(target),
        volume_capability=cap or vol.cap, volume_context=ctx or {}, defer_fs_ops=defer)


def publish(proxy, vol: Vol, target: Path, ctx=None, defer=False, cap=None) -> csi_pb2.NodePublishVolumeResponse:
    return proxy.node.NodePublishVolume(publish_request(vol, target, ctx, defer, cap), timeout=60)


def fails(call, request, code: grpc.StatusCode, *fragments: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60)
    assert info.value.code() == code, info.value.details()
    for fragment in fragments:
        assert fragment in info.value.details(), info.value.details()
    return info.value.details()


def pod_ctx(namespace: str, name: str, **extra) -> dict[str, str]:
    return {POD_NAMESPACE: namespace, POD_NAME: name, **extra}


# -- what is on disk and in the kernel -------------------------------------------------------------


def digest(target: Path) -> str:
    return hashlib.sha256(str(target).encode()).hexdigest()


def entry_dir(proxy, target: Path) -> Path:
    return proxy.volumes_dir / digest(target)


def kata_dir(proxy, target: Path) -> Path:
    return proxy.kata_dir / kata_name(str(target))


def decision_file(proxy, target: Path) -> Path:
    return proxy.state_dir / "decisions" / f"{digest(target)}.json"


def record_file(proxy, target: Path) -> Path:
    return proxy.state_dir / "volumes" / f"{digest(target)}.json"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def loop_of(driver, vid: str) -> str:
    backing = str((driver.data_dir / "pools" / driver.node_id / "volumes" / f"{vid}.img").resolve())
    devices = [d for d, b in sysloop.attached().items() if b == backing]
    assert len(devices) == 1, devices
    return devices[0]


def fs_mounts(device: str) -> list[sysmount.MountEntry]:
    """Mounts of the file system on `device` (not binds of the device node)."""
    rdev = os.stat(device).st_rdev
    return sysmount.of_device(os.major(rdev), os.minor(rdev))


def assert_placeholder(target: Path) -> None:
    entry = sysmount.at(str(target))
    assert entry is not None, f"nothing mounted at {target}"
    assert (entry.fs_type, entry.source) == ("tmpfs", PLACEHOLDER)
    assert entry.readonly
    assert os.listdir(target) == []
    with pytest.raises(OSError) as info:
        (target / "data").write_bytes(b"must not land on the host")
    assert info.value.errno == errno.EROFS


def assert_deferred_entry(proxy, driver, vol: Vol, target: Path, metadata: dict[str, str]) -> dict:
    """The canonical entry and its Kata mirror, with modes and content; returns the JSON."""
    device = loop_of(driver, vol.id)
    entry = entry_dir(proxy, target)
    info_file = entry / "mountInfo.json"
    assert mode(proxy.volumes_dir) == 0o700
    assert mode(entry) == 0o700 and stat.S_ISDIR(os.lstat(entry).st_mode)
    assert mode(info_file) == 0o600 and stat.S_ISREG(os.lstat(info_file).st_mode)
    assert sorted(os.listdir(entry)) == ["mountInfo.json"]
    info = json.loads(info_file.read_text())
    rdev = os.stat(device).st_rdev
    assert info["volume-type"] == "block"
    assert info["device"] == device
    assert (info["device-major"], info["device-minor"]) == (os.major(rdev), os.minor(rdev))
    assert info["fstype"] == "ext4"
    assert info["target-path"] == str(target)
    assert info["volume-id"] == vol.id
    assert info["capacity-bytes"] == SIZE
    assert info["readonly"] is False
    assert info["metadata"] == metadata
    mirror = kata_dir(proxy, target) / "mountInfo.json"
    assert mode(mirror.parent) == 0o700 and mode(mirror) == 0o600
    assert json.loads(mirror.read_text()) == info
    # Deferred means: the file system is mounted nowhere on the host, and
    # the target holds only the read-only placeholder.
    assert fs_mounts(device) == []
    assert_placeholder(target)
    return info


def assert_decision(proxy, target: Path, vol: Vol, reason: str) -> dict:
    path = decision_file(proxy, target)
    assert mode(path) == 0o600
    decision = json.loads(path.read_text())
    assert decision["target_path"] == str(target)
    assert decision["volume_id"] == vol.id
    assert decision["deferred"] is True
    assert decision["reason"] == reason
    return decision


def assert_no_trace(proxy, target: Path) -> None:
    """Nothing of a deferred publish exists for this target."""
    assert not entry_dir(proxy, target).exists()
    assert not kata_dir(proxy, target).exists()
    assert not decision_file(proxy, target).exists()
    assert not record_file(proxy, target).exists()
    assert sysmount.at(str(target)) is None


def assert_not_deferred(proxy, target: Path) -> None:
    """No entry, mirror, record or decision for a target published on the host."""
    assert not entry_dir(proxy, target).exists()
    assert not kata_dir(proxy, target).exists()
    assert not decision_file(proxy, target).exists()
    assert not record_file(proxy, target).exists()


def assert_host_publish(driver, vol: Vol, target: Path, payload: bytes) -> None:
    """A normal publish: the volume's own file system is at the target, and
    what a pod writes there reaches the volume."""
    device = loop_of(driver, vol.id)
    entry = sysmount.at(str(target))
    assert entry is not None and entry.source != PLACEHOLDER
    rdev = os.stat(device).st_rdev
    assert (entry.major, entry.minor) == (os.major(rdev), os.minor(rdev))
    assert entry.fs_type == "ext4" and not entry.readonly
    (target / "pod-data").write_bytes(payload)
    os.sync()
    # Drop the device's page cache (this test's own loop device) so the read
    # sees what reached the device, not what an earlier read cached.
    subprocess.run(["blockdev", "--flushbufs", device], check=True)
    with open(device, "rb") as f:
        assert payload in f.read()


def shim_requests(shim, rpc: str) -> list[dict]:
    """The requests the shim logged for one RPC (its structured JSON log)."""
    found = []
    for line in shim.log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("rpc") == rpc and entry.get("msg") in ("ok", "failed"):
            found.append(entry["request"])
    return found


def registry(proxy) -> registry_pb2_grpc.RegistryStub:
    return registry_pb2_grpc.RegistryStub(proxy.runtime_channel())


# -- deferral by its three sources ---------------------------------------------------------------------


def test_defer_requested_by_the_co_writes_the_entry_and_mounts_nothing_on_the_host(root):
    driver, shim, proxy = start_stack(root)  # no policy file: only the request's flag defers
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "pod-a")
    cap = mount_cap("ext4")
    cap.mount.volume_supplemental_group = "1234"
    cap.mount.volume_supplemental_group_change_policy = "Always"
    rsp = publish(proxy, a, target, defer=True, cap=cap)
    assert rsp.deferred_mount.device == loop_of(driver, a.id)
    info = assert_deferred_entry(proxy, driver, a, target, {"fsGroup": "1234", "fsGroupChangePolicy": "Always"})
    assert_decision(proxy, target, a, "requested by the CO")
    # kubelet retries a publish whose answer it lost: same answer, same entry.
    assert publish(proxy, a, target, defer=True, cap=cap) == rsp
    assert assert_deferred_entry(proxy, driver, a, target, info["metadata"]) == info

    # A CO that speaks defer_fs_ops passes fsGroup itself: pod info in the
    # context needs no Kubernetes access (this proxy has none configured).
    b = new_volume(proxy, "pv-b")
    target_b = target_of(proxy, b, "pod-b")
    publish(proxy, b, target_b, ctx=pod_ctx("team", "pod-b"), defer=True)
    assert_deferred_entry(proxy, driver, b, target_b, {})

    # A target outside the kubelet root is never written into the directory.
    c = new_volume(proxy, "pv-c")
    outside = root.path / "elsewhere" / "mount"
    outside.parent.mkdir()
    fails(proxy.node.NodePublishVolume, publish_request(c, outside, defer=True), Code.INVALID_ARGUMENT,
          "outside the kubelet root")
    assert_no_trace(proxy, outside)
    assert not outside.exists()

    # Unpublish by a CO that sends the flag: placeholder, target, entry,
    # mirror, record and decision are gone; again is fine (idempotent).
    proxy.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=a.id, target_path=str(target), defer_fs_ops=True), timeout=60)
    assert_no_trace(proxy, target)
    assert not target.exists()
    proxy.unpublish(a.id, target)
    assert entry_dir(proxy, target_b).exists()  # the other volume is untouched


def test_storage_class_parameter_defers_and_carries_the_pods_fs_group(root, kube):
    kube.add("team", "web", "runc", fs_group=3000, change_policy="Always")
    kube.add("team", "vm", "kata", fs_group=2000)
    driver, shim, proxy = start_stack(root, f"""
deferral:
  storageClassParameters:
    {DEFER_PARAM}: "true"
  runtimeClasses: [kata]
kubernetes:
  apiServer: {kube.url}
  timeoutSeconds: 3
""")
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "web")
    publish(proxy, a, target, ctx=pod_ctx("team", "web", **{DEFER_PARAM: "true"}))
    assert_deferred_entry(proxy, driver, a, target, {"fsGroup": "3000", "fsGroupChangePolicy": "Always"})
    assert_decision(proxy, target, a, f"volume_context {DEFER_PARAM}=true")
    assert kube.asked("team", "web") == 1  # only for the fsGroup

    # Another value of the parameter: a normal host publish, no entry.
    b = new_volume(proxy, "pv-b")
    target_b = target_of(proxy, b, "web")
    publish(proxy, b, target_b, ctx={DEFER_PARAM: "false"})
    assert_host_publish(driver, b, target_b, b"written-by-a-runc-pod")
    assert_not_deferred(proxy, target_b)

    # Raw block is never deferred, even when both rules match: the device
    # node is bound at the target and no one asks the API server.
    c = new_volume(proxy, "pv-c", cap=block_cap())
    block_target = proxy.kubelet_root / "plugins" / "kubernetes.io" / "csi" / "volumeDevices" / "publish" / \
        "pv-c" / "uid-vm"
    block_target.parent.mkdir(parents=True)
    asked = len(kube.requests)
    publish(proxy, c, block_target, ctx=pod_ctx("team", "vm", **{DEFER_PARAM: "true"}))
    st = os.stat(block_target)
    assert stat.S_ISBLK(st.st_mode) and st.st_rdev == os.stat(loop_of(driver, c.id)).st_rdev
    assert len(kube.requests) == asked
    assert not entry_dir(proxy, block_target).exists()
    assert not decision_file(proxy, block_target).exists()
    assert sorted(os.listdir(proxy.volumes_dir)) == [digest(target)]


RUNTIME_CLASS_POLICY = """
deferral:
  runtimeClasses: [kata, kata-qemu]
kubernetes:
  apiServer: {url}
  timeoutSeconds: 2
"""


def test_runtime_class_looked_up_in_the_api_server_decides(root, kube):
    kube.add("team", "sandboxed", "kata", fs_group=2000, change_policy="OnRootMismatch")
    kube.add("team", "plain", "runc", fs_group=2000, change_policy="OnRootMismatch")
    driver, shim, proxy = start_stack(root, RUNTIME_CLASS_POLICY.format(url=kube.url))

    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "sandboxed")
    publish(proxy, a, target, ctx=pod_ctx("team", "sandboxed"))
    assert_deferred_entry(proxy, driver, a, target, {"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"})
    assert_decision(proxy, target, a, "runtime class kata")
    assert kube.asked("team", "sandboxed") == 1  # one lookup answers both questions

    # A pod of another runtime class: published on the host as usual, and
    # the pod's data lands on the volume.
    b = new_volume(proxy, "pv-b")
    target_b = target_of(proxy, b, "plain")
    publish(proxy, b, target_b, ctx=pod_ctx("team", "plain"))
    assert kube.asked("team", "plain") == 1
    assert_host_publish(driver, b, target_b, b"runc-pod-payload-1")
    assert_not_deferred(proxy, target_b)

    # No pod info in volume_context (podInfoOnMount off): the runtime-class
    # rule cannot apply, nobody is asked, the publish is a host publish.
    asked = len(kube.requests)
    target_c = target_of(proxy, b, "no-pod-info")
    publish(proxy, b, target_c)
    assert len(kube.requests) == asked
    assert_host_publish(driver, b, target_c, b"runc-pod-payload-2")
    assert_not_deferred(proxy, target_c)
    assert sorted(os.listdir(proxy.volumes_dir)) == [digest(target)]
    assert sorted(p.name for p in (proxy.state_dir / "decisions").iterdir()) == [f"{digest(target)}.json"]

    # The bytes written through both host targets are on the volume's disk.
    for t in (target_b, target_c):
        proxy.unpublish(b.id, t)
        assert not t.exists()
    proxy.unstage(b.id, b.staging)
    backing = (driver.data_dir / "pools" / driver.node_id / "volumes" / f"{b.id}.img").read_bytes()
    assert b"runc-pod-payload-1" in backing and b"runc-pod-payload-2" in backing


def test_api_server_errors_refuse_the_publish_and_leave_nothing(root, kube):
    kube.add("team", "sandboxed", "kata")
    kube.errors[("team", "flaky")] = 500
    driver, shim, proxy = start_stack(root, RUNTIME_CLASS_POLICY.format(url=kube.url))
    a = new_volume(proxy, "pv-a")
    device = loop_of(driver, a.id)

    def refused(pod: str, *fragments: str) -> None:
        target = target_of(proxy, a, pod)
        fails(proxy.node.NodePublishVolume, publish_request(a, target, ctx=pod_ctx("team", pod)),
              Code.UNAVAILABLE, "cannot decide deferral", f"team/{pod}", *fragments)
        assert not target.exists()
        assert_no_trace(proxy, target)
        assert fs_mounts(device) == []
        assert os.listdir(proxy.volumes_dir) == [] and os.listdir(proxy.kata_dir) == []
        assert os.listdir(proxy.state_dir / "decisions") == []
        assert os.listdir(proxy.state_dir / "volumes") == []

    refused("flaky", "500")
    assert kube.asked("team", "flaky") == 1
    refused("ghost", "404")  # the pod is not (yet) known to the API server
    kube.stop()
    refused("sandboxed")  # unreachable
    # The shim never saw a publish of the volume.
    assert shim_requests(shim, "NodePublishVolume") == []


def test_without_kubernetes_access_only_a_publish_that_needs_the_pod_is_refused(root):
    driver, shim, proxy = start_stack(root, f"""
deferral:
  storageClassParameters:
    {DEFER_PARAM}: "true"
  fsGroupFromPod: true
kubernetes:
  kubeconfig: {root.path / "no-such-kubeconfig"}
""")
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "pod-a")
    # The pod's fsGroup must travel with the volume, and cannot be read.
    request = publish_request(a, target, ctx=pod_ctx("team", "pod-a", **{DEFER_PARAM: "true"}))
    fails(proxy.node.NodePublishVolume, request, Code.UNAVAILABLE, "cannot decide deferral", "team/pod-a",
          "no access to the Kubernetes API")
    assert not target.exists()
    assert_no_trace(proxy, target)
    assert fs_mounts(loop_of(driver, a.id)) == []
    # Without pod info (podInfoOnMount off) nothing needs the API: deferred.
    publish(proxy, a, target, ctx={DEFER_PARAM: "true"})
    assert_deferred_entry(proxy, driver, a, target, {})


def test_plugin_without_defer_fs_ops_is_refused_before_anything_happens(root):
    driver, shim, proxy = start_stack(root, f"""
deferral:
  storageClassParameters:
    {DEFER_PARAM}: "true"
  fsGroupFromPod: false
""", shim_extra=["--no-advertise-deferral"])
    caps = {c.rpc.type for c in proxy.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()).capabilities}
    assert RPC.DEFER_FS_OPS not in caps and RPC.STAGE_UNSTAGE_VOLUME in caps
    a = new_volume(proxy, "pv-a")
    device = loop_of(driver, a.id)
    target = target_of(proxy, a, "pod-a")
    for request in (publish_request(a, target, ctx={DEFER_PARAM: "true"}), publish_request(a, target, defer=True)):
        fails(proxy.node.NodePublishVolume, request, Code.FAILED_PRECONDITION, "DEFER_FS_OPS",
              "refusing rather than mounting on the host")
        assert not target.exists()
        assert_no_trace(proxy, target)
        assert fs_mounts(device) == []
        assert os.listdir(proxy.state_dir / "decisions") == []
        assert os.listdir(proxy.volumes_dir) == []
    assert shim_requests(shim, "NodePublishVolume") == []
    # Without deferral the plugin serves the volume as usual.
    publish(proxy, a, target, ctx={DEFER_PARAM: "no"})
    assert_host_publish(driver, a, target, b"plain-publish")


# -- the decision on disk, a restart, and the runtime answering ----------------------------------------


DEFER_POLICY = f"""
deferral:
  storageClassParameters:
    {DEFER_PARAM}: "true"
  fsGroupFromPod: false
"""


def test_decision_survives_a_restart_and_the_runtime_answers_stats_and_expand(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "pod-a")
    publish(proxy, a, target, ctx={DEFER_PARAM: "true"})
    assert_decision(proxy, target, a, f"volume_context {DEFER_PARAM}=true")
    before = decision_file(proxy, target).read_bytes()

    proxy.restart()
    assert decision_file(proxy, target).read_bytes() == before
    assert_placeholder(target)

    handler.register(proxy.runtime_channel())
    claimed = json.loads(handler.claim(proxy.runtime_channel(), target, "sb-restart").mount_info_json)
    assert claimed["target-path"] == str(target) and claimed["volume-id"] == a.id

    # Kubelet (no flag) asks for stats: the numbers are the handler's.
    stats = proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=a.id, volume_path=str(target)), timeout=30)
    by_unit = {u.unit: u for u in stats.usage}
    assert (by_unit[Usage.BYTES].total, by_unit[Usage.BYTES].used, by_unit[Usage.BYTES].available) == \
        (987_654_321, 123_456_789, 987_654_321 - 123_456_789)
    assert (by_unit[Usage.INODES].total, by_unit[Usage.INODES].used) == (40_000, 1_234)
    assert stats.volume_condition.message == "measured inside sb" and not stats.volume_condition.abnormal
    assert ("GetVolumeStats", str(target), "sb-restart") in handler.calls

    # Expansion: the controller grows the volume, kubelet (no flag) asks the
    # node; the device grows on the host, the file system in the sandbox.
    proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=a.id, capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MIB),
        volume_capability=a.cap), timeout=60)
    expanded = proxy.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
        volume_id=a.id, volume_path=str(target), capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MIB),
        volume_capability=a.cap), timeout=60)
    assert expanded.capacity_bytes == 48 * MIB
    assert [(r.target_path, r.sandbox_id, r.capacity_range.required_bytes) for r in handler.expand_requests] == \
        [(str(target), "sb-restart", 48 * MIB)]
    assert sysblock.size_bytes(loop_of(driver, a.id)) == 48 * MIB
    assert fs_mounts(loop_of(driver, a.id)) == []
    # The proxy added the flag kubelet left out, from the decision on disk.
    for rpc in ("NodeGetVolumeStats", "NodeExpandVolume"):
        assert [r.get("defer_fs_ops", False) for r in shim_requests(shim, rpc)] == [True], rpc

    # Unpublish without the flag once the sandbox let go: all gone.
    handler.release(proxy.runtime_channel(), target, "sb-restart")
    proxy.unpublish(a.id, target)
    assert_no_trace(proxy, target)
    assert not target.exists()
    assert [r.get("defer_fs_ops", False) for r in shim_requests(shim, "NodeUnpublishVolume")] == [True]


def test_metrics_count_deferred_publishes(root):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    driver, shim, proxy = start_stack(root, DEFER_POLICY, proxy_extra=["--metrics-port", str(port)])

    counter = ("volumes_published_with_deferred_ops_total", ())
    assert scrape_metrics(port)[counter] == 0
    b = new_volume(proxy, "pv-b")
    publish(proxy, b, target_of(proxy, b, "pod-b"), ctx={DEFER_PARAM: "false"})
    after_host = scrape_metrics(port)
    assert after_host[counter] == 0  # a host publish is not counted

    a = new_volume(proxy, "pv-a")
    publish(proxy, a, target_of(proxy, a, "pod-a"), ctx={DEFER_PARAM: "true"})
    after = scrape_metrics(port)
    assert after[counter] == 1
    publish_ok = ("crust_rpc_duration_seconds_count", (("code", "OK"), ("component", "proxy-csi"),
                                                       ("method", "/csi.v1.Node/NodePublishVolume")))
    assert after[publish_ok] == 2
    assert after[("crust_proxy_deferred_volumes", (("state", "unclaimed"),))] == 1


# -- unpublish against a live sandbox ----------------------------------------------------------------------


def test_unpublish_waits_for_the_sandbox_then_removes_everything(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a = new_volume(proxy, "pv-a")
    target = target_of(proxy, a, "pod-a")
    publish(proxy, a, target, ctx={DEFER_PARAM: "true"})
    channel = proxy.runtime_channel()
    handler.register(channel)
    handler.claim(channel, target, "sb-holding")
    marker = kata_dir(proxy, target) / "sb-holding"
    assert marker.is_file() and marker.stat().st_size == 0

    fails(proxy.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(volume_id=a.id,
          target_path=str(target)), Code.UNAVAILABLE, "sb-holding", "mountns")
    # The handler was asked about its sandbox before the refusal (only it
    # sees whether the sandbox is over).
    assert ("GetSandbox", "sb-holding", "") in handler.calls
    assert_placeholder(target)
    assert (entry_dir(proxy, target) / "mountInfo.json").is_file()
    assert marker.is_file()
    assert decision_file(proxy, target).is_file() and record_file(proxy, target).is_file()
    assert shim_requests(shim, "NodeUnpublishVolume") == []  # the plugin was not asked

    handler.release(channel, target, "sb-holding")
    assert not marker.exists()
    proxy.unpublish(a.id, target)
    assert_no_trace(proxy, target)
    assert not target.exists()
    assert os.listdir(proxy.volumes_dir) == [] and os.listdir(proxy.kata_dir) == []
    proxy.unpublish(a.id, target)  # idempotent
    channel.close()


# -- restart after /run was wiped ---------------------------------------------------------------------------


def test_restart_rebuilds_the_wiped_volumes_dir_for_published_targets_only(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a, b = new_volume(proxy, "pv-a"), new_volume(proxy, "pv-b")
    target_a, target_b = target_of(proxy, a, "pod-a"), target_of(proxy, b, "pod-b")
    publish(proxy, a, target_a, ctx={DEFER_PARAM: "true"})
    publish(proxy, b, target_b, ctx={DEFER_PARAM: "true"})
    handler.register(proxy.runtime_channel())
    handler.claim(proxy.runtime_channel(), target_a, "sb-a")
    entry_a = (entry_dir(proxy, target_a) / "mountInfo.json").read_bytes()
    mirror_a = (kata_dir(proxy, target_a) / "mountInfo.json").read_bytes()

    # Reboot of /run while the proxy is down; kubelet cleaned up pod-b.
    proxy.stop()
    shutil.rmtree(proxy.volumes_dir)
    shutil.rmtree(proxy.kata_dir)
    subprocess.run(["umount", str(target_b)], check=True)  # the placeholder this test's stack mounted
    target_b.rmdir()
    proxy.start()

    assert mode(proxy.volumes_dir) == 0o700
    assert (entry_dir(proxy, target_a) / "mountInfo.json").read_bytes() == entry_a
    assert mode(entry_dir(proxy, target_a)) == 0o700 and mode(entry_dir(proxy, target_a) / "mountInfo.json") == 0o600
    assert (kata_dir(proxy, target_a) / "mountInfo.json").read_bytes() == mirror_a
    assert (kata_dir(proxy, target_a) / "sb-a").is_file()  # the claim's marker comes back too
    assert os.listdir(proxy.volumes_dir) == [digest(target_a)]
    assert os.listdir(proxy.kata_dir) == [kata_name(str(target_a))]
    assert not record_file(proxy, target_b).exists() and not decision_file(proxy, target_b).exists()
    assert record_file(proxy, target_a).exists() and decision_file(proxy, target_a).exists()
    volumes = registry(proxy).ListVolumes(registry_pb2.ListVolumesRequest(), timeout=10).volumes
    assert [(v.target_path, v.claim.sandbox_id) for v in volumes] == [(str(target_a), "sb-a")]


# -- crust status -----------------------------------------------------------------------------------------------


def test_crust_status_lists_deferred_volumes_and_handlers(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a, b = new_volume(proxy, "pv-a"), new_volume(proxy, "pv-b")
    target_a, target_b = target_of(proxy, a, "pod-a"), target_of(proxy, b, "pod-b")
    publish(proxy, a, target_a, ctx={DEFER_PARAM: "true"})
    publish(proxy, b, target_b, ctx={DEFER_PARAM: "true"})
    handler.register(proxy.runtime_channel())
    handler.claim(proxy.runtime_channel(), target_b, "sb-status", sandbox_pid=os.getpid())
    endpoint = f"unix://{proxy.runtime_socket}"

    def status(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint", endpoint, *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    data = json.loads(status("--json"))
    volumes = {v["target_path"]: v for v in data["volumes"]}
    assert set(volumes) == {str(target_a), str(target_b)}
    va, vb = volumes[str(target_a)], volumes[str(target_b)]
    assert (va["device"], va["fs_type"], va["state"], va["volume_id"]) == (loop_of(driver, a.id), "ext4",
                                                                           "unclaimed", a.id)
    assert "claim" not in va and va["kata_mirror_error"] == ""
    assert (vb["device"], vb["state"]) == (loop_of(driver, b.id), "claimed")
    assert (vb["claim"]["handler"], vb["claim"]["sandbox_id"]) == ("mountns", "sb-status")
    assert int(vb["claim"]["sandbox_pid"]) == os.getpid()
    assert abs(int(vb["claim"]["claimed_at"]) - time.time()) < 120
    [h] = data["handlers"]
    assert (h["name"], h["endpoint"], h["filesystems"]) == ("mountns", handler.endpoint, ["ext4", "xfs"])
    assert 0 <= h["lease_age_seconds"] < 30
    assert h["lease_expired"] is False

    text = status()
    assert "deferred volumes: 2" in text and "handlers: 1" in text
    line_a = next(line for line in text.splitlines() if line.endswith(str(target_a)))
    line_b = next(line for line in text.splitlines() if line.endswith(str(target_b)))
    assert line_a.split()[:3] == ["unclaimed", "ext4", loop_of(driver, a.id)]
    assert line_b.split()[:4] == ["claimed", "ext4", loop_of(driver, b.id), "mountns/sb-status"]
    handler_line = next(line for line in text.splitlines() if line.strip().startswith("mountns "))
    assert "lease fresh" in handler_line and handler.endpoint in handler_line

    # Unreachable proxy: a message and exit status 1.
    proxy.stop()
    done = subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint", endpoint],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot reach the proxy" in done.stderr


# -- everything else passes through -------------------------------------------------------------------------------


def test_calls_not_intercepted_pass_through_byte_for_byte(root):
    driver, shim, proxy = start_stack(root)
    new_volume(proxy, "pv-a")
    new_volume(proxy, "pv-b")

    def raw(channel, method: str, request) -> bytes:
        call = channel.unary_unary(method)  # no (de)serialisers: bytes in, bytes out
        return call(request.SerializeToString(), timeout=30)

    for method, request in (
        ("/csi.v1.Identity/GetPluginInfo", csi_pb2.GetPluginInfoRequest()),
        ("/csi.v1.Identity/GetPluginCapabilities", csi_pb2.GetPluginCapabilitiesRequest()),
        ("/csi.v1.Controller/ControllerGetCapabilities", csi_pb2.ControllerGetCapabilitiesRequest()),
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest()),
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest(max_entries=1)),
        ("/csi.v1.Node/NodeGetInfo", csi_pb2.NodeGetInfoRequest()),
    ):
        expected = raw(driver.channel, method, request)
        assert raw(proxy.channel, method, request) == expected, method
    listed = csi_pb2.ListVolumesResponse.FromString(raw(proxy.channel, "/csi.v1.Controller/ListVolumes",
                                                        csi_pb2.ListVolumesRequest()))
    assert len(listed.entries) == 2
    # The node capabilities are the plugin's (the shim's), unchanged.
    request = csi_pb2.NodeGetCapabilitiesRequest()
    assert raw(proxy.channel, "/csi.v1.Node/NodeGetCapabilities", request) == \
        raw(shim.channel, "/csi.v1.Node/NodeGetCapabilities", request)
    # Errors too: same code, same message.
    missing = csi_pb2.ControllerGetVolumeRequest(volume_id="vol-00000000000000000000nope")
    codes = []
    for channel in (driver.channel, proxy.channel):
        with pytest.raises(grpc.RpcError) as info:
            raw(channel, "/csi.v1.Controller/ControllerGetVolume", missing)
        codes.append((info.value.code(), info.value.details()))
    assert codes[0] == codes[1] and codes[0][0] != Code.OK
