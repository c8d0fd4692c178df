"""Playing kubelet against `crust proxy`'s CSI endpoint, and what the disk and the kernel say afterwards.

start_stack starts real `crust driver` -> `crust shim` -> `crust proxy`
processes on real unix sockets (tests.harness.daemons Root.stack()), with a policy
file when one is given; the shortcuts create, stage and publish volumes as
the CO and kubelet do, through the proxy. The checks read what crust left:
mounts in /proc/self/mountinfo, loop devices, the watched directory's
mountInfo.json files and their Kata mirror with their modes, the proxy's
decision and volume records, and the shim's JSON log of the requests that
reached the plugin. The `handler` fixture is a runtime handler
(tests.harness.handler_server, a real Handler gRPC server) named mountns, for the
tests to register through the proxy's real registry.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2, registry_pb2_grpc
from crust.contract.mountinfo import kata_name
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.handler_server import HandlerServer, stats_response
from tests.harness.daemons import MIB, mount_cap

POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
PLACEHOLDER = "crust-deferred"
DEFER_PARAM = "crust.dev/defer"
SIZE = 32 * MIB

DEFER_POLICY = f"""
deferral:
  storageClassParameters:
    {DEFER_PARAM}: "true"
  fsGroupFromPod: false
"""


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
    assert json.loads(mirror.read_text()) == {**info, "volume-type": "directvol"}  # what Kata 4 mounts
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
