"""Hostile paths and out-of-range input at the three CSI endpoints.

Each finding of the hostile-input review, replayed at `crust driver`,
`crust shim` and `crust proxy` (the proxy with its kubelet root set, the
publish deferred as it would be for a sandboxed pod):

- a target path that is a symlink, or crosses one, pointing outside the
  kubelet root: refused with INVALID_ARGUMENT naming target_path, nothing
  mounted where the link points, the unpublish of that path refused too
  (never an OK that leaves a mount), and the volume still unstages and
  deletes with no loop device left;
- a directory swapped for a symlink while publishes run: every publish
  either lands at the real path or is refused, and nothing ever appears
  where the link points;
- an access mode outside the enum: INVALID_ARGUMENT naming the field;
- a path component longer than NAME_MAX: INVALID_ARGUMENT naming the field.

No daemon log may show a traceback afterwards. The decoy directory the
links point to lives outside the test root, in a directory of its own.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, loops_left, mount_cap

Code = grpc.StatusCode
ENDPOINTS = ("driver", "shim", "proxy")


@pytest.fixture
def decoy():
    """A directory outside the test root, standing for /etc or any other
    host directory a link could lead to."""
    path = Path(tempfile.mkdtemp(prefix="crust-decoy-"))
    (path / "victim").mkdir()
    (path / "victim" / "host-file").write_text("host data\n")
    try:
        yield path
    finally:
        # Only if a defect let a mount through: it is ours, under our decoy.
        for m in sysmount.mounts():
            if (m.mount_point + "/").startswith(str(path) + "/"):
                os.system(f"umount -l '{m.mount_point}'")
        shutil.rmtree(path, ignore_errors=True)


class Chain:
    """The stack, and one of its endpoints playing the CO's peer."""

    def __init__(self, root, endpoint: str):
        self.driver, self.shim, self.proxy = root.stack()
        self.endpoint = endpoint
        self.at = {"driver": self.driver, "shim": self.shim, "proxy": self.proxy}[endpoint]
        self.kubelet = self.proxy.kubelet_root
        self.logs = [self.driver.log_path, self.shim.log_path, self.proxy.log_path]

    def staged_volume(self, name: str) -> tuple[str, Path]:
        vid = self.at.create(name, size=64 * MIB, cap=mount_cap("ext4"))
        vid = vid.volume_id
        staging = self.proxy.staging(name)
        staging.parent.mkdir(parents=True, exist_ok=True)
        self.at.stage(vid, staging, cap=mount_cap("ext4"))
        return vid, staging

    def publish_request(self, vid: str, staging: Path, target: str) -> csi_pb2.NodePublishVolumeRequest:
        return csi_pb2.NodePublishVolumeRequest(
            volume_id=vid, staging_target_path=str(staging), target_path=target,
            volume_capability=mount_cap("ext4"),
            # Through the proxy, the path a sandboxed pod's publish takes.
            defer_fs_ops=self.endpoint == "proxy")

    def loops(self, vid: str) -> list[str]:
        return [d for d, backing in sysloop.attached().items() if Path(backing.split(" (deleted)")[0]).stem == vid]

    def assert_loops_released(self, vid: str) -> None:
        """After an unstage: no loop device of the volume is left."""
        assert loops_left(lambda backing: Path(backing.split(" (deleted)")[0]).stem == vid) == {}

    def assert_no_traceback(self) -> None:
        for log in self.logs:
            text = log.read_text() if log.exists() else ""
            assert "Traceback" not in text, f"{log.name} shows a traceback:\n{text[-3000:]}"


def call(stub_method, request):
    try:
        stub_method(request, timeout=60)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return Code.OK, ""


def mounts_under(path: Path) -> list[sysmount.MountEntry]:
    prefix = str(path) + "/"
    return [m for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]


_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    """renameat2(RENAME_EXCHANGE): a and b swap places in one step."""
    if _libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def pod_dir(chain: Chain, pod: str) -> Path:
    base = chain.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi"
    base.mkdir(parents=True)
    return base


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("shape", ["target-is-a-link", "parent-is-a-link"])
def test_a_target_through_a_symlink_is_refused_and_nothing_is_mounted(root, decoy, endpoint, shape):
    chain = Chain(root, endpoint)
    vid, staging = chain.staged_volume("hostile-link")
    base = pod_dir(chain, "pod-a")
    if shape == "target-is-a-link":
        (base / "pv").mkdir()
        (base / "pv" / "mount").symlink_to(decoy / "victim")
    else:
        (base / "pv").symlink_to(decoy)  # .../pv/victim is reached through the link
    target = str(base / "pv" / ("mount" if shape == "target-is-a-link" else "victim"))

    code, details = call(chain.at.node.NodePublishVolume, chain.publish_request(vid, staging, target))
    assert code == Code.INVALID_ARGUMENT, (code, details)
    assert "target_path" in details and "symlink" in details, details
    assert mounts_under(decoy) == []
    assert sorted(p.name for p in (decoy / "victim").iterdir()) == ["host-file"]
    assert sysmount.at(str(decoy / "victim")) is None

    # The unpublish of that path is refused as well: an OK would tell the CO
    # that nothing of the volume is mounted there any more.
    code, details = call(chain.at.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=vid, target_path=target))
    assert code == Code.INVALID_ARGUMENT, (code, details)
    assert (decoy / "victim" / "host-file").read_text() == "host data\n"

    # Nothing was left half-done: the volume unstages and deletes.
    chain.at.unstage(vid, staging)
    chain.assert_loops_released(vid)
    chain.at.delete(vid)
    assert mounts_under(decoy) == [] and mounts_under(chain.kubelet / "pods") == []
    chain.assert_no_traceback()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_staging_and_stats_paths_through_a_symlink_are_refused(root, decoy, endpoint):
    chain = Chain(root, endpoint)
    vid = chain.at.create("hostile-staging", size=64 * MIB, cap=mount_cap("ext4")).volume_id
    link = chain.kubelet / "plugins-link"
    link.symlink_to(decoy)
    staging = str(link / "victim")
    code, details = call(chain.at.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=staging, volume_capability=mount_cap("ext4")))
    assert code == Code.INVALID_ARGUMENT and "staging_target_path" in details, (code, details)
    assert mounts_under(decoy) == [] and chain.loops(vid) == []

    vid2, real_staging = chain.staged_volume("hostile-stats")
    code, details = call(chain.at.node.NodeGetVolumeStats, csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=vid2, volume_path=staging))
    assert code in (Code.INVALID_ARGUMENT, Code.NOT_FOUND), (code, details)
    code, details = call(chain.at.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
        volume_id=vid2, staging_target_path=staging))
    assert code in (Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION), (code, details)
    chain.at.unstage(vid2, real_staging)
    chain.assert_loops_released(vid2)
    chain.assert_no_traceback()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_access_mode_outside_the_enum_is_invalid_argument(root, endpoint):
    chain = Chain(root, endpoint)
    cap = mount_cap("ext4")
    cap.access_mode.mode = 99
    code, details = call(chain.at.controller.CreateVolume, csi_pb2.CreateVolumeRequest(
        name="mode-99", capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MIB), volume_capabilities=[cap]))
    assert code == Code.INVALID_ARGUMENT, (code, details)
    assert "volume_capabilities[0].access_mode.mode" in details and "99" in details, details
    vid, staging = chain.staged_volume("mode-ok")
    code, details = call(chain.at.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(staging), target_path=str(chain.kubelet / "t"),
        volume_capability=cap))
    assert code == Code.INVALID_ARGUMENT and "volume_capability.access_mode.mode" in details, (code, details)
    chain.assert_no_traceback()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_path_component_over_name_max_is_invalid_argument(root, endpoint):
    chain = Chain(root, endpoint)
    vid, staging = chain.staged_volume("long-name")
    long = str(pod_dir(chain, "pod-l") / ("n" * 256) / "mount")
    requests = [
        (chain.at.node.NodePublishVolume, chain.publish_request(vid, staging, long), "target_path"),
        (chain.at.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=long),
         "target_path"),
        (chain.at.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
            volume_id=vid, staging_target_path=long, volume_capability=mount_cap("ext4")), "staging_target_path"),
        (chain.at.node.NodeGetVolumeStats, csi_pb2.NodeGetVolumeStatsRequest(volume_id=vid, volume_path=long),
         "volume_path"),
    ]
    for method, request, field in requests:
        code, details = call(method, request)
        assert code == Code.INVALID_ARGUMENT and field in details, (method, code, details)
    # A whole path over PATH_MAX, in short components.
    too_long = "/" + "/".join(["d" * 200] * 21)
    code, details = call(chain.at.node.NodePublishVolume, chain.publish_request(vid, staging, too_long))
    assert code == Code.INVALID_ARGUMENT and "target_path" in details, (code, details)
    assert mounts_under(chain.kubelet / "pods") == []
    chain.at.unstage(vid, staging)
    chain.assert_no_traceback()


@pytest.mark.parametrize("endpoint", ["driver", "proxy"])
def test_a_directory_swapped_for_a_symlink_during_publishes_never_leaks_a_mount(root, decoy, endpoint):
    """A pod (or anyone who can write the pod's volume directory) exchanges
    a directory on the target's path with a symlink to a host directory and
    back, as fast as it can, while the CO publishes and unpublishes. Each
    publish either lands at the real target or is refused; the host
    directory never receives a mount."""
    chain = Chain(root, endpoint)
    vid, staging = chain.staged_volume("race")
    base = pod_dir(chain, "pod-r")
    real = base / "pv"
    real.mkdir()
    link = base / "pv.link"
    link.symlink_to(decoy / "victim")
    target = str(real / "mount")
    stop = threading.Event()
    swaps = 0
    seen_in_decoy: list[str] = []
    swapper_errors: list[OSError] = []

    def swapper():
        # The directory and the link trade places atomically (the way the
        # kubelet subPath exploit did): the path always exists, as one or
        # the other.
        nonlocal swaps
        try:
            while not stop.is_set():
                exchange(real, link)
                time.sleep(0.0005)
                exchange(real, link)
                swaps += 1
                time.sleep(0.0005)
        except OSError as exc:  # the race must run the whole time: a dead swapper fails the test
            swapper_errors.append(exc)

    def watcher():
        while not stop.is_set():
            seen_in_decoy.extend(m.mount_point for m in mounts_under(decoy))
            time.sleep(0.002)

    threads = [threading.Thread(target=swapper), threading.Thread(target=watcher)]
    for t in threads:
        t.start()
    outcomes: dict[Code, int] = {}
    try:
        deadline = time.monotonic() + 20
        attempts = 0
        while attempts < 60 and time.monotonic() < deadline:
            attempts += 1
            code, details = call(chain.at.node.NodePublishVolume, chain.publish_request(vid, staging, target))
            outcomes[code] = outcomes.get(code, 0) + 1
            assert code in (Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION), (code, details)
            if code == Code.OK:
                # Unpublished again (refused while the link is in place: retried).
                for _ in range(200):
                    ucode, udetails = call(chain.at.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
                        volume_id=vid, target_path=target))
                    # Refused while the link is in place, or while the directory is
                    # renamed away (a mount it holds cannot be removed): retried.
                    assert ucode in (Code.OK, Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION), (ucode, udetails)
                    if ucode == Code.OK:
                        break
                else:
                    raise AssertionError("the unpublish never got through")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        if os.path.islink(real):
            exchange(real, link)
    print("outcomes", {c.name: n for c, n in outcomes.items()}, "swaps", swaps)
    # Both sides of the race were hit: publishes that landed, publishes refused.
    assert swapper_errors == []
    assert swaps > 0 and outcomes.get(Code.OK) and outcomes.get(Code.INVALID_ARGUMENT), outcomes
    assert seen_in_decoy == [] and mounts_under(decoy) == [], seen_in_decoy
    assert sorted(p.name for p in (decoy / "victim").iterdir()) == ["host-file"]
    # Whatever was refused left nothing behind at the real target either.
    assert mounts_under(base) == [], (outcomes, mounts_under(base))
    chain.at.unstage(vid, staging)
    chain.assert_loops_released(vid)
    chain.assert_no_traceback()
