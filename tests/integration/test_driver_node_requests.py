"""The Node service's requests of `crust driver` themselves.

Malformed requests (relative, `..`, NUL or huge paths, missing or unknown
capabilities, smuggled mount flags, multi-node modes) are refused with
INVALID_ARGUMENT naming the field and leave nothing behind; NodeGetInfo,
NodeGetCapabilities and NodeGetID say what the node is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from crust.api import csi_pb2
from crust.sys import mount as sysmount
from tests.harness.driver_node_calls import SIZE, Code, fails, loop_devices, record, record_file
from tests.harness.daemons import MIB, AccessMode, block_cap, mount_cap

RPC = csi_pb2.NodeServiceCapability.RPC


# -- helpers ---------------------------------------------------------------------


def mounts_under(path: Path) -> list[sysmount.MountEntry]:
    prefix = str(path.resolve()) + "/"
    return [m for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]


# -- bad requests --------------------------------------------------------------------------


def _stage_case(**overrides):
    def build(vid, base: Path):
        kw = {"volume_id": vid, "staging_target_path": str(base / "staging"), "volume_capability": mount_cap()}
        kw.update({k: (v(base) if callable(v) else v) for k, v in overrides.items()})
        return csi_pb2.NodeStageVolumeRequest(**kw)
    return build


LONG = "/" + "/".join(["d" * 99] * 50)  # 5000 characters

STAGE_CASES = {
    "relative": (_stage_case(staging_target_path="rel/staging"), "staging_target_path"),
    "dotdot": (_stage_case(staging_target_path=lambda b: f"{b}/x/../staging"), "staging_target_path"),
    "nul": (_stage_case(staging_target_path=lambda b: f"{b}/stag\x00ing"), "staging_target_path"),
    "huge": (_stage_case(staging_target_path=lambda b: str(b) + LONG), "staging_target_path"),
    "no-capability": (lambda vid, b: csi_pb2.NodeStageVolumeRequest(
        volume_id=vid, staging_target_path=str(b / "staging")), "volume_capability"),
    "no-access-type": (_stage_case(volume_capability=csi_pb2.VolumeCapability(
        access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))), "volume_capability.access_type"),
    "no-access-mode": (_stage_case(volume_capability=csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume())), "volume_capability.access_mode"),
    "flag-smuggling": (_stage_case(volume_capability=mount_cap("ext4", flags=["noatime,dev,suid"])),
                       "volume_capability.mount.mount_flags[0]"),
    "flag-newline": (_stage_case(volume_capability=mount_cap("ext4", flags=["ro\nexec"])),
                     "volume_capability.mount.mount_flags[0]"),
    "unknown-fs": (_stage_case(volume_capability=mount_cap("btrfs")), "volume_capability.mount.fs_type"),
    "unknown-fs-in-context": (_stage_case(volume_context={"fsType": "btrfs"}), "fsType"),
    "multi-node": (_stage_case(volume_capability=mount_cap("ext4", mode=AccessMode.MULTI_NODE_MULTI_WRITER)),
                   "volume_capability.access_mode"),
    "multi-node-block": (_stage_case(volume_capability=block_cap(AccessMode.MULTI_NODE_READER_ONLY)),
                         "volume_capability.access_mode"),
    "no-volume-id": (_stage_case(volume_id=""), "volume_id"),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_stage_rejects_bad_input_and_leaves_nothing(driver, root, case):
    build, field = STAGE_CASES[case]
    vid = driver.create(f"bad-{case}", SIZE["ext4"]).volume_id
    fails(driver.node.NodeStageVolume, build(vid, root.path), Code.INVALID_ARGUMENT, field)
    assert not record_file(driver, vid).exists()
    assert not list(record_file(driver, vid).parent.iterdir())
    assert not loop_devices(driver, vid)
    assert not mounts_under(root.path)
    assert not (root.path / "staging").exists() and not (root.path / "x").exists()


def _publish_case(**overrides):
    def build(vid, base: Path):
        kw = {"volume_id": vid, "staging_target_path": str(base / "staging"),
              "target_path": str(base / "target"), "volume_capability": mount_cap()}
        kw.update({k: (v(base) if callable(v) else v) for k, v in overrides.items()})
        return csi_pb2.NodePublishVolumeRequest(**kw)
    return build


PUBLISH_CASES = {
    "relative-target": (_publish_case(target_path="pods/target"), "target_path"),
    "dotdot-target": (_publish_case(target_path=lambda b: f"{b}/x/../target"), "target_path"),
    "nul-target": (_publish_case(target_path=lambda b: f"{b}/tar\x00get"), "target_path"),
    "huge-target": (_publish_case(target_path=lambda b: str(b) + LONG), "target_path"),
    "relative-staging": (_publish_case(staging_target_path="staging"), "staging_target_path"),
    "no-capability": (lambda vid, b: csi_pb2.NodePublishVolumeRequest(
        volume_id=vid, staging_target_path=str(b / "staging"), target_path=str(b / "target")),
        "volume_capability"),
    "no-access-type": (_publish_case(volume_capability=csi_pb2.VolumeCapability(
        access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))), "volume_capability.access_type"),
    "flag-smuggling": (_publish_case(volume_capability=mount_cap("ext4", flags=["bind,rw"])),
                       "volume_capability.mount.mount_flags[0]"),
    "unknown-fs": (_publish_case(volume_capability=mount_cap("zfs")), "volume_capability.mount.fs_type"),
    "multi-node": (_publish_case(volume_capability=mount_cap(mode=AccessMode.MULTI_NODE_SINGLE_WRITER)),
                   "volume_capability.access_mode"),
}


@pytest.mark.parametrize("case", list(PUBLISH_CASES))
def test_publish_rejects_bad_input_and_leaves_nothing(driver, root, case):
    build, field = PUBLISH_CASES[case]
    vid = driver.create(f"badpub-{case}", 16 * MIB).volume_id
    staging = root.path / "staging"
    driver.stage(vid, staging)
    rec = record(driver, vid)
    fails(driver.node.NodePublishVolume, build(vid, root.path), Code.INVALID_ARGUMENT, field)
    assert record(driver, vid) == rec
    assert [m.mount_point for m in mounts_under(root.path)] == [str(staging)]
    assert not (root.path / "target").exists() and not (root.path / "x").exists()
    assert sorted(p.name for p in root.path.iterdir() if p.is_dir()) == ["data", "staging"]


def test_unpublish_unstage_stats_expand_reject_bad_paths(driver, root):
    vid = driver.create("badpaths", 16 * MIB).volume_id
    cases = [
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path="t"),
         "target_path"),
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=f"{root.path}/a/../t"), "target_path"),
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(root.path) + LONG), "target_path"),
        (driver.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(target_path=str(root.path / "t")),
         "volume_id"),
        (driver.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path="staging"), "staging_target_path"),
        (driver.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=f"{root.path}/st\x00aging"), "staging_target_path"),
        (driver.node.NodeGetVolumeStats, csi_pb2.NodeGetVolumeStatsRequest(volume_path=str(root.path)),
         "volume_id"),
        (driver.node.NodeExpandVolume, csi_pb2.NodeExpandVolumeRequest(volume_path=str(root.path)), "volume_id"),
    ]
    for call, request, field in cases:
        fails(call, request, Code.INVALID_ARGUMENT, field)
    assert not mounts_under(root.path) and not loop_devices(driver, vid)


# -- info ----------------------------------------------------------------------------------


def test_node_info_capabilities_and_id(root):
    plain = root.driver(extra=["--max-volumes-per-node", "7"]).start()
    info = plain.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
    assert info.node_id == "node-a"
    assert info.max_volumes_per_node == 7
    assert dict(info.accessible_topology.segments) == {"topology.loop.csi.crust.dev/node": "node-a"}
    caps = {c.rpc.type for c in plain.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
            .capabilities}
    assert caps == {RPC.STAGE_UNSTAGE_VOLUME, RPC.GET_VOLUME_STATS, RPC.EXPAND_VOLUME, RPC.VOLUME_CONDITION,
                    RPC.SINGLE_NODE_MULTI_WRITER}
    # The alpha RPC is served even when its capability is not advertised.
    assert plain.node.NodeGetID(csi_pb2.NodeGetIDRequest(), timeout=10).node_id == "node-a"

    alpha = root.driver(node_id="node-b", endpoint_name="alpha.sock", extra=["--advertise-alpha"]).start()
    caps = {c.rpc.type for c in alpha.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
            .capabilities}
    assert RPC.GET_ID in caps and RPC.STAGE_UNSTAGE_VOLUME in caps
    assert alpha.node.NodeGetID(csi_pb2.NodeGetIDRequest(), timeout=10).node_id == "node-b"
    info = alpha.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
    assert info.node_id == "node-b" and info.max_volumes_per_node == 64
    assert dict(info.accessible_topology.segments) == {"topology.loop.csi.crust.dev/node": "node-b"}
