"""When `crust proxy` defers a publish: its three sources, and its refusals.

Real `crust driver` -> `crust shim` -> `crust proxy` processes
(tests.harness.proxy_csi); the test plays kubelet on the proxy's CSI socket.
A publish is deferred when the CO asks (defer_fs_ops), when a storage class
parameter says so, or when the pod's runtime class, looked up in the API
server, is one of the policy's; a deferred publish writes the entry, its
Kata mirror and the decision, carries the pod's fsGroup, and mounts nothing
on the host but the read-only placeholder, while any other publish mounts
the volume at the target as usual. API server errors, a missing Kubernetes
access a publish needs, and a plugin without DEFER_FS_OPS refuse the
publish and leave nothing. The one stand-in is tests.harness.kube_api's KubeAPI,
playing the Kubernetes API server (GET of a pod), because the runtime-class
rule looks pods up with the official kubernetes client.
"""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from crust.api import csi_pb2
from tests.harness.daemons import block_cap, mount_cap
from tests.harness.kube_api import KubeAPI
from tests.harness.proxy_csi import (
    DEFER_PARAM,
    assert_decision,
    assert_deferred_entry,
    assert_host_publish,
    assert_no_trace,
    assert_not_deferred,
    decision_file,
    digest,
    entry_dir,
    fails,
    fs_mounts,
    loop_of,
    new_volume,
    pod_ctx,
    publish,
    publish_request,
    shim_requests,
    start_stack,
    target_of,
)

Code = grpc.StatusCode
RPC = csi_pb2.NodeServiceCapability.RPC


@pytest.fixture
def kube():
    api = KubeAPI().start()
    try:
        yield api
    finally:
        api.stop()


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
