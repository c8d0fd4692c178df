"""The set-up and helpers of the `crust shim` end-to-end tests
(tests/integration/test_shim_*.py): a real `crust driver` behind a real
`crust shim`, with a Runtime API server (the stand-in for the crust proxy,
tests/harness/runtime_server.py) to answer what the shim defers; the requests the
tests send and the assertions on what the kernel and the disk say afterwards
(loop devices, mounts in /proc/self/mountinfo, blkid signatures, a "sandbox"
that is a private mount namespace, `unshare -m`). Everything lives under the
`root` fixture's temporary directory, which cleans it up.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.csi_shim.records import volume_key
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, AccessMode, mount_cap
from tests.harness.runtime_server import RuntimeServer


Code = grpc.StatusCode
RPC = csi_pb2.NodeServiceCapability.RPC
Usage = csi_pb2.VolumeUsage

SIZE = {"ext4": 32 * MIB, "xfs": 300 * MIB, "block": 16 * MIB}
PLACEHOLDER = "crust-deferred"


# -- the set-up: driver + runtime server + shim ------------------------------------------


@dataclass
class Env:
    root: object  # tests.harness.daemons.Root
    driver: object
    shim: object
    runtime: RuntimeServer

    @property
    def path(self) -> Path:
        return self.root.path

    # paths -------------------------------------------------------------------------------

    def staging(self, vid: str) -> Path:
        return self.path / "kubelet" / "staging" / vid

    def target(self, name: str) -> Path:
        return self.path / "pods" / name / "mount"

    def backing(self, vid: str) -> Path:
        return self.driver.data_dir / "pools" / self.driver.node_id / "volumes" / f"{vid}.img"

    def private(self, vid: str) -> Path:
        return self.shim.state_dir / "backend" / volume_key(vid)

    def record_file(self, vid: str) -> Path:
        return self.shim.state_dir / "volumes" / f"{volume_key(vid)}.json"

    def record(self, vid: str) -> dict:
        return json.loads(self.record_file(vid).read_text())

    def driver_record(self, vid: str) -> dict:
        return json.loads((self.driver.data_dir / "node" / self.driver.node_id / "volumes" / f"{vid}.json")
                          .read_text())

    def loops(self, vid: str) -> list[str]:
        return sysloop.devices_for(self.backing(vid))

    def only_loop(self, vid: str) -> str:
        devices = self.loops(vid)
        assert len(devices) == 1, f"expected one loop device over {vid}, got {devices}"
        return devices[0]

    # CO-side calls through the shim ------------------------------------------------------

    def create(self, name: str, fs_type: str = "ext4", size: int | None = None, cap=None) -> str:
        cap = cap if cap is not None else mount_cap(fs_type)
        return self.shim.create(name, size or SIZE[fs_type], cap=cap).volume_id

    def stage(self, vid: str, fs_type: str = "ext4", flags=(), cap=None, **kw) -> None:
        self.shim.node.NodeStageVolume(stage_req(vid, self.staging(vid), cap or mount_cap(fs_type, flags=flags),
                                                 **kw), timeout=60)

    def publish(self, vid: str, target: Path, fs_type: str = "ext4", *, defer: bool, flags=(), cap=None,
                **kw) -> csi_pb2.NodePublishVolumeResponse:
        return self.shim.node.NodePublishVolume(publish_req(
            vid, self.staging(vid), target, cap or mount_cap(fs_type, flags=flags), defer=defer, **kw), timeout=60)

    def unpublish(self, vid: str, target: Path, defer: bool = True) -> None:
        self.shim.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(target), defer_fs_ops=defer), timeout=60)

    def unstage(self, vid: str) -> None:
        self.shim.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=str(self.staging(vid))), timeout=60)

    def controller_expand(self, vid: str, size: int) -> None:
        resp = self.shim.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=vid, capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=60)
        assert resp.capacity_bytes == size and resp.node_expansion_required
        assert os.path.getsize(self.backing(vid)) == size

    def assert_released(self, vid: str) -> None:
        """After NodeUnstageVolume: no backend publish, no loop device, no record."""
        assert not self.loops(vid), f"loop devices left over {vid}: {self.loops(vid)}"
        assert not mounts_under(self.private(vid)), mounts_under(self.private(vid))
        assert not self.private(vid).exists()
        assert not self.record_file(vid).exists()
        assert sysmount.at(str(self.staging(vid))) is None


def start_runtime(root) -> RuntimeServer:
    return RuntimeServer(socket=root.path / "proxy.sock").start()


@pytest.fixture
def env(root):
    runtime = start_runtime(root)
    try:
        driver = root.driver().start()
        shim = root.shim(driver).start()
        yield Env(root=root, driver=driver, shim=shim, runtime=runtime)
    finally:
        runtime.stop()


# -- requests and assertions ---------------------------------------------------------------


def stage_req(vid, staging, cap, **kw) -> csi_pb2.NodeStageVolumeRequest:
    return csi_pb2.NodeStageVolumeRequest(volume_id=vid, staging_target_path=str(staging),
                                          volume_capability=cap, **kw)


def publish_req(vid, staging, target, cap, *, defer: bool, **kw) -> csi_pb2.NodePublishVolumeRequest:
    return csi_pb2.NodePublishVolumeRequest(volume_id=vid, staging_target_path=str(staging),
                                            target_path=str(target), volume_capability=cap,
                                            defer_fs_ops=defer, **kw)


def deferred_cap(fs_type="ext4", mode=AccessMode.SINGLE_NODE_WRITER, flags=(), group="", policy=""):
    cap = mount_cap(fs_type, mode=mode, flags=flags)
    cap.mount.volume_supplemental_group = group
    cap.mount.volume_supplemental_group_change_policy = policy
    return cap


def fails(call, request, code: grpc.StatusCode, *fragments: str, **kw) -> str:
    """Make a call that must fail with `code`; the message must contain every fragment."""
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=60, **kw)
    err = info.value
    assert err.code() == code, f"expected {code}, got {err.code()}: {err.details()}"
    for fragment in fragments:
        assert fragment in err.details(), f"{fragment!r} not in {err.details()!r}"
    return err.details()


def majmin(device: str) -> tuple[int, int]:
    st = os.stat(device)
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def mounts_at(path: Path) -> list[sysmount.MountEntry]:
    return [m for m in sysmount.mounts() if m.mount_point == str(path)]


def mounts_under(path: Path) -> list[sysmount.MountEntry]:
    prefix = str(path.resolve()) + "/"
    return [m for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]


def fs_mounts(device: str) -> list[sysmount.MountEntry]:
    """Mounts of the file system on `device` (binds included), anywhere on the host."""
    return sysmount.of_device(*majmin(device))


def fs_total(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def assert_placeholder(target: Path) -> None:
    """The target is an empty read-only tmpfs placeholder: writing fails with EROFS."""
    entries = mounts_at(target)
    assert len(entries) == 1, entries
    entry = entries[0]
    assert (entry.fs_type, entry.source) == ("tmpfs", PLACEHOLDER), entry
    assert entry.readonly
    assert os.listdir(target) == []
    with pytest.raises(OSError) as info:
        (target / "escaped").write_bytes(b"must not land on the host")
    assert info.value.errno == errno.EROFS


def assert_device_node_bind(path: Path, device: str) -> None:
    """`path` is a bind mount of the device NODE (devtmpfs), not a mount of its file system."""
    entry = sysmount.at(str(path))
    assert entry is not None, f"nothing mounted at {path}"
    assert entry.fs_type == "devtmpfs" and entry.root == "/" + os.path.basename(device), entry
    assert os.stat(path).st_rdev == os.stat(device).st_rdev


def sandbox(device: str, fs_type: str, mnt: Path, script: str) -> str:
    """Mount the device in a private mount namespace (a stand-in for a sandbox),
    run `script` with $M as the mount point, unmount. The host never sees the mount."""
    mnt.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec",
         f'mount -t "$1" -- "$2" "$3"; M="$3"; {script}; umount "$3"', "sandbox", fs_type, device, str(mnt)],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def regular_files(directory: Path):
    for dirpath, _, names in os.walk(directory):
        for name in names:
            path = Path(dirpath) / name
            if stat.S_ISREG(os.lstat(path).st_mode):
                yield path


def stats_req(vid, path, defer: bool) -> csi_pb2.NodeGetVolumeStatsRequest:
    return csi_pb2.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=str(path), defer_fs_ops=defer)


def expand_req(vid, path, size, defer: bool, fs_type="ext4") -> csi_pb2.NodeExpandVolumeRequest:
    return csi_pb2.NodeExpandVolumeRequest(volume_id=vid, volume_path=str(path), defer_fs_ops=defer,
                                           capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                                           volume_capability=mount_cap(fs_type))
