"""`crust shim` end to end: real `crust driver` behind a real `crust shim`.

Every test talks to real processes over unix sockets and checks what the
kernel and the disk say afterwards: loop devices in /sys/block, mounts in
/proc/self/mountinfo, signatures from blkid, bytes in the volume's backing
file, the shim's JSON records, and what a Runtime API server (the stand-in
for the crust proxy, tests/runtime_server.py) was asked. A "sandbox" is a
private mount namespace (`unshare -m`): a mount there never shows on the host.
Everything lives under the `root` fixture's temporary directory, which
cleans it up.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.csi_shim.records import volume_key
from crust.sys import blockdev as sysblock
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness import MIB, AccessMode, UnixGrpcServer, block_cap, csi_unary_handler, mount_cap
from tests.runtime_server import RuntimeServer, usage_response

Code = grpc.StatusCode
RPC = csi_pb2.NodeServiceCapability.RPC
Usage = csi_pb2.VolumeUsage

SIZE = {"ext4": 32 * MIB, "xfs": 300 * MIB, "block": 16 * MIB}
PLACEHOLDER = "crust-deferred"


# -- the set-up: driver + runtime server + shim ------------------------------------------


@dataclass
class Env:
    root: object  # tests.harness.Root
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


def blkid(path: Path | str, tag: str = "TYPE") -> str:
    out = subprocess.run(["blkid", "-p", "-o", "value", "-s", tag, "--", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


# -- deferred publish: nothing on the host, the sandbox mounts --------------------------------


@pytest.mark.parametrize("fs_type", ["ext4", "xfs"])
def test_deferred_publish_mounts_nothing_on_the_host_and_a_sandbox_can_use_it(env, fs_type):
    vid = env.create(f"defer-{fs_type}", fs_type)
    env.stage(vid, fs_type)
    device = env.only_loop(vid)
    # Staged as raw block at the backend, into the shim's private dir; nothing mounted.
    assert_device_node_bind(env.private(vid) / "device", device)
    assert fs_mounts(device) == []
    assert sysmount.at(str(env.staging(vid))) is None
    assert blkid(device) == fs_type

    target = env.target("a")
    resp = env.publish(vid, target, fs_type, defer=True)
    dm = resp.deferred_mount
    assert resp.HasField("deferred_mount")
    assert (dm.device, dm.fs_type, dm.volume_type) == (device, fs_type, "block")
    assert (dm.device_major, dm.device_minor) == majmin(device)

    # No mount of the volume's file system anywhere on the host: only the
    # device node at the shim's private path and the placeholder on the target.
    assert sysmount.of_device(dm.device_major, dm.device_minor) == []
    assert_placeholder(target)
    node_binds = [m.mount_point for m in sysmount.of_device_node(device)]
    assert node_binds == [str(env.private(vid) / "device")], node_binds

    # The sandbox mounts the device from the description and writes.
    sandbox(dm.device, dm.fs_type, env.path / "sandbox", 'echo data > "$M/f"')
    assert sysmount.of_device(dm.device_major, dm.device_minor) == []
    assert_placeholder(target)
    assert env.runtime.calls == []

    env.unpublish(vid, target)
    assert mounts_at(target) == [] and not target.exists()
    assert env.record(vid)["published"] == {}

    # Back on the host without deferral: the sandbox's write is there.
    host = env.target("b")
    resp = env.publish(vid, host, fs_type, defer=False)
    assert not resp.HasField("deferred_mount")
    assert (host / "f").read_text() == "data\n"
    entry = sysmount.at(str(host))
    assert (entry.major, entry.minor, entry.fs_type) == (dm.device_major, dm.device_minor, fs_type)

    env.unpublish(vid, host, defer=False)
    env.unstage(vid)
    env.assert_released(vid)
    assert not host.exists()


def test_deferred_mount_description(env):
    secrets = {"password": "s3cr3t-stage-value-8c1f", "token": "s3cr3t-publish-value-77d2"}
    context = {"team": "blue", "storage.example/zone": "z1"}
    flags = ["noatime", "bind", "context=system_u:object_r:foo_t:s0"]

    vid = env.create("desc", "ext4", size=48 * MIB)
    env.stage(vid, "ext4", flags=flags, secrets={"password": secrets["password"]}, volume_context=context)
    device = env.only_loop(vid)

    # Read-write publish with host-only flags: only noatime survives.
    target = env.target("rw")
    resp = env.publish(vid, target, cap=deferred_cap("ext4", flags=flags, group="2000", policy="OnRootMismatch"),
                       defer=True, secrets={"token": secrets["token"]}, volume_context=context)
    dm = resp.deferred_mount
    st = os.stat(dm.device)
    assert stat.S_ISBLK(st.st_mode)
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (dm.device_major, dm.device_minor)
    assert sysloop._backing_file(os.path.basename(dm.device)) == str(env.backing(vid).resolve())
    assert dm.device == device
    assert dm.volume_type == "block" and dm.fs_type == "ext4" and dm.volume_id == vid
    assert dm.capacity_bytes == sysblock.size_bytes(device) == 48 * MIB
    assert list(dm.mount_options) == ["noatime"]
    assert dm.readonly is False
    assert (dm.volume_supplemental_group, dm.volume_supplemental_group_change_policy) == ("2000", "OnRootMismatch")
    assert dict(dm.volume_context) == context

    raw = resp.SerializeToString()
    for value in secrets.values():
        assert value.encode() not in raw
    env.unpublish(vid, target)

    # readonly=True makes a read-only description.
    target_ro = env.target("ro")
    dm = env.publish(vid, target_ro, cap=deferred_cap("ext4", flags=flags, group="3000", policy="Always"),
                     defer=True, readonly=True).deferred_mount
    assert dm.readonly is True and list(dm.mount_options) == ["noatime"]
    assert (dm.volume_supplemental_group, dm.volume_supplemental_group_change_policy) == ("3000", "Always")
    assert env.record(vid)["published"][str(target_ro)]["readonly"] is True
    env.unpublish(vid, target_ro)
    env.unstage(vid)

    # An "ro" mount flag makes a read-only description too (and is not an option).
    vid2 = env.create("desc-ro-flag", "ext4")
    env.stage(vid2, "ext4", flags=["ro", "nodev"])
    dm = env.publish(vid2, env.target("flag"), flags=["ro", "nodev"], defer=True).deferred_mount
    assert dm.readonly is True and list(dm.mount_options) == ["nodev"]
    assert dm.volume_supplemental_group == "" and dm.volume_supplemental_group_change_policy == ""

    # No secret value anywhere in the shim's state dir (records) or its log.
    files = list(regular_files(env.shim.state_dir))
    assert any(f.suffix == ".json" for f in files), files
    for path in files + [env.shim.log_path]:
        data = path.read_bytes()
        for value in secrets.values():
            assert value.encode() not in data, f"secret found in {path}"


# -- safety rules ------------------------------------------------------------------------------


def test_safety_rules_name_the_holder(env):
    vid = env.create("safety", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)
    staging = env.staging(vid)

    # 1. Host-mounted: no deferral.
    host = env.target("host")
    env.publish(vid, host, defer=False)
    deferred = env.target("deferred")
    details = fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, deferred, mount_cap("ext4"), defer=True),
                    Code.FAILED_PRECONDITION, "mounted on the host")
    assert str(staging) in details or str(host) in details, details
    assert mounts_at(deferred) == []

    # The last host unpublish releases the host mount: deferral becomes possible.
    env.unpublish(vid, host, defer=False)
    assert fs_mounts(device) == []
    env.publish(vid, deferred, defer=True)
    assert_placeholder(deferred)

    # 2. Deferred: no host publish.
    host2 = env.target("host2")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, host2, mount_cap("ext4"), defer=False),
          Code.FAILED_PRECONDITION, str(deferred))
    assert fs_mounts(device) == [] and mounts_at(host2) == []

    # 3. Single writer: no second sandbox.
    second = env.target("second")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, second, mount_cap("ext4"), defer=True),
          Code.FAILED_PRECONDITION, str(deferred))
    assert mounts_at(second) == []
    assert list(env.record(vid)["published"]) == [str(deferred)]
    env.unpublish(vid, deferred)

    # Read-only sandboxes may share it; a writer may not join them.
    readers = [env.target("r1"), env.target("r2")]
    for t in readers:
        assert env.publish(vid, t, defer=True, readonly=True).deferred_mount.readonly
        assert_placeholder(t)
    writer = env.target("writer")
    details = fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, writer, mount_cap("ext4"), defer=True),
                    Code.FAILED_PRECONDITION)
    assert any(str(t) in details for t in readers), details
    assert mounts_at(writer) == []
    for t in readers:
        env.unpublish(vid, t)

    # Group fields only with deferral; no deferral of a raw block volume.
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, host2, deferred_cap(group="1000"), defer=False),
          Code.INVALID_ARGUMENT, "volume_supplemental_group", "defer_fs_ops")
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, host2, deferred_cap(policy="Always"), defer=False),
          Code.INVALID_ARGUMENT, "volume_supplemental_group_change_policy")
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, host2, block_cap(), defer=True),
          Code.INVALID_ARGUMENT, "defer_fs_ops")
    assert mounts_at(host2) == [] and fs_mounts(device) == []

    env.unstage(vid)
    env.assert_released(vid)


# -- formatting ------------------------------------------------------------------------------


def test_stage_formats_only_a_blank_volume(env):
    blank = env.create("blank", "xfs")
    assert blkid(env.backing(blank)) == ""
    env.stage(blank, "xfs")
    assert blkid(env.backing(blank)) == "xfs"
    # An existing file system: never reformatted, whatever the volume holds.
    vid = env.create("full", "ext4")
    backing = env.backing(vid)
    fs_uuid = str(uuid.uuid4())
    subprocess.run(["mkfs.ext4", "-q", "-F", "-U", fs_uuid, "--", str(backing)], check=True)
    payload = env.path / "payload.bin"
    payload.write_bytes(os.urandom(100_000))
    subprocess.run(["debugfs", "-w", "-R", f"write {payload} data.bin", str(backing)], check=True,
                   capture_output=True)

    env.stage(vid, "ext4")
    assert blkid(backing, "UUID") == fs_uuid
    host = env.target("host")
    env.publish(vid, host, defer=False)
    assert (host / "data.bin").read_bytes() == payload.read_bytes()
    (host / "more.txt").write_text("written through the shim")
    env.unpublish(vid, host, defer=False)
    env.unstage(vid)
    env.assert_released(vid)
    assert blkid(backing, "UUID") == fs_uuid
    digest = sha256(backing)

    # Asking for another file system type: refused, nothing written, nothing left behind.
    fails(env.shim.node.NodeStageVolume, stage_req(vid, env.staging(vid), mount_cap("xfs")),
          Code.FAILED_PRECONDITION, "ext4", "fs_type")
    assert sha256(backing) == digest
    assert not env.record_file(vid).exists()
    assert not env.loops(vid), "a failed NodeStageVolume left the backend's loop device attached"
    assert not mounts_under(env.private(vid)) and not env.private(vid).exists()

    # Re-staged as ext4: same file system, the data survived.
    env.stage(vid, "ext4")
    assert blkid(backing, "UUID") == fs_uuid
    env.publish(vid, host, defer=False)
    assert (host / "data.bin").read_bytes() == payload.read_bytes()
    assert (host / "more.txt").read_text() == "written through the shim"
    env.unpublish(vid, host, defer=False)
    env.unstage(vid)
    env.unstage(blank)
    env.assert_released(vid)
    env.assert_released(blank)


# -- stats and expansion ---------------------------------------------------------------------


def stats_req(vid, path, defer: bool) -> csi_pb2.NodeGetVolumeStatsRequest:
    return csi_pb2.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=str(path), defer_fs_ops=defer)


def expand_req(vid, path, size, defer: bool, fs_type="ext4") -> csi_pb2.NodeExpandVolumeRequest:
    return csi_pb2.NodeExpandVolumeRequest(volume_id=vid, volume_path=str(path), defer_fs_ops=defer,
                                           capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                                           volume_capability=mount_cap(fs_type))


def test_stats_and_expansion_of_a_deferred_volume_go_to_the_runtime(env):
    vid = env.create("stats", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)
    target = env.target("a")
    first = env.publish(vid, target, defer=True).deferred_mount
    answer = usage_response(total=30 * MIB, used=7 * MIB)
    env.runtime.stats[str(target)] = answer

    resp = env.shim.node.NodeGetVolumeStats(stats_req(vid, target, True), timeout=30)
    assert list(resp.usage) == list(answer.usage)
    assert resp.volume_condition == answer.volume_condition
    assert env.runtime.calls == [("stats", str(target))]

    # A downgraded CO (no flag) asking about a deferred target: the record wins.
    resp = env.shim.node.NodeGetVolumeStats(stats_req(vid, target, False), timeout=30)
    assert list(resp.usage) == list(answer.usage)
    assert env.runtime.calls == [("stats", str(target))] * 2

    # The runtime's own errors come back unchanged.
    del env.runtime.stats[str(target)]
    fails(env.shim.node.NodeGetVolumeStats, stats_req(vid, target, True), Code.NOT_FOUND, "no sandbox holds")
    # A path the volume is not published at is not asked about.
    fails(env.shim.node.NodeGetVolumeStats, stats_req(vid, env.target("nowhere"), True),
          Code.NOT_FOUND, "volume_path")
    assert len(env.runtime.calls) == 3

    # Expansion: the backend grows the device, the runtime the file system.
    env.controller_expand(vid, 64 * MIB)
    resp = env.shim.node.NodeExpandVolume(expand_req(vid, target, 64 * MIB, True), timeout=60)
    assert resp.capacity_bytes == 64 * MIB
    assert sysblock.size_bytes(device) == 64 * MIB
    assert env.runtime.calls[-1] == ("expand", str(target))
    assert env.runtime.expanded_to == {str(target): 64 * MIB}
    assert fs_mounts(device) == []
    # A repeated publish describes the grown device.
    again = env.publish(vid, target, defer=True).deferred_mount
    assert again.capacity_bytes == 64 * MIB
    assert (again.device, again.device_major, again.device_minor) == \
        (first.device, first.device_major, first.device_minor)

    # The proxy is down: UNAVAILABLE with a message, and nothing falls back to a host mount.
    env.runtime.stop()
    env.runtime.stats[str(target)] = answer
    proxy = str(env.runtime.socket)
    fails(env.shim.node.NodeGetVolumeStats, stats_req(vid, target, True), Code.UNAVAILABLE, "proxy", proxy,
          "unreachable")
    env.controller_expand(vid, 80 * MIB)
    fails(env.shim.node.NodeExpandVolume, expand_req(vid, target, 80 * MIB, True), Code.UNAVAILABLE, proxy,
          "unreachable")
    assert fs_mounts(device) == []
    assert sysmount.at(str(env.staging(vid))) is None
    assert_placeholder(target)

    # A downgraded CO cleans up without the flag.
    env.shim.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target)),
                                      timeout=60)
    assert mounts_at(target) == [] and not target.exists()
    assert sysmount.at(str(env.private(vid) / "device")) is not None  # still staged
    env.unstage(vid)
    env.assert_released(vid)


def test_host_publishes_share_one_staging_mount(env):
    vid = env.create("host", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)
    staging = env.staging(vid)
    assert fs_mounts(device) == []

    t1, t2 = env.target("one"), env.target("two")
    for t in (t1, t2):
        resp = env.publish(vid, t, defer=False)
        assert not resp.HasField("deferred_mount")
    entries = fs_mounts(device)
    assert sorted(m.mount_point for m in entries) == sorted([str(staging), str(t1), str(t2)])
    staged = [m for m in entries if m.mount_point == str(staging)]
    assert len(staged) == 1 and staged[0].fs_type == "ext4"
    (t1 / "shared").write_text("one file system")
    assert (t2 / "shared").read_text() == "one file system"
    assert {(m.mount_point, m.fs_type) for m in sysmount.mounts()
            if m.source == PLACEHOLDER and m.mount_point.startswith(str(env.path) + "/")} == set()

    # Stats of a host publish are read on the host, never asked of the runtime.
    resp = env.shim.node.NodeGetVolumeStats(stats_req(vid, t1, False), timeout=30)
    by_unit = {u.unit: u for u in resp.usage}
    assert by_unit[Usage.BYTES].total == fs_total(t1) and by_unit[Usage.BYTES].used > 0
    assert resp.volume_condition.abnormal is False
    assert env.runtime.calls == []

    env.unpublish(vid, t1, defer=False)
    assert sorted(m.mount_point for m in fs_mounts(device)) == sorted([str(staging), str(t2)])
    env.unpublish(vid, t2, defer=False)
    assert fs_mounts(device) == []
    assert sysmount.at(str(staging)) is None

    # The host no longer holds it: it can go to a sandbox now.
    t3 = env.target("three")
    env.publish(vid, t3, defer=True)
    assert_placeholder(t3)
    env.unpublish(vid, t3)
    env.unstage(vid)
    env.assert_released(vid)


def test_host_publish_xfs_expands_online(env):
    vid = env.create("grow", "xfs")
    env.stage(vid, "xfs")
    target = env.target("a")
    env.publish(vid, target, "xfs", defer=False)
    (target / "keep").write_text("kept")
    before = fs_total(target)

    env.controller_expand(vid, 400 * MIB)
    resp = env.shim.node.NodeExpandVolume(expand_req(vid, target, 400 * MIB, False, "xfs"), timeout=60)
    assert resp.capacity_bytes == 400 * MIB
    after = fs_total(target)
    assert after > before + 64 * MIB, (before, after)
    assert (target / "keep").read_text() == "kept"
    assert env.runtime.calls == []

    env.unpublish(vid, target, defer=False)
    env.unstage(vid)
    env.assert_released(vid)


# -- raw block and byte-level passthrough --------------------------------------------------------


def test_raw_block_volumes_pass_through(env):
    vid = env.create("raw", cap=block_cap(), size=SIZE["block"])
    staging = env.path / "kubelet" / "staging" / "raw"
    target = env.path / "kubelet" / "volumeDevices" / "raw" / "dev"
    env.shim.node.NodeStageVolume(stage_req(vid, staging, block_cap()), timeout=60)
    env.shim.node.NodePublishVolume(publish_req(vid, staging, target, block_cap(), defer=False), timeout=60)

    device = env.only_loop(vid)
    assert_device_node_bind(target, device)
    assert stat.S_ISBLK(os.stat(target).st_mode)
    # The shim kept nothing of its own for it.
    assert not env.record_file(vid).exists() and not env.private(vid).exists()
    assert not mounts_under(env.shim.state_dir)

    payload = os.urandom(8192)
    fd = os.open(target, os.O_RDWR)
    try:
        os.pwrite(fd, payload, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(env.backing(vid), "rb") as f:
        assert f.read(len(payload)) == payload

    env.shim.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(target)),
                                      timeout=60)
    env.shim.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vid, staging_target_path=str(staging)), timeout=60)
    assert mounts_at(target) == [] and not env.loops(vid)


@dataclass
class FakeBackend(UnixGrpcServer):
    """A minimal CSI backend (sync gRPC server) with a method no CSI version has."""

    socket: Path
    seen: list[dict] = field(default_factory=list)
    server: grpc.Server | None = None

    def start(self) -> "FakeBackend":
        def plugin_info(request, context):
            return csi_pb2.GetPluginInfoResponse(name="fake.csi.example", vendor_version="0.0.1")

        def node_caps(request, context):
            return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
                csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=RPC.STAGE_UNSTAGE_VOLUME))])

        def echo(request: bytes, context):
            self.seen.append({"metadata": list(context.invocation_metadata()),
                              "time_remaining": context.time_remaining(), "request": request})
            context.send_initial_metadata((("x-initial", "i"),))
            context.set_trailing_metadata((("x-trailer", "t"), ("x-bin-bin", b"\x00\x01")))
            return request[::-1]

        def fail(request: bytes, context):
            self.seen.append({"metadata": list(context.invocation_metadata()), "request": request})
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "custom msg")

        def chat(requests, context):
            # A bidirectional stream: one reversed answer per message, then a count.
            count = 0
            for request in requests:
                count += 1
                yield request[::-1]
            yield str(count).encode()

        raw = {"request_deserializer": None, "response_serializer": None}
        self.serve(lambda server: server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("csi.v1.Identity", {
                "GetPluginInfo": csi_unary_handler(plugin_info, "GetPluginInfo")}),
            grpc.method_handlers_generic_handler("csi.v1.Node", {
                "NodeGetCapabilities": csi_unary_handler(node_caps, "NodeGetCapabilities")}),
            grpc.method_handlers_generic_handler("csi.v1.Future", {
                "Echo": grpc.unary_unary_rpc_method_handler(echo, **raw),
                "Fail": grpc.unary_unary_rpc_method_handler(fail, **raw),
                "Chat": grpc.stream_stream_rpc_method_handler(chat, **raw)}),
        )))
        return self



def test_unknown_methods_pass_through_byte_for_byte(root):
    backend = FakeBackend(socket=root.path / "fake.sock").start()
    try:
        shim = root.shim(backend).start()
        echo = shim.channel.unary_unary("/csi.v1.Future/Echo")
        payload = b"\x0a\x03abc\x00\xff not even protobuf"
        response, call = echo.with_call(payload, metadata=(("x-test", "v"),), timeout=5)
        assert response == payload[::-1]
        assert backend.seen[0]["request"] == payload
        assert ("x-test", "v") in backend.seen[0]["metadata"]
        assert 0 < backend.seen[0]["time_remaining"] <= 5
        assert ("x-initial", "i") in call.initial_metadata()
        trailing = tuple(call.trailing_metadata())
        assert ("x-trailer", "t") in trailing and ("x-bin-bin", b"\x00\x01") in trailing

        with pytest.raises(grpc.RpcError) as info:
            shim.channel.unary_unary("/csi.v1.Future/Fail")(b"x", metadata=(("x-test", "w"),), timeout=5)
        assert (info.value.code(), info.value.details()) == (Code.RESOURCE_EXHAUSTED, "custom msg")
        assert ("x-test", "w") in backend.seen[1]["metadata"]

        # A method the backend does not have either: its UNIMPLEMENTED comes
        # back, every time (the backend answers before reading the request,
        # which used to race with the shim's write: grpc-python issue #36066).
        nope = shim.channel.unary_unary("/csi.v1.Future/Nope")
        answers = []
        for _ in range(40):
            with pytest.raises(grpc.RpcError) as info:
                nope(b"abc", timeout=5)
            answers.append((info.value.code(), info.value.details()))
        assert set(answers) == {(Code.UNIMPLEMENTED, "Method not found!")}, set(answers)

        # Streams pass through too: a caller that keeps its stream open, and an empty stream.
        def slow():
            for part in (b"one", b"two", b"three"):
                yield part
                time.sleep(0.1)

        chat = shim.channel.stream_stream("/csi.v1.Future/Chat")
        assert list(chat(slow(), timeout=5)) == [b"eno", b"owt", b"eerht", b"3"]
        assert list(chat(iter(()), timeout=5)) == [b"0"]

        # Identity passes through: the shim keeps the backend's name.
        info = shim.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5)
        assert (info.name, info.vendor_version) == ("fake.csi.example", "0.0.1")
    finally:
        backend.stop()


def test_unchanged_rpcs_answer_exactly_what_the_driver_answers(env):
    for i, cap in enumerate([mount_cap("ext4"), block_cap(), mount_cap("xfs")]):
        env.create(f"list-{i}", cap=cap, size=SIZE["xfs"])
    for method, request in [
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest()),
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest(max_entries=2)),
        ("/csi.v1.Node/NodeGetInfo", csi_pb2.NodeGetInfoRequest()),
        ("/csi.v1.Identity/GetPluginInfo", csi_pb2.GetPluginInfoRequest()),
        ("/csi.v1.Controller/ControllerGetCapabilities", csi_pb2.ControllerGetCapabilitiesRequest()),
    ]:
        raw = request.SerializeToString()
        via_shim = env.shim.channel.unary_unary(method)(raw, timeout=30)
        direct = env.driver.channel.unary_unary(method)(raw, timeout=30)
        assert via_shim == direct, method
    # The comparison above compared something: all three volumes are listed.
    raw = env.shim.channel.unary_unary("/csi.v1.Controller/ListVolumes")(b"", timeout=30)
    assert len(csi_pb2.ListVolumesResponse.FromString(raw).entries) == 3


# -- restarts -----------------------------------------------------------------------------------


def test_sigkill_mid_lifecycle_then_restart(env):
    vid = env.create("restart", "ext4")
    env.stage(vid)
    device = env.only_loop(vid)

    # Killed right after stage: the record on disk is complete and consistent.
    env.shim.kill()
    rec = env.record(vid)
    assert (rec["volume_id"], rec["staging_path"], rec["fs_type"]) == (vid, str(env.staging(vid)), "ext4")
    assert rec["backend_target"] == str(env.private(vid) / "device") and rec["published"] == {}
    assert not [p for p in env.record_file(vid).parent.iterdir() if p.suffix != ".json"]
    env.shim.start()
    assert_device_node_bind(env.private(vid) / "device", device)
    env.stage(vid)  # a repeat after restart is idempotent
    assert env.only_loop(vid) == device

    # Killed after a deferred publish: publish again is idempotent.
    target = env.target("a")
    first = env.publish(vid, target, defer=True)
    env.shim.kill()
    env.shim.start()
    again = env.publish(vid, target, defer=True)
    assert again.SerializeToString() == first.SerializeToString()
    assert len(mounts_at(target)) == 1
    assert_placeholder(target)
    assert env.record(vid)["published"] == {str(target): {
        "deferred": True, "readonly": False, "supplemental_group": "",
        "supplemental_group_change_policy": "", "mount_group": ""}}
    assert fs_mounts(device) == []

    env.shim.kill()
    env.shim.start()
    env.unpublish(vid, target)
    assert mounts_at(target) == []
    env.unstage(vid)
    env.assert_released(vid)


def test_restart_drops_a_publish_whose_placeholder_vanished(env):
    vid = env.create("vanish", "ext4")
    env.stage(vid)
    target, kept = env.target("gone"), env.target("kept")
    env.publish(vid, target, defer=True, readonly=True)
    env.publish(vid, kept, defer=True, readonly=True)
    env.shim.kill()
    subprocess.run(["umount", "--", str(target)], check=True)  # e.g. a reboot, or a human
    env.shim.start()
    assert list(env.record(vid)["published"]) == [str(kept)]

    # The dropped target no longer blocks a writer once the kept one is gone too.
    env.unpublish(vid, kept)
    writer = env.target("writer")
    env.publish(vid, writer, defer=True)
    env.unpublish(vid, writer)
    env.unpublish(vid, target)  # idempotent: nothing mounted there any more
    env.unstage(vid)
    env.assert_released(vid)


# -- concurrency ----------------------------------------------------------------------------------


def test_stage_keeps_a_thick_volume_fully_allocated(env):
    """The shim formats what the backend staged as a raw block device; a
    discard would punch holes in a thick volume's reserved blocks."""
    vid = env.shim.create("thick", SIZE["ext4"], cap=mount_cap("ext4"),
                          parameters={"provisioning": "thick"}).volume_id
    backing = env.backing(vid)
    assert backing.stat().st_blocks * 512 >= SIZE["ext4"]
    env.stage(vid, "ext4")
    assert blkid(backing) == "ext4"
    assert backing.stat().st_blocks * 512 >= SIZE["ext4"], "the format gave the thick volume's blocks back"
    env.unstage(vid)
    env.assert_released(vid)


def test_overlapping_stages(env):
    """Stages of one volume that overlap: each is OK or ABORTED, the backend
    publishes once. Calls are spread over the probe/mkfs window (xfs: the
    longest mkfs); without the shim's per-volume guard two mkfs race on one
    device and one fails with INTERNAL in about half of the rounds."""
    staged = []
    for r in range(6):
        vid = env.create(f"race-{r}", "xfs")
        staged.append(vid)
        req = stage_req(vid, env.staging(vid), mount_cap("xfs"))
        calls = []
        for _ in range(20):
            calls.append(env.shim.node.NodeStageVolume.future(req, timeout=60))
            time.sleep(0.005)
        outcomes = []
        for call in calls:
            try:
                call.result()
                outcomes.append((Code.OK, ""))
            except grpc.RpcError as exc:
                outcomes.append((exc.code(), exc.details()))
        codes = {code for code, _ in outcomes}
        assert codes <= {Code.OK, Code.ABORTED} and Code.OK in codes, outcomes
        # One backend publish: one loop device, one device node bind, one publish in the driver's record.
        device = env.only_loop(vid)
        assert [m.mount_point for m in sysmount.of_device_node(device)] == [str(env.private(vid) / "device")]
        assert list(env.driver_record(vid)["published"]) == [str(env.private(vid) / "device")]
        assert blkid(device) == "xfs"
        assert fs_mounts(device) == []

    # Different volumes never wait for each other.
    others = [env.create(f"par-{i}", "ext4") for i in range(2)]
    calls = [env.shim.node.NodeStageVolume.future(stage_req(v, env.staging(v), mount_cap("ext4")), timeout=60)
             for v in others]
    for call in calls:
        call.result()
    for v in others:
        assert blkid(env.only_loop(v)) == "ext4" and env.record_file(v).exists()
    for v in [*staged, *others]:
        env.unstage(v)
        env.assert_released(v)


# -- input checks --------------------------------------------------------------------------------


BAD_PATHS = ["relative/path", "/a/../b", "/a/\x00b", "/a//b"]


def test_bad_input_is_refused_naming_the_field(env):
    vid = env.create("input", "ext4")
    staging = env.staging(vid)
    for bad in BAD_PATHS:
        fails(env.shim.node.NodeStageVolume, stage_req(vid, bad, mount_cap("ext4")),
              Code.INVALID_ARGUMENT, "staging_target_path")
    fails(env.shim.node.NodeStageVolume, stage_req(vid, staging, mount_cap("btrfs")),
          Code.INVALID_ARGUMENT, "fs_type", "btrfs")
    fails(env.shim.node.NodeStageVolume, stage_req(vid, staging, mount_cap(""), volume_context={"fsType": "zfs"}),
          Code.INVALID_ARGUMENT, "volume_context.fsType", "zfs")
    fails(env.shim.node.NodeStageVolume, stage_req(vid, staging, mount_cap("ext4", flags=["noatime,dev"])),
          Code.INVALID_ARGUMENT, "mount_flags[0]")
    # Nothing reached the backend.
    assert not env.loops(vid) and not env.record_file(vid).exists() and not env.private(vid).exists()

    env.stage(vid)
    target = env.target("a")
    for bad in BAD_PATHS:
        fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, bad, mount_cap("ext4"), defer=True),
              Code.INVALID_ARGUMENT, "target_path")
        fails(env.shim.node.NodePublishVolume, publish_req(vid, bad, target, mount_cap("ext4"), defer=True),
              Code.INVALID_ARGUMENT, "staging_target_path")
        fails(env.shim.node.NodeUnpublishVolume,
              csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=bad), Code.INVALID_ARGUMENT, "target_path")
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, target, mount_cap("ext4", flags=["ro,exec"]), defer=True),
          Code.INVALID_ARGUMENT, "mount_flags[0]")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, target, deferred_cap(group="wheel"), defer=True),
          Code.INVALID_ARGUMENT, "volume_supplemental_group", "wheel")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, target, deferred_cap(policy="Sometimes"),
                                                       defer=True),
          Code.INVALID_ARGUMENT, "volume_supplemental_group_change_policy", "Sometimes")
    assert not target.exists() and env.record(vid)["published"] == {}
    env.unstage(vid)
    env.assert_released(vid)


def test_oversized_request_is_refused(root):
    runtime = start_runtime(root)
    try:
        driver = root.driver().start()
        shim = root.shim(driver, extra=["--max-request-bytes", "65536"]).start()
        req = csi_pb2.CreateVolumeRequest(name="huge", volume_capabilities=[mount_cap("ext4")],
                                          parameters={"blob": "x" * 100_000})
        with pytest.raises(grpc.RpcError) as info:
            shim.controller.CreateVolume(req, timeout=30)
        assert info.value.code() == Code.RESOURCE_EXHAUSTED
        assert driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30).entries == []
        # A normal request still works.
        small = csi_pb2.CreateVolumeRequest(name="small", volume_capabilities=[mount_cap("ext4")],
                                            capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE["ext4"]))
        assert shim.controller.CreateVolume(small, timeout=30).volume.capacity_bytes == SIZE["ext4"]
    finally:
        runtime.stop()


# -- capabilities ---------------------------------------------------------------------------------


def node_caps(channel_owner) -> set[int]:
    resp = channel_owner.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
    return {c.rpc.type for c in resp.capabilities}


def test_node_capabilities(root):
    driver = root.driver().start()
    backend_caps = node_caps(driver)
    # VOLUME_MOUNT_GROUP: kubelet delegates fsGroup to the shim.
    own = {RPC.STAGE_UNSTAGE_VOLUME, RPC.GET_VOLUME_STATS, RPC.EXPAND_VOLUME, RPC.VOLUME_MOUNT_GROUP}
    deferral = {RPC.DEFER_FS_OPS, RPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP,
                RPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY}
    assert {int(c) for c in deferral} == {7, 8, 9}

    shim = root.shim(driver).start()
    assert node_caps(shim) == backend_caps | own | deferral
    shim.stop()

    quiet = root.shim(driver, endpoint_name="shim-quiet.sock", extra=["--no-advertise-deferral"]).start()
    caps = node_caps(quiet)
    assert caps == backend_caps | own
    assert not caps & {7, 8, 9}
