"""A full disk under each daemon's directories (ENOSPC).

Each daemon's state directory (the driver's --data-dir, the shim's, the
proxy's and the handler's --state-dir) and the watched directory are small
tmpfs mounts the test makes (and the root fixture unmounts). With one of
them filled to the last byte, every call that must write there answers
RESOURCE_EXHAUSTED naming that directory, with no traceback in any log;
what the call had done is undone (no mount, loop device, placeholder,
entry, claim, record or backing file left of it); and once the space is
freed, the same call succeeds.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.contract.mountinfo import digest
from crust.csi_shim.records import volume_key
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, fill_until_full, mount_cap
from tests.harness.handler_env import Env
from tests.harness.daemons import pid_alive, wait_until

Code = grpc.StatusCode
SIZES = {"data": "160M", "shim-state": "2M", "proxy-state": "2M", "volumes": "2M", "kata": "2M",
         "mountns-state": "2M"}


class FullDisk:
    def __init__(self, root):
        self.root = root
        for name, size in SIZES.items():
            where = root.path / name
            where.mkdir(mode=0o700)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
                           check=True)
        self.env = Env(root, proxy_extra=["--lease-seconds", "3"])

    @contextlib.contextmanager
    def full(self, name: str):
        filler = fill_until_full(self.root.path / name)
        try:
            yield self.root.path / name
        finally:
            filler.unlink()

    def exhausted(self, directory: Path, call, *args, **kw) -> str:
        """call must answer RESOURCE_EXHAUSTED naming directory."""
        with pytest.raises(grpc.RpcError) as exc:
            call(*args, **kw)
        assert exc.value.code() == Code.RESOURCE_EXHAUSTED, (exc.value.code(), exc.value.details())
        assert str(directory) in exc.value.details(), exc.value.details()
        return exc.value.details()

    def allocate(self, volume_id: str) -> None:
        """Every block of the volume's backing file allocated (mkfs punched
        holes in it): its file system never writes into a hole of a full
        disk, which would be an I/O error inside the volume, not a failed call."""
        path = self.env.driver.data_dir / "pools" / "node-a" / "volumes" / f"{volume_id}.img"
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def loops_of(self, volume_id: str) -> list[str]:
        backing = str(self.env.driver.data_dir / "pools" / "node-a" / "volumes" / f"{volume_id}.img")
        return [d for d, b in sysloop.attached().items() if b == backing]

    def tracebacks(self) -> list[str]:
        return [f"{log.name}: {line[:400]}" for log in self.root.path.glob("*.log")
                for line in log.read_text(errors="replace").splitlines()
                if "Traceback" in line or "unexpected error" in line]


@pytest.fixture
def disk(root):
    d = FullDisk(root)
    try:
        yield d
    finally:
        d.env.delete_sandboxes()
    assert d.tracebacks() == []


def test_the_driver_with_its_data_dir_full(disk):
    driver = disk.env.driver
    staged = driver.create("pv-staged", 32 * MIB)
    staging = disk.root.path / "st-staged"
    driver.stage(staged.volume_id, staging)
    fresh = driver.create("pv-fresh", 32 * MIB)
    fresh_staging = disk.root.path / "st-fresh"
    driver.stage(fresh.volume_id, fresh_staging)  # formatted, then unstaged: staged again below
    driver.unstage(fresh.volume_id, fresh_staging)
    for v in (staged, fresh):
        disk.allocate(v.volume_id)
    target = disk.root.path / "t-staged"
    controller_dir = driver.data_dir / "controller" / "volumes"
    before = sorted(p.name for p in controller_dir.iterdir())
    with disk.full("data") as data:
        disk.exhausted(data, driver.create, "pv-new", 32 * MIB)
        assert sorted(p.name for p in controller_dir.iterdir()) == before
        assert len(list((data / "pools" / "node-a" / "volumes").glob("*.img"))) == 2

        disk.exhausted(data, driver.stage, fresh.volume_id, fresh_staging)
        assert sysmount.at(str(fresh_staging)) is None and disk.loops_of(fresh.volume_id) == []

        disk.exhausted(data, driver.publish, staged.volume_id, staging, target)
        assert sysmount.at(str(target)) is None and not target.exists()

        disk.exhausted(data, driver.controller.CreateSnapshot, csi_pb2.CreateSnapshotRequest(
            source_volume_id=staged.volume_id, name="snap-full"), timeout=60)
        assert list((data / "pools" / "node-a" / "snapshots").iterdir()) == []
        assert list((data / "controller" / "snapshots").iterdir()) == []

        # Growing a thin volume and publishing one rewrite its record only,
        # in the blocks of the inode its previous write replaced
        # (crust.common.atomicfile, reuse): no room is needed, so they succeed.
        assert driver.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=staged.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MIB)),
            timeout=60).capacity_bytes == 48 * MIB
        listed = driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=10).entries
        assert {e.volume.volume_id: e.volume.capacity_bytes for e in listed}[staged.volume_id] == 48 * MIB
        record = json.loads((controller_dir / f"{staged.volume_id}.json").read_text())
        assert record["capacity_bytes"] == 48 * MIB

        driver.controller.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(
            volume_id=staged.volume_id, node_id="node-a", volume_capability=mount_cap()), timeout=10)
        record = json.loads((controller_dir / f"{staged.volume_id}.json").read_text())
        assert list(record["published"]) == ["node-a"]

    # With room again, each call succeeds as if it had never been tried.
    driver.create("pv-new", 32 * MIB)
    driver.stage(fresh.volume_id, fresh_staging)
    assert sysmount.at(str(fresh_staging)) is not None
    driver.publish(staged.volume_id, staging, target)
    (target / "x").write_text("x\n")
    driver.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        source_volume_id=staged.volume_id, name="snap-full"), timeout=60)
    assert driver.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=staged.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=48 * MIB)),
        timeout=60).capacity_bytes == 48 * MIB
    driver.controller.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(
        volume_id=staged.volume_id, node_id="node-a", volume_capability=mount_cap()), timeout=10)
    driver.restart()  # what was recorded is what was answered
    listed = driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=10).entries
    assert {e.volume.volume_id: e.volume.capacity_bytes for e in listed}[staged.volume_id] == 48 * MIB

    # Removals on a full disk: they finish, or converge when retried with room.
    with disk.full("data"):
        for call, args in ((driver.unpublish, (staged.volume_id, target)),
                           (driver.unstage, (staged.volume_id, staging))):
            try:
                call(*args)
            except grpc.RpcError as exc:
                assert exc.code() == Code.RESOURCE_EXHAUSTED, exc.details()
    driver.unpublish(staged.volume_id, target)
    driver.unstage(staged.volume_id, staging)
    assert sysmount.at(str(target)) is None and sysmount.at(str(staging)) is None
    wait_until(lambda: disk.loops_of(staged.volume_id) == [], what="the loop device to be detached")
    driver.unstage(fresh.volume_id, fresh_staging)


def test_an_expanded_thin_volume_is_grown_at_stage_only_with_room_for_the_growth(disk):
    """A thin volume expanded while unstaged grows its ext4 at the next
    stage, writing new block groups into holes of its image: with the
    backing disk full, the stage is refused up front (RESOURCE_EXHAUSTED
    naming the directory, nothing attached or mounted, the file system
    unchanged), not left to fail inside the device; with room it grows."""
    driver = disk.env.driver
    v = driver.create("pv-grow", 32 * MIB)
    staging = disk.root.path / "st-grow"
    driver.stage(v.volume_id, staging)
    driver.unstage(v.volume_id, staging)
    assert driver.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
        volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=640 * MIB)),
        timeout=60).capacity_bytes == 640 * MIB
    image = driver.data_dir / "pools" / "node-a" / "volumes" / f"{v.volume_id}.img"
    with disk.full("data") as data:
        details = disk.exhausted(data, driver.stage, v.volume_id, staging)
        assert "nothing was changed" in details, details
        assert sysmount.at(str(staging)) is None and disk.loops_of(v.volume_id) == []
    # Unchanged: e2fsck finds it clean, and its size is still the old one.
    subprocess.run(["e2fsck", "-f", "-n", str(image)], check=True, capture_output=True)
    blocks = subprocess.run(["dumpe2fs", "-h", str(image)], check=True, capture_output=True, text=True).stdout
    count = int(next(line.split(":")[1] for line in blocks.splitlines() if line.startswith("Block count")))
    size = int(next(line.split(":")[1] for line in blocks.splitlines() if line.startswith("Block size")))
    assert count * size == 32 * MIB
    driver.stage(v.volume_id, staging)
    assert os.statvfs(staging).f_blocks * os.statvfs(staging).f_frsize > 512 * MIB  # less the metadata
    driver.unstage(v.volume_id, staging)


def deferred_publish(env, v, target: Path):
    return env.proxy.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(target),
        volume_capability=env.cap(v.fs), defer_fs_ops=True), timeout=60)


def test_the_shim_with_its_state_dir_full(disk):
    env, shim = disk.env, disk.env.shim
    fresh = shim.create("pv-shim-fresh", 32 * MIB, env.cap("ext4"))
    fresh_staging = env.proxy.staging("pv-shim-fresh")
    v = env.create("pv-shim")  # staged (through the proxy, by the shim), not published
    target, host_target = env.proxy.target("pod-s", "pv-shim"), env.proxy.target("pod-h", "pv-shim")
    with disk.full("shim-state") as state:
        disk.exhausted(state, shim.stage, fresh.volume_id, fresh_staging, env.cap("ext4"))
        # The backend's raw block stage and publish were undone.
        assert disk.loops_of(fresh.volume_id) == []
        private = str(state / "backend" / volume_key(fresh.volume_id))
        assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(private)] == []
        disk.exhausted(state, shim.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
            volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(target),
            volume_capability=env.cap("ext4"), defer_fs_ops=True), timeout=60)
        assert sysmount.at(str(target)) is None
        disk.exhausted(state, shim.publish, v.volume_id, v.staging, host_target, env.cap("ext4"))
        assert sysmount.at(str(host_target)) is None and sysmount.at(str(v.staging)) is None
    shim.stage(fresh.volume_id, fresh_staging, env.cap("ext4"))
    rsp = shim.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(target),
        volume_capability=env.cap("ext4"), defer_fs_ops=True), timeout=60)
    assert rsp.HasField("deferred_mount") and sysmount.at(str(target)).fs_type == "tmpfs"
    shim.unpublish(v.volume_id, target)
    shim.publish(v.volume_id, v.staging, host_target, env.cap("ext4"))
    assert sysmount.at(str(host_target)).fs_type == "ext4"
    shim.unpublish(v.volume_id, host_target)
    shim.unstage(fresh.volume_id, fresh_staging)
    wait_until(lambda: disk.loops_of(fresh.volume_id) == [], what="the backend's loop device to go")


@pytest.mark.parametrize("where", ["proxy-state", "volumes"])
def test_the_proxy_with_its_state_dir_or_the_watched_dir_full(disk, where):
    env = disk.env
    v = env.create("pv-proxy")
    target = env.proxy.target("pod-p", "pv-proxy")
    with disk.full(where) as full:
        disk.exhausted(full, deferred_publish, env, v, target)
        assert sysmount.at(str(target)) is None, "the shim's placeholder stayed"
        assert list(env.proxy.volumes_dir.iterdir()) in ([], [env.proxy.volumes_dir / ".filler"])
        assert env.claims() == []
    d = deferred_publish(env, v, target)
    assert d.HasField("deferred_mount") and sysmount.at(str(target)).fs_type == "tmpfs"
    entry = json.loads((env.proxy.volumes_dir / digest(str(target)) / "mountInfo.json").read_text())
    assert entry["device"] == d.deferred_mount.device
    env.proxy.unpublish(v.volume_id, target)
    assert sysmount.at(str(target)) is None


def test_a_failed_republish_leaves_the_delivered_publish_standing(disk):
    """kubelet publishes a held target again (its restart), the entry in the
    watched directory was lost meanwhile, and the proxy cannot write it
    again: the call fails, and the publish the sandbox uses stays whole (the
    plugin's side, the placeholder, the claim, stats through the proxy); a
    retry with room writes the entry back."""
    env = disk.env
    v = env.volume("pv-again")
    env.run_ok(env.bundle("again", "exec sleep 600", [("/data", str(v.target))]), "sb-again")
    entry = env.entry(v)
    entry_file = env.proxy.volumes_dir / digest(str(v.target)) / "mountInfo.json"
    entry_file.unlink()
    with disk.full("volumes") as full:
        disk.exhausted(full, deferred_publish, env, v, v.target)
    placeholder = sysmount.at(str(v.target))
    assert placeholder is not None and placeholder.fs_type == "tmpfs", "the plugin's publish was undone"
    assert env.claim_set() == {(str(v.target), "mountns", "sb-again")}
    stats = env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v.volume_id, volume_path=str(v.target)), timeout=30)
    assert stats.usage[0].total > 0 and not stats.volume_condition.abnormal, stats
    deferred_publish(env, v, v.target)
    assert env.entry(v) == entry
    env.delete("sb-again")
    wait_until(lambda: env.claims() == [], what="the claim to be released")
    env.unpublish(v)
    assert sysmount.at(str(v.target)) is None


def test_claims_and_releases_with_the_proxy_state_full(disk):
    env = disk.env
    v = env.volume("pv-claim")
    bundle = env.bundle("claim", "exec sleep 600", [("/data", str(v.target))])
    with disk.full("proxy-state") as full:
        out = env.run(bundle, "sb-claim")
        assert out.returncode != 0 and "RESOURCE_EXHAUSTED" in out.stderr and str(full) in out.stderr, out.stderr
        assert env.sandboxes() == {} and env.claims() == [] and env.holders() == []
    info = env.run_ok(bundle, "sb-claim")
    assert env.claim_set() == {(str(v.target), "mountns", "sb-claim")}
    with disk.full("proxy-state"):
        # The release rewrites records the claim wrote, in the blocks of the
        # inodes those writes replaced (crust.common.atomicfile, reuse): it
        # needs no room, and finishes.
        out = env.handler.sandbox("delete", "sb-claim")
        assert out.returncode == 0, out.stderr
        assert not pid_alive(info["pid"])
        wait_until(lambda: env.claims() == [], what="the claim to be released")
        assert env.sandboxes() == {}
    env.unpublish(v)


def test_a_sandbox_started_while_the_watched_dir_was_full_starts_once_there_is_room(disk):
    """RunSandbox while the proxy's volumes directory (the watched one) is
    full: RESOURCE_EXHAUSTED naming it, nothing left of the start; the same
    RunSandbox once the space is freed starts the sandbox with its volume."""
    env = disk.env
    v = env.volume("pv-watched")
    bundle = env.bundle("watched", "exec sleep 600", [("/data", str(v.target))])
    # A first sandbox: the handler has indexed the entry (on a busy machine
    # its watcher may read it later than the damage below otherwise).
    env.run_ok(bundle, "sb-watched-first")
    env.delete("sb-watched-first")
    wait_until(lambda: env.claims() == [], what="the first claim to be released")
    # The entry damaged (the handler keeps the good copy it read): the
    # claim has the proxy write it again from its record, into the full directory.
    entry = env.proxy.volumes_dir / digest(str(v.target)) / "mountInfo.json"
    entry.write_text(entry.read_text()[:40])
    with disk.full("volumes") as full:
        out = env.run(bundle, "sb-watched")
        assert out.returncode != 0 and "RESOURCE_EXHAUSTED" in out.stderr and str(full) in out.stderr, out.stderr
        assert env.sandboxes() == {} and env.claims() == [] and env.holders() == []
        assert env.mounting(v) == []
    info = env.run_ok(bundle, "sb-watched")
    assert env.claim_set() == {(str(v.target), "mountns", "sb-watched")}
    assert info["pid"] in env.mounting(v)
    env.delete("sb-watched")
    wait_until(lambda: env.claims() == [], what="the claim to be released")
    env.unpublish(v)


def test_the_handler_with_its_state_dir_full(disk):
    env = disk.env
    v = env.volume("pv-handler")
    bundle = env.bundle("handler", "exec sleep 600", [("/data", str(v.target))])
    with disk.full("mountns-state") as full:
        out = env.run(bundle, "sb-full")
        assert out.returncode != 0 and "RESOURCE_EXHAUSTED" in out.stderr and str(full) in out.stderr, out.stderr
        assert env.sandboxes() == {} and env.claims() == [] and env.holders() == []
        assert env.mounting(v) == []
    env.run_ok(bundle, "sb-full")
    assert env.claim_set() == {(str(v.target), "mountns", "sb-full")}
    env.delete("sb-full")
    env.unpublish(v)

    # A handler (re)starting on a full state dir registers all the same (its
    # lease is kept in memory) and writes its lease once there is room.
    lease = env.handler.state_dir / "lease"
    env.kill_handler_until_expired()
    lease.unlink()
    with disk.full("mountns-state"):
        env.handler.start()
        assert not lease.exists()
    wait_until(lease.exists, timeout=15, what="the lease to be written")
    w = env.volume("pv-after")
    env.run_ok(env.bundle("after", "exec sleep 600", [("/data", str(w.target))]), "sb-after")
    env.delete("sb-after")
    env.unpublish(w)
