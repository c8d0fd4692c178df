"""Next to a kubelet: plugin registration, fsGroup delegation, and kubelet's
own call sequences (pod start, kubelet restart, pod stop) replayed by
crust.kubelet against driver -> shim -> proxy on real sockets, with
real loop devices, mounts and sandboxes."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crust.api import csi_pb2, pluginregistration_pb2, pluginregistration_pb2_grpc, registry_pb2, registry_pb2_grpc
from crust.kubelet import (Kubelet, PersistentVolume, Pod, RegistrationRefused, highest_supported_version,
                           is_mount_point)
from crust.proxy.kubelet_registration import SERVICE_NAME
from crust.sys import mount as sysmount
from crust.sys import ownership
from tests.harness.daemons import MIB, mount_cap
from tests.harness.handler_env import Env, digest, kill_container_processes, policy_file, view
from tests.harness.daemons import wait_until

DRIVER = "loop.csi.crust.dev"
DEFER = {"crust.dev/defer": "true"}
GROUP = 3456


class Node:
    """The stack with the proxy serving kubelet's registration, a mount-
    namespace handler, and a kubelet replaying its calls over the proxy."""

    def __init__(self, root, handler: bool = True):
        self.root = root
        kubelet_root = root.path / "kubelet"
        (kubelet_root / "plugins_registry").mkdir(parents=True)
        self.env = Env(root, start_handler=handler, proxy_extra=[
            "--kubelet-registration-dir", str(kubelet_root / "plugins_registry"),
            "--policy", str(policy_file(root.path))])
        self.proxy = self.env.proxy
        self.kubelet = Kubelet(kubelet_root, "node-a", retry_seconds=5)
        self.reg_socket = kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock"

    def pv(self, name: str, fs: str = "ext4", defer: bool = True) -> PersistentVolume:
        vol = self.proxy.create(name, 64 * MIB, mount_cap(fs), parameters=DEFER if defer else {})
        return PersistentVolume(name=name, volume_handle=vol.volume_id, attributes=dict(vol.volume_context), fs_type=fs)

    def node_status(self) -> registry_pb2.GetNodeStatusResponse:
        with self.proxy.runtime_channel() as channel:
            return registry_pb2_grpc.RegistryStub(channel).GetNodeStatus(registry_pb2.GetNodeStatusRequest(), timeout=10)

    def health(self, service: str) -> int:
        with grpc.insecure_channel(f"unix://{self.proxy.socket}") as channel:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def entry(self, target: Path) -> Path:
        return self.proxy.volumes_dir / digest(str(target)) / "mountInfo.json"

    def mounts_under_kubelet(self) -> list[tuple[str, str, str]]:
        prefix = str(self.kubelet.root) + "/"
        return sorted((m.mount_point, m.fs_type, m.source) for m in sysmount.mounts()
                      if m.mount_point.startswith(prefix))


@pytest.fixture
def node(root):
    n = Node(root)
    try:
        yield n
    finally:
        n.env.delete_sandboxes()
        kill_container_processes(n.env.path / "bundles")


# -- plugin registration ---------------------------------------------------------------------------


def test_kubelet_registers_the_driver_through_the_proxy(node):
    with grpc.insecure_channel(f"unix://{node.reg_socket}") as channel:
        info = pluginregistration_pb2_grpc.RegistrationStub(channel).GetInfo(
            pluginregistration_pb2.InfoRequest(), timeout=1)
    assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == \
        ("CSIPlugin", DRIVER, str(node.proxy.socket), ["1.0.0"])
    assert node.node_status().kubelet_registration.state == "waiting"

    assert node.kubelet.register() == DRIVER
    assert node.kubelet.endpoint == str(node.proxy.socket), "kubelet must talk to the proxy, not past it"
    assert node.kubelet.log.names() == ["NodeGetInfo"]
    reg = node.node_status().kubelet_registration
    assert (reg.state, reg.error, reg.driver_name) == ("registered", "", DRIVER)
    assert 0 <= reg.info_age_seconds < 60 and 0 <= reg.verdict_age_seconds < 60
    assert node.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING


def test_a_refusal_by_kubelet_is_surfaced_and_retried(node):
    with grpc.insecure_channel(f"unix://{node.reg_socket}") as channel:
        pluginregistration_pb2_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            pluginregistration_pb2.RegistrationStatus(plugin_registered=False, error="RegisterPlugin error -- boom"),
            timeout=5)
    reg = node.node_status().kubelet_registration
    assert (reg.state, reg.error) == ("refused", "RegisterPlugin error -- boom")
    assert node.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
    status = subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint",
                             f"unix://{node.proxy.runtime_socket}"], capture_output=True, text=True, timeout=30)
    assert status.returncode == 1, "a refusal makes `crust status` fail"
    assert "refused" in status.stdout and "boom" in status.stdout

    # Kubelet asks again only for a new socket: the proxy makes one.
    wait_until(lambda: node.node_status().kubelet_registration.socket_recreated == 1, timeout=10,
               what="a new registration socket after the refusal")
    reg = node.node_status().kubelet_registration
    assert (reg.state, reg.error) == ("waiting", "RegisterPlugin error -- boom"), "the refusal stays visible" 
    node.kubelet.register()
    reg = node.node_status().kubelet_registration
    assert (reg.state, reg.error) == ("registered", "")
    assert node.health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING


def test_the_registration_socket_comes_back_and_goes_on_stop(node):
    node.kubelet.register()
    node.reg_socket.unlink()
    wait_until(node.reg_socket.exists, timeout=5, what="the socket to be made again")
    assert node.kubelet.register() == DRIVER
    # A kubelet restart may wipe the directory itself.
    registry = node.reg_socket.parent
    node.reg_socket.unlink()
    registry.rmdir()
    wait_until(node.reg_socket.exists, timeout=5, what="the directory and the socket to be made again")
    assert node.kubelet.register() == DRIVER
    assert node.node_status().kubelet_registration.socket_recreated == 2
    assert node.proxy.stop() == 0
    assert not node.reg_socket.exists(), "a clean stop removes the socket, so kubelet deregisters the driver"


def test_kubelet_refuses_versions_it_does_not_speak():
    assert highest_supported_version(["1.0.0"]) == "1.0.0"
    assert highest_supported_version(["0.3.0", "v1.5.0", "2.0.0"]) == "v1.5.0"
    for bad in ([], ["1"], ["2.0.0"], ["0.3.0"]):
        with pytest.raises(RegistrationRefused):
            highest_supported_version(bad)


# -- fsGroup delegation --------------------------------------------------------------------------------


def test_fs_group_of_a_deferred_volume_reaches_the_sandbox(node):
    node.kubelet.register()
    pv = node.pv("pv-fsg-deferred")
    pod = Pod(uid="uid-deferred", name="web", fs_group=GROUP)
    target = node.kubelet.start_pod(pv, pod)
    assert node.kubelet.chowned == [], "kubelet's own ownership walk must never run"
    info = json.loads(node.entry(target).read_text())
    assert info["metadata"] == {"fsGroup": str(GROUP), "fsGroupChangePolicy": "OnRootMismatch"}
    placeholder = sysmount.at(str(target))
    assert placeholder is not None and placeholder.fs_type == "tmpfs", "the target stays the placeholder"

    env = node.env
    sandbox = env.run_ok(env.bundle("fsg", "echo data > /data/file && mkdir /data/dir",
                                    [("/data", str(target))]), "sb-fsg")
    env.wait_exited("sb-fsg")
    vroot = view(sandbox, sandbox["volumes"][0]["mount_point"])
    root_st = os.stat(vroot)
    assert root_st.st_gid == GROUP and root_st.st_mode & (stat.S_ISGID | 0o070) == stat.S_ISGID | 0o070
    assert os.stat(vroot / "lost+found").st_gid == GROUP
    assert os.stat(vroot / "file").st_gid == GROUP, "files made in the sandbox inherit the group"
    assert os.stat(vroot / "dir").st_gid == GROUP
    env.delete("sb-fsg")
    node.kubelet.stop_pod(pv, pod)


def test_fs_group_of_a_host_volume_is_applied_by_the_shim(node):
    node.kubelet.register()
    pv = node.pv("pv-fsg-host", defer=False)
    owner = Pod(uid="uid-writer", name="writer")
    target = node.kubelet.start_pod(pv, owner)
    (target / "old").write_text("from before")
    os.chmod(target / "old", 0o600)
    (target / "sub").mkdir(mode=0o700)
    (target / "sub" / "deep").write_text("deep")
    outside = node.root.path / "outside"
    outside.write_text("host file")
    os.symlink(outside, target / "link")
    node.kubelet.stop_pod(pv, owner)

    pod = Pod(uid="uid-fsg", name="app", fs_group=GROUP)
    target = node.kubelet.start_pod(pv, pod)
    assert node.kubelet.chowned == [], "kubelet's own ownership walk must never run"
    entry = sysmount.at(str(target))
    assert entry is not None and entry.fs_type == "ext4", "a host publish mounts the file system"
    for path, mode in ((target, 0o770 | stat.S_ISGID), (target / "sub", 0o770 | stat.S_ISGID),
                       (target / "old", 0o660), (target / "sub" / "deep", 0o660)):
        st = os.lstat(path)
        assert st.st_gid == GROUP, path
        assert stat.S_IMODE(st.st_mode) & mode == mode, (path, oct(st.st_mode))
    assert os.lstat(target / "link").st_gid == GROUP, "a symlink gets the group itself"
    assert os.stat(outside).st_gid == 0, "and is never followed out of the volume"
    node.kubelet.stop_pod(pv, pod)


def test_ownership_walk_on_descriptors(tmp_path):
    (tmp_path / "d").mkdir(mode=0o700)
    (tmp_path / "d" / "f").write_text("x")
    os.chmod(tmp_path / "d" / "f", 0o400)
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        assert ownership.apply_fs_group(fd, GROUP, readonly=True)
        assert stat.S_IMODE(os.stat(tmp_path / "d" / "f").st_mode) == 0o440
        assert stat.S_IMODE(os.stat(tmp_path / "d").st_mode) == 0o750 | stat.S_ISGID
        os.chown(tmp_path / "d" / "f", -1, 0)
        assert not ownership.apply_fs_group(fd, GROUP, ownership.ON_ROOT_MISMATCH, readonly=True)
        assert os.stat(tmp_path / "d" / "f").st_gid == 0, "OnRootMismatch: a matching root skips the walk"
        assert ownership.apply_fs_group(fd, GROUP, ownership.ALWAYS)
        assert os.stat(tmp_path / "d" / "f").st_gid == GROUP
    finally:
        os.close(fd)


# -- kubelet's sequences ------------------------------------------------------------------------------------


POD_START = ["NodeGetCapabilities", "NodeGetCapabilities", "NodeGetCapabilities", "NodeStageVolume",
             "NodeGetCapabilities", "NodeGetCapabilities", "NodeGetCapabilities", "NodePublishVolume"]


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred", "host"])
def test_pod_start_kubelet_restart_and_pod_stop(node, deferred):
    kubelet = node.kubelet
    kubelet.register()
    pv = node.pv(f"pv-seq-{'d' if deferred else 'h'}", defer=deferred)
    pod = Pod(uid=f"uid-seq-{int(deferred)}", name="seq", fs_group=GROUP)
    kubelet.log.calls.clear()
    target = kubelet.start_pod(pv, pod)
    assert kubelet.log.names() == POD_START
    staging = kubelet.staging_path(pv)
    assert staging.parent.name == hashlib.sha256(pv.volume_handle.encode()).hexdigest()
    assert json.loads((staging.parent / "vol_data.json").read_text()) == \
        {"driverName": DRIVER, "volumeHandle": pv.volume_handle}
    vol_data = json.loads((target.parent / "vol_data.json").read_text())
    assert vol_data["specVolID"] == pv.name and vol_data["volumeLifecycleMode"] == "Persistent"
    entry = node.entry(target)
    assert entry.exists() == deferred
    before_entry = entry.read_bytes() if deferred else b""
    before_mounts = node.mounts_under_kubelet()
    if deferred:
        assert before_mounts == [(str(target), "tmpfs", "crust-deferred")], "nothing but the placeholder"
    else:
        assert {m[0] for m in before_mounts} == {str(target), str(staging)}

    # Stats, as kubelet asks (volume_id and volume_path only); a deferred
    # volume's are answered from inside a sandbox, so run one first.
    if deferred:
        node.env.run_ok(node.env.bundle("seq", "sleep 30", [("/data", str(target))]), "sb-seq")
    usage = {u.unit: u for u in kubelet.volume_stats(pv, pod).usage}
    assert usage[csi_pb2.VolumeUsage.BYTES].total > 0

    # Kubelet restarts: it finds the volume from vol_data.json, sees the
    # target mounted, and stages and publishes it again: OK, no side effect.
    kubelet.log.calls.clear()
    found = kubelet.restart({pod.uid: (pv, pod)})
    assert [(uid, data["volumeHandle"], mounted) for uid, data, mounted in found] == \
        [(pod.uid, pv.volume_handle, True)]
    assert kubelet.log.names() == ["NodeGetInfo"] + POD_START
    assert node.mounts_under_kubelet() == before_mounts, "the second stage and publish changed the mounts"
    if deferred:
        assert entry.read_bytes() == before_entry, "the second publish rewrote mountInfo.json"
        node.env.delete("sb-seq")

    # The pod stops: unpublish, unstage, and kubelet's directories go.
    kubelet.log.calls.clear()
    kubelet.stop_pod(pv, pod)
    assert kubelet.log.names() == ["NodeUnpublishVolume", "NodeGetCapabilities", "NodeUnstageVolume"]
    assert node.mounts_under_kubelet() == []
    assert not target.parent.exists() and not staging.parent.exists()
    assert not entry.exists()
    node.proxy.delete(pv.volume_handle)


def test_unpublish_is_retried_while_a_sandbox_holds_the_volume(node):
    kubelet = node.kubelet
    kubelet.register()
    pv = node.pv("pv-held")
    pod = Pod(uid="uid-held", name="held")
    target = kubelet.start_pod(pv, pod)
    node.env.run_ok(node.env.bundle("held", "sleep 60", [("/data", str(target))]), "sb-held")
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.stop_pod(pv, pod)  # retried with kubelet's backoff for retry_seconds
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started >= 3, "kubelet retries with its backoff (0.5, 1, 2 s...)"
    assert is_mount_point(target), "kubelet keeps its directories while the unpublish fails"
    assert kubelet.log.names().count("NodeUnpublishVolume") >= 3
    node.env.delete("sb-held")
    kubelet.stop_pod(pv, pod)
    assert not target.parent.exists()
