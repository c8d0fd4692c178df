"""The Kata mirror the proxy writes (crust.contract.volumes_dir), read the
way a stock Kata reads it: by runtime-rs (Kata 4's default shim) and by the
Go runtime, with the rules of tests/harness/kata_readers.py. The files are written
by the proxy's own writer below a temporary directory; the device is a
block special file made there (never opened)."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pytest

from crust.contract.mountinfo import MountInfo
from crust.contract.volumes_dir import VolumesDir
from crust.kata.sandbox.direct_volume import DirectVolumes, parse_mount_info
from crust.common.errors import InvalidArgument
from tests.harness.kata_readers import (KataRefuses, entry_dir, go_parse, go_runtime_reads, runtime_rs_parse,
                                runtime_rs_reads)

TARGET = "/var/lib/kubelet/pods/7c1d/volumes/kubernetes.io~csi/pvc-1/mount"


@pytest.fixture
def node(tmp_path):
    device = tmp_path / "blk"
    os.mknod(device, stat.S_IFBLK | 0o600, os.makedev(7, 250))
    return tmp_path, str(device), VolumesDir(tmp_path / "volumes", tmp_path / "kata")


def described(device: str, **kw) -> MountInfo:
    fields = dict(device=device, fstype="xfs", metadata={"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"},
                  options=["noatime"], target_path=TARGET, volume_id="vol-1", capacity_bytes=1 << 30,
                  device_major=7, device_minor=250)
    fields.update(kw)
    return MountInfo(**fields)


def test_runtime_rs_mounts_the_mirror_as_a_raw_block_volume(node):
    root, device, volumes = node
    asyncio.run(volumes.write(described(device)))
    mirror = root / "kata"
    assert runtime_rs_reads(mirror, TARGET) == {"device": device, "fstype": "xfs", "read_only": False,
                                                "fs_group": None}
    data = json.loads((entry_dir(mirror, TARGET) / "mountInfo.json").read_bytes())
    assert data["volume-type"] == "directvol"
    # The canonical entry beside it keeps "block", which runtime-rs refuses:
    # the mirror is what a Kata 4 node reads.
    canonical = (root / "volumes" / os.listdir(root / "volumes")[0] / "mountInfo.json").read_bytes()
    assert json.loads(canonical)["volume-type"] == "block"
    assert runtime_rs_parse(canonical)["volume-type"] == "block"
    (entry_dir(mirror, TARGET) / "mountInfo.json").write_bytes(canonical)
    with pytest.raises(KataRefuses, match='volume type "block" is invalid'):
        runtime_rs_reads(mirror, TARGET)


def test_the_go_runtime_takes_device_fstype_options_and_fs_group_from_the_mirror(node):
    root, device, volumes = node
    asyncio.run(volumes.write(described(device, readonly=True)))
    read = go_runtime_reads(root / "kata", TARGET)
    assert read == {"device": device, "fstype": "xfs", "options": ["noatime", "ro"], "read_only": True,
                    "fs_group": 2000, "fs_group_change_policy": "OnRootMismatch", "attached": True}


def test_the_mirror_of_a_volume_without_fs_group_or_options_still_has_every_key(node):
    """Kata's older runtime-rs required metadata and options; crust always writes both."""
    root, device, volumes = node
    asyncio.run(volumes.write(described(device, metadata={}, options=[])))
    data = json.loads((entry_dir(root / "kata", TARGET) / "mountInfo.json").read_bytes())
    assert data["metadata"] == {} and data["options"] == []
    assert runtime_rs_reads(root / "kata", TARGET)["fs_group"] is None
    assert go_runtime_reads(root / "kata", TARGET)["fs_group"] is None


def test_the_readers_refuse_what_kata_refuses(node):
    """The readers are strict where Kata is: so a mirror crust got wrong fails here."""
    _, device, _ = node
    good = {"volume-type": "directvol", "device": device, "fstype": "ext4", "metadata": {}, "options": []}
    for bad, words in [({**good, "metadata": {"fsGroup": 2000}}, "metadata"),
                       ({**good, "options": "ro"}, "options"),
                       ({k: v for k, v in good.items() if k != "fstype"}, "missing field `fstype`"),
                       ({**good, "device": None}, "device")]:
        with pytest.raises(KataRefuses, match=words):
            runtime_rs_parse(json.dumps(bad).encode())
    with pytest.raises(KataRefuses, match="duplicate field"):
        runtime_rs_parse(b'{"volume-type": "directvol", "volume-type": "block", "device": "/d", "fstype": "x"}')
    with pytest.raises(KataRefuses, match="metadata"):
        go_parse(json.dumps({**good, "metadata": {"fsGroup": 2000}}).encode())
    # The Go runtime is lenient where encoding/json is.
    assert go_parse(b'{"Device": "/dev/x", "FSTYPE": "ext4", "options": null}')["device"] == "/dev/x"
    assert go_parse(b'{"volume-type": "anything"}')["fstype"] == ""


def test_crusts_direct_volume_verbs_take_directvol_and_block(tmp_path):
    volumes = DirectVolumes(tmp_path / "dv")
    for i, kind in enumerate(("directvol", "block")):
        path = f"/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv{i}/mount"
        info = json.dumps({"volume-type": kind, "device": "/dev/loop9", "fstype": "ext4",
                           "metadata": {"fsGroup": "2000"}})
        assert parse_mount_info(info).volume_type == kind
        assert volumes.add(path, info) is True
        read = volumes.read(path)
        assert (read.volume_type, read.device, read.metadata) == (kind, "/dev/loop9", {"fsGroup": "2000"})
    with pytest.raises(InvalidArgument, match="'volume-type' 'spdkvol'.*'block' or 'directvol'"):
        parse_mount_info('{"volume-type": "spdkvol", "device": "/dev/x", "fstype": "ext4"}')


def test_the_proxys_mirror_is_not_taken_for_a_kata_style_drivers_volume(node):
    """crust's direct-volume reader skips the proxy's mirror (claimed through
    the registry): the schema version key stays in it."""
    root, device, volumes = node
    asyncio.run(volumes.write(described(device)))
    assert DirectVolumes(root / "kata").read(TARGET) is None
    assert volumes.holds(described(device))
    assert not volumes.holds(described(device, fstype="ext4"))
