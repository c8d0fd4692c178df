"""Format versions (crust.common.formats): every record and mountInfo.json
names the format it was written in; a crust reads its own and every older
one, and refuses a newer one, naming the file and both versions, before it
acts on anything. The daemons' refusal at start is in tests/integration/test_formats.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import BaseModel, ConfigDict

from crust.common import saferead
from crust.common.formats import FORMAT_KEY, NewerFormat, decode, encode, found_version
from crust.common.recordstore import RecordStore
from crust.contract.mountinfo import SCHEMA_VERSION, MountInfo, digest
from crust.contract.volumes_dir import VolumesDir
from crust.csi_shim.records import ShimVolumeRecord
from crust.driver.records import (GroupSnapshotRecord, NodeVolumeRecord, PoolRecord, SnapshotRecord,
                                  VolumeRecord)
from crust.kata.vmm.accel import ProbeRecord
from crust.node.supervisor import NodeStatus
from crust.proxy.records import Decision, DeferredVolume, HandlerRecord
from crust.runtime_handler.container_records import ContainerRecord
from crust.runtime_handler.handler import SandboxRecord
from crust.runtime_handler.index import VolumeIndex
from crust.runtime_handler.resolve import EntryRefused, resolve

TARGET = "/var/lib/kubelet/pods/p1/volumes/kubernetes.io~csi/pv-1/mount"


class Rec(BaseModel):
    name: str
    size: int = 0


# -- the format key ---------------------------------------------------------------------------------


@pytest.mark.parametrize("indent", [1, None])
def test_a_record_names_its_format_first_and_reads_back(indent):
    data = encode(Rec(name="a", size=3), indent=indent)
    assert list(json.loads(data)) == [FORMAT_KEY, "name", "size"]
    assert json.loads(data)[FORMAT_KEY] == 1
    assert decode(Rec, data) == Rec(name="a", size=3)
    assert found_version(data) == 1

    class Empty(BaseModel):
        FORMAT_VERSION: ClassVar[int] = 4

    assert json.loads(encode(Empty(), indent=indent)) == {FORMAT_KEY: 4}


def test_the_format_key_costs_no_second_serialisation():
    """The key is spliced in front of pydantic's JSON: the rest is byte for
    byte what the record wrote before formats were named."""
    record = DeferredVolume(target_path=TARGET, info=MountInfo(device="/dev/loop3", fstype="ext4",
                                                                target_path=TARGET))
    before = record.model_dump_json(indent=1).encode()
    after = encode(record)
    assert after == b'{\n "format_version": 1,' + before[1:]


# Records as the first release of each model wrote them (git history of the
# record modules): no format key, fewer keys. Each must read as version 1.
HISTORIC = {
    # e75210b: the driver's first records.
    VolumeRecord: {"volume_id": "vol-1", "name": "pvc-1", "node": "n1", "capacity_bytes": 1048576,
                   "required_bytes": 1048576, "limit_bytes": 0, "parameters": {}, "mutable_parameters": {},
                   "content_source": {"snapshot_id": "", "volume_id": ""},
                   "published": {"n1": {"readonly": False, "access_mode": 1, "access_type": "mount"}},
                   "state": "ready", "created_at": 1.0},
    SnapshotRecord: {"snapshot_id": "snap-1", "name": "s", "source_volume_id": "vol-1", "node": "n1",
                     "size_bytes": 1048576, "parameters": {}, "group_snapshot_id": "", "state": "ready",
                     "created_at": 1.0},
    GroupSnapshotRecord: {"group_snapshot_id": "g-1", "name": "g", "source_volume_ids": ["vol-1"],
                          "snapshot_ids": ["snap-1"], "parameters": {}, "state": "ready", "created_at": 1.0},
    PoolRecord: {"node_id": "n1", "capacity_bytes": 10, "max_volumes_per_node": 64,
                 "topology": {"topology.crust.dev/node": "n1"}, "updated_at": 1.0},
    # e75210b: before the loop devices were recorded (3e5316d).
    NodeVolumeRecord: {"volume_id": "vol-1", "staging_path": "/s", "access_type": "mount", "access_mode": 1,
                       "fs_type": "ext4", "mount_flags": [],
                       "published": {"/t": {"readonly": False, "access_type": "mount"}}},
    # c4e6d11: before the delegated fsGroup (7055535).
    ShimVolumeRecord: {"volume_id": "vol-1", "staging_path": "/s", "fs_type": "ext4", "mount_flags": [],
                       "access_mode": 1, "backend_staging": "/b/s", "backend_target": "/b/t",
                       "publish_context": {}, "volume_context": {},
                       "published": {"/t": {"deferred": True, "readonly": False, "supplemental_group": "",
                                            "supplemental_group_change_policy": ""}}},
    # d6ae4ed: before abnormal_reason (26559e3) and the claim's start time (1378b94).
    DeferredVolume: {"target_path": TARGET,
                     "info": {"volume_type": "block", "device": "/dev/loop3", "fstype": "ext4", "metadata": {},
                              "options": [], "schema_version": 1, "readonly": False, "volume_id": "vol-1",
                              "target_path": TARGET, "capacity_bytes": 1048576, "device_major": 7,
                              "device_minor": 3, "volume_context": {}},
                     "staged_at": 1.0, "claim": {"handler": "mountns", "sandbox_id": "pod-1", "sandbox_pid": 42,
                                                 "claimed_at": 2.0},
                     "kata_mirror_error": ""},
    Decision: {"target_path": TARGET, "volume_id": "vol-1", "deferred": True, "reason": "r", "decided_at": 1.0},
    # 00372f4: before direct volumes (064a5e4) and the holder's start time (1378b94).
    SandboxRecord: {"sandbox_id": "pod-1", "bundle": "/b", "pid": 42, "process_pid": 43,
                    "volumes": {"d": {"target_path": TARGET, "device": "/dev/loop3", "fs_type": "ext4",
                                      "mount_point": "/m", "readonly": False,
                                      "views": [{"destination": "/data", "subpath": "", "readonly": False}]}},
                    "created_at": 1.0},
    # 7db2d9d and cd5d828: a handler's lease hash kept by the proxy; a container of crust's OCI runtime.
    HandlerRecord: {"name": "mountns", "endpoint": "unix:///run/crust/handler.sock", "filesystems": ["ext4"],
                    "features": ["stats"], "lease_sha256": "ab" * 32, "registered_at": 1.0,
                    "registered_by_uid": 0, "registered_by_pid": 7},
    ContainerRecord: {"container_id": "c-1", "sandbox_id": "pod-1", "bundle": "/b", "state": "prepared",
                      "runtime_pid": 0, "runtime_pid_start": 0, "pid": 0, "pid_start": 0, "mount_namespace": "",
                      "mounts": [{"destination": "/data", "target_path": TARGET, "device": "/dev/loop3",
                                  "fs_type": "xfs", "options": [], "readonly": False, "device_major": 7,
                                  "device_minor": 3, "fs_group": "", "fs_group_change_policy": ""}],
                      "created_at": 1.0},
    # 80e4bd5 and 4833d15: the node's status file and the microVM handler's kept probe.
    NodeStatus: {"node_id": "n1", "supervisor_pid": 1, "started_at": 1.0,
                 "children": [{"name": "driver", "socket": "/d.sock", "pid": 2, "running": True, "starts": 1,
                               "restarts": 0, "last_exit": "", "last_exit_at": 0.0}]},
    ProbeRecord: {"key": "k", "accel": "tcg", "reason": "r", "probed_at": 1.0, "expires_at": None},
}


def _kept(old, new) -> bool:
    """Whether every key of old is in new with the same value (new may have more keys)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(k in new and _kept(v, new[k]) for k, v in old.items())
    if isinstance(old, list):
        return isinstance(new, list) and len(old) == len(new) and all(map(_kept, old, new))
    return old == new


@pytest.mark.parametrize("model", list(HISTORIC), ids=lambda m: m.__name__)
def test_records_written_before_formats_were_named_read_as_version_1(tmp_path, model):
    data = json.dumps(HISTORIC[model], indent=1).encode()
    assert found_version(data) == 1
    record = decode(model, data, tmp_path / "r.json")
    # Every key the old release wrote means today what it meant then.
    assert _kept(HISTORIC[model], record.model_dump(mode="json"))
    if model in (NodeStatus, ProbeRecord, PoolRecord):
        return  # single files, not kept in a store
    store = RecordStore(tmp_path / "store", model)
    (tmp_path / "store" / "old.json").write_bytes(data)
    assert dict(store.load_all()) == {"old": record}
    store.put_sync("old", record)  # written again: in today's format, and read back the same
    assert json.loads((tmp_path / "store" / "old.json").read_bytes())[FORMAT_KEY] == 1
    assert store.get("old") == record


def test_a_store_over_a_newer_record_refuses_at_once_naming_the_file_and_both_versions(tmp_path):
    d = tmp_path / "recs"
    RecordStore(d, Rec).put_sync("good", Rec(name="g"))
    newer = b'{\n "format_version": 2,\n "name": "n",\n "meaning": "changed"\n}'
    (d / "newer.json").write_bytes(newer)
    with pytest.raises(NewerFormat) as refused:
        RecordStore(d, Rec)
    message = str(refused.value)
    assert str(d / "newer.json") in message
    assert "format version 2" in message and "reads versions 1 to 1" in message
    assert (refused.value.found, refused.value.known) == (2, 1)
    # Nothing was moved aside or rewritten: the newer crust finds its record.
    assert sorted(p.name for p in d.iterdir()) == ["good.json", "newer.json"]
    assert (d / "newer.json").read_bytes() == newer


def test_a_newer_record_found_later_is_refused_before_any_record_is_yielded(tmp_path):
    d = tmp_path / "recs"
    store = RecordStore(d, Rec)
    store.put_sync("a", Rec(name="a"))
    # Hand-edited: the key not first. Found when the whole record is read.
    (d / "b.json").write_bytes(b'{"name": "b", "format_version": 7}')
    yielded = []
    with pytest.raises(NewerFormat, match="format version 7"):
        for key, _ in store.load_all():
            yielded.append(key)
    assert yielded == []
    with pytest.raises(NewerFormat, match=str(d / "b.json")):
        store.get("b")
    assert (d / "b.json").exists()


def test_a_newer_description_inside_a_record_refuses_the_record(tmp_path):
    """A proxy record embeds the volume's description: a newer one there is
    a newer record, not a corrupt one."""
    d = tmp_path / "volumes"
    store = RecordStore(d, DeferredVolume)
    volume = DeferredVolume(target_path=TARGET, info=MountInfo(device="/dev/loop3", fstype="ext4",
                                                                target_path=TARGET))
    store.put_sync("v", volume)
    raw = json.loads((d / "v.json").read_bytes())
    raw["info"]["schema_version"] = SCHEMA_VERSION + 1
    (d / "v.json").write_text(json.dumps(raw))
    with pytest.raises(NewerFormat) as refused:
        list(RecordStore(d, DeferredVolume).load_all())
    assert str(d / "v.json") in str(refused.value) and "crust-schema-version" in str(refused.value)
    assert (d / "v.json").exists() and not (d / "v.corrupt").exists()


@pytest.mark.parametrize("value", ['"two"', "0", "-1", "true", "1.5"])
def test_a_format_version_that_is_no_version_is_damage(tmp_path, value):
    d = tmp_path / "recs"
    d.mkdir()
    (d / "x.json").write_text(f'{{"name": "x", "format_version": {value}}}')
    assert dict(RecordStore(d, Rec).load_all()) == {}
    assert (d / "x.corrupt").exists()
    with pytest.raises(saferead.Refused):
        saferead.read_model(Rec, d / "x.corrupt")


def test_an_older_format_is_upgraded_by_its_model(tmp_path):
    """How a model reads a format it no longer writes: upgrade_format, one
    version at a time, from the parsed JSON."""

    class Renamed(BaseModel):
        FORMAT_VERSION: ClassVar[int] = 3
        label: str
        size_bytes: int = 0

        @classmethod
        def upgrade_format(cls, version: int, data: dict) -> dict:
            if version == 1:  # 1 -> 2: "name" became "label"
                data["label"] = data.pop("name")
            if version == 2:  # 2 -> 3: sizes in bytes
                data["size_bytes"] = data.pop("size_kib", 0) * 1024
            return data

    assert decode(Renamed, b'{"name": "a", "size_kib": 2}') == Renamed(label="a", size_bytes=2048)
    assert decode(Renamed, b'{"format_version": 2, "label": "b", "size_kib": 1}') == Renamed(label="b",
                                                                                               size_bytes=1024)
    assert decode(Renamed, encode(Renamed(label="c", size_bytes=5))) == Renamed(label="c", size_bytes=5)
    with pytest.raises(NewerFormat, match="reads versions 1 to 3"):
        decode(Renamed, b'{"format_version": 4, "label": "d"}', tmp_path / "d.json")
    (tmp_path / "old.json").write_bytes(b'{"name": "e"}')
    assert saferead.read_model(Renamed, tmp_path / "old.json") == Renamed(label="e")


def test_a_record_model_must_let_unknown_keys_pass(tmp_path):
    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str

    with pytest.raises(TypeError, match="unknown keys"):
        RecordStore(tmp_path / "strict", Strict)


# -- mountInfo.json ---------------------------------------------------------------------------------


def _entry(root: Path, version: int | None, device: str = "/dev/loop3") -> Path:
    info = json.loads(MountInfo(device=device, fstype="ext4", target_path=TARGET).to_json())
    if version is None:
        del info["crust-schema-version"]
    else:
        info["crust-schema-version"] = version
    entry = root / digest(TARGET)
    entry.mkdir(parents=True, exist_ok=True, mode=0o700)
    (entry / "mountInfo.json").write_text(json.dumps(info))
    return entry / "mountInfo.json"


def test_a_description_without_a_version_is_version_1_and_a_newer_one_is_refused(tmp_path):
    path = _entry(tmp_path, None)
    assert MountInfo.model_validate_json(path.read_bytes()).schema_version == 1
    path = _entry(tmp_path, SCHEMA_VERSION + 1)
    with pytest.raises(NewerFormat) as refused:
        saferead.read_model(MountInfo, path)
    assert str(path) in str(refused.value)
    assert f"format version {SCHEMA_VERSION + 1}" in str(refused.value)
    assert f"reads versions 1 to {SCHEMA_VERSION}" in str(refused.value)
    # The proxy, its writer, takes it for one to write again from its records.
    assert VolumesDir(tmp_path).read(TARGET) is None
    _entry(tmp_path, SCHEMA_VERSION)
    assert VolumesDir(tmp_path).read(TARGET).device == "/dev/loop3"


def test_a_handler_refuses_an_entry_of_a_newer_format_and_says_why(tmp_path, caplog):
    path = _entry(tmp_path, SCHEMA_VERSION + 1)
    index = VolumeIndex(tmp_path).start()
    try:
        assert index.get(digest(TARGET)) is None
        with pytest.raises(EntryRefused) as refused:
            resolve(TARGET + "/sub/dir", index)
        assert str(path) in str(refused.value) and f"format version {SCHEMA_VERSION + 1}" in str(refused.value)
        assert any("refusing an entry of a newer format" in r.getMessage() for r in caplog.records)
        # The proxy writes it again in a format the handler reads: used at once.
        _entry(tmp_path, SCHEMA_VERSION, device="/dev/loop4")
        deadline = time.monotonic() + 5
        while index.get(digest(TARGET)) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert resolve(TARGET, index).info.device == "/dev/loop4"
        assert index.refusal(digest(TARGET)) is None
    finally:
        index.stop()
