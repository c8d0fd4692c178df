"""Logic-only unit tests: input checks, paging, mountinfo parsing, redaction,
atomic files, record stores, sizes, endpoints, the generated stubs and the
wire facts of specs/csi.proto. Nothing here touches a device or a mount.
"""

from __future__ import annotations

import asyncio
import errno
import gzip
import importlib.util
import lzma
import os
import re
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from pydantic import BaseModel

from crust.api import csi_pb2
from crust.common import atomicfile, csi_input, endpoint, units
from crust.common.aio import KeyedLocks, first_done, in_thread
from crust.common.errors import (
    Aborted,
    CrustError,
    InvalidArgument,
    NoSpace,
    OutOfRange,
)
from crust.common.recordstore import RecordStore
from crust.common.redact import MASK, redacted
from crust.driver.paging import TOKEN_PREFIX, paged
from crust.kata import bzimage
from crust.kata import image as kata_image
from crust.sys import mount as sysmount

REPO = Path(__file__).resolve().parent.parent
MIB = 1024**2
GIB = 1024**3


def _raises(exc_type: type[CrustError], fn, *args, **kw) -> CrustError:
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    # The exact class, not a subclass or sibling: the class is the gRPC code.
    assert type(info.value) is exc_type
    return info.value


# -- csi_input.path ----------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("/", "/"),
    ("/var/lib/kubelet/pods/p/volumes/x/mount", "/var/lib/kubelet/pods/p/volumes/x/mount"),
    ("/a/b/", "/a/b"),  # a trailing slash names the same directory
    ("/with space/and-ünïcode", "/with space/and-ünïcode"),
    ("/a/.hidden/..x", "/a/.hidden/..x"),  # dots inside a name are not components
])
def test_path_accepts_normalised_absolute_paths(value, expected):
    assert csi_input.path(value, "target_path") == expected


@pytest.mark.parametrize("value", [
    "relative/path",
    "./x",
    "..",
    "/a/../b",
    "/a/..",
    "/..",
    "/a/./b",
    "/a//b",
    "//a",  # POSIX normpath keeps a leading '//', the check must not
    "//",
    "/a/b//",
])
def test_path_rejects_relative_and_unnormalised(value):
    err = _raises(InvalidArgument, csi_input.path, value, "staging_target_path")
    assert "staging_target_path" in err.message


def test_path_rejects_empty_nul_and_too_long():
    for value in ("", "/a\x00b", "/" + "x" * csi_input.MAX_PATH):
        err = _raises(InvalidArgument, csi_input.path, value, "target_path")
        assert "target_path" in err.message
    # The limit is in bytes (PATH_MAX), not characters.
    wide = "/" + "é" * (csi_input.MAX_PATH // 2 + 10)
    assert len(wide) < csi_input.MAX_PATH < len(wide.encode())
    err = _raises(InvalidArgument, csi_input.path, wide, "target_path")
    assert "target_path" in err.message
    # Right at the limit is fine.
    # (PATH_MAX counts the terminating NUL: 4095 bytes of text, in
    # components of at most NAME_MAX.)
    longest = ("/" + "x" * 255) * 15 + "/" + "x" * 254
    assert len(longest) == csi_input.MAX_PATH - 1
    assert csi_input.path(longest, "p") == longest
    err = _raises(InvalidArgument, csi_input.path, longest + "x", "p")
    assert "4096 bytes" in err.message
    err = _raises(InvalidArgument, csi_input.path, "/a/" + "x" * 256, "p")
    assert "component of 256 bytes" in err.message


# -- csi_input.mount_flags -------------------------------------------------------------


def test_mount_flags_accepts_single_options():
    flags = ["noatime", "discard", "context=system_u:object_r:container_file_t:s0", "uid=1000"]
    assert csi_input.mount_flags(flags, "volume_capability.mount.mount_flags") == flags


@pytest.mark.parametrize("flag", ["ro,exec", "a,", ",", "x\ny", "x\ty", "x\x00", "x\x1f", "x\x7f", "x\x85"])
def test_mount_flags_rejects_commas_and_control_characters(flag):
    err = _raises(InvalidArgument, csi_input.mount_flags, ["noatime", flag], "cap.mount.mount_flags")
    assert "cap.mount.mount_flags[1]" in err.message


def test_mount_flags_rejects_empty_and_too_long():
    for flag in ("", "x" * (csi_input.MAX_OPTION + 1)):
        err = _raises(InvalidArgument, csi_input.mount_flags, [flag], "f")
        assert "f[0]" in err.message


def test_capability_checks_mount_flags_inside():
    cap = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(mount_flags=["ro,exec"]),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))
    err = _raises(InvalidArgument, csi_input.capability, cap, "volume_capability", csi_input.SINGLE_NODE_MODES,
                  ("ext4",))
    assert "volume_capability.mount.mount_flags[0]" in err.message


# -- csi_input.capacity ------------------------------------------------------------------


def _capacity(required=0, limit=0, *, default=GIB, minimum=16 * MIB, maximum=100 * GIB, align=MIB, none=False):
    rng = None if none else csi_pb2.CapacityRange(required_bytes=required, limit_bytes=limit)
    return csi_input.capacity(rng, default=default, minimum=minimum, maximum=maximum, align=align)


def test_capacity_defaults_minimum_and_rounding():
    assert _capacity(none=True) == GIB
    assert _capacity() == GIB
    assert _capacity(required=1) == 16 * MIB  # raised to the minimum
    assert _capacity(required=64 * MIB) == 64 * MIB  # exact multiples are honoured
    assert _capacity(required=64 * MIB + 1) == 65 * MIB  # rounded up, never down
    assert _capacity(required=100 * GIB) == 100 * GIB  # the maximum itself is allowed


def test_capacity_within_limit():
    # Only a limit: the default, capped by the limit.
    assert _capacity(limit=32 * MIB) == 32 * MIB
    assert _capacity(limit=4 * GIB) == GIB
    # required == limit, aligned: exactly that.
    assert _capacity(required=48 * MIB, limit=48 * MIB) == 48 * MIB
    # A limit that is not a MiB multiple still admits the aligned size below it.
    assert _capacity(limit=20 * MIB + 5) == 20 * MIB
    assert _capacity(required=17 * MIB, limit=20 * MIB + 5) == 17 * MIB
    assert _capacity(required=17 * MIB + 1, limit=20 * MIB + 5) == 18 * MIB


def test_capacity_out_of_range_versus_invalid_argument():
    # Contradictory or negative requests are the caller's mistake.
    err = _raises(InvalidArgument, _capacity, required=64 * MIB, limit=32 * MIB)
    assert "capacity_range" in err.message
    _raises(InvalidArgument, _capacity, required=-1)
    _raises(InvalidArgument, _capacity, limit=-1)
    # Well-formed ranges this driver cannot satisfy are OUT_OF_RANGE.
    err = _raises(OutOfRange, _capacity, limit=8 * MIB)  # below the minimum
    assert "capacity_range" in err.message
    _raises(OutOfRange, _capacity, required=17 * MIB + 1, limit=17 * MIB + 1000)  # no MiB multiple fits
    _raises(OutOfRange, _capacity, required=100 * GIB + 1)  # above the maximum
    _raises(OutOfRange, _capacity, required=1, maximum=8 * MIB)  # minimum above the maximum
    assert InvalidArgument.code is grpc.StatusCode.INVALID_ARGUMENT
    assert OutOfRange.code is grpc.StatusCode.OUT_OF_RANGE


# -- paging.paged -------------------------------------------------------------------------


IDS = [f"vol-{i:03d}" for i in range(10)]


@pytest.mark.parametrize("max_entries", [1, 3, 4, 9, 10, 11])
def test_page_walk_covers_every_id_once(max_entries):
    seen, token, calls = [], "", 0
    while True:
        page, token = paged(IDS, token, max_entries)
        assert 0 < len(page) <= max_entries
        seen += page
        calls += 1
        if not token:
            break
        assert calls < 50
    assert seen == IDS
    assert calls == -(-len(IDS) // max_entries)


def test_page_zero_means_all():
    assert paged(IDS, "", 0) == (IDS, "")
    assert paged([], "", 0) == ([], "")
    assert paged([], "", 5) == ([], "")


def test_page_token_of_deleted_id_still_works():
    page, token = paged(IDS, "", 3)
    assert page == IDS[:3] and token
    remaining = [i for i in IDS if i != page[-1]]  # the last returned item is deleted
    remaining.append("vol-999")  # and one is created meanwhile
    seen, token2 = [], token
    while token2:
        chunk, token2 = paged(remaining, token2, 3)
        seen += chunk
    assert seen == IDS[3:] + ["vol-999"]


def test_page_invalid_token_is_aborted():
    for bad in ("garbage", "vol-003", "AFTER:vol-003"):
        err = _raises(Aborted, paged, IDS, bad, 3)
        assert "starting_token" in err.message
    assert Aborted.code is grpc.StatusCode.ABORTED
    # A well-formed token past the end is an empty last page, not an error.
    assert paged(IDS, TOKEN_PREFIX + "zzz", 3) == ([], "")


def test_page_negative_max_entries_is_invalid():
    _raises(InvalidArgument, paged, IDS, "", -1)


# -- mount.parse_mountinfo ------------------------------------------------------------------


MOUNTINFO = "\n".join([
    r"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro",
    r"36 35 98:0 /mnt1 /mnt/with\040space rw,noatime master:1 propagate_from:2 - ext3 /dev/root rw,errors=continue",
    r"40 22 7:3 / /var/lib/k/a\040b\011c\134d rw,relatime - xfs /dev/loop3 rw,attr2,inode64",
    r"41 22 0:6 /loop3 /tmp/t/block ro,nosuid shared:7 - devtmpfs devtmpfs rw,size=100k",
    r"50 22 0:45 / /srv/x\040-\040y rw - tmpfs my\040tmpfs rw",
    "",
    "garbage line",
])


def test_parse_mountinfo():
    entries = sysmount.parse_mountinfo(MOUNTINFO)
    assert [e.mount_id for e in entries] == [22, 36, 40, 41, 50]
    root, spaced, loop, block, dashed = entries
    assert (root.major, root.minor, root.root, root.mount_point) == (8, 1, "/", "/")
    assert root.fs_type == "ext4" and root.source == "/dev/sda1"
    assert root.options == ("rw", "relatime") and root.super_options == ("rw", "errors=remount-ro")
    # Two optional fields before the separator.
    assert spaced.mount_point == "/mnt/with space"
    assert spaced.root == "/mnt1"
    assert (spaced.major, spaced.minor) == (98, 0)
    assert spaced.options == ("rw", "noatime")
    assert spaced.fs_type == "ext3" and spaced.source == "/dev/root"
    assert spaced.super_options == ("rw", "errors=continue")
    # No optional field at all; tab and backslash escapes.
    assert loop.mount_point == "/var/lib/k/a b\tc\\d"
    assert (loop.major, loop.minor, loop.fs_type, loop.source) == (7, 3, "xfs", "/dev/loop3")
    assert not loop.readonly
    assert block.readonly and block.root == "/loop3" and block.fs_type == "devtmpfs"
    # An escaped " - " in a mount point is not the separator.
    assert dashed.mount_point == "/srv/x - y"
    assert dashed.fs_type == "tmpfs" and dashed.source == "my tmpfs"


# -- redact ----------------------------------------------------------------------------------


SECRETS = {"password": "hunter2", "token": "s3cr3t"}


def _no_secret_left(obj) -> None:
    text = repr(obj)
    for value in SECRETS.values():
        assert value not in text


def test_redacted_strips_top_level_secrets_and_keeps_the_rest():
    stage = csi_pb2.NodeStageVolumeRequest(
        volume_id="vol-1", staging_target_path="/s", secrets=SECRETS, volume_context={"fsType": "ext4"},
        publish_context={"node": "a"})
    out = redacted(stage)
    _no_secret_left(out)
    assert out["secrets"] == {"password": MASK, "token": MASK}
    assert out["volume_id"] == "vol-1" and out["staging_target_path"] == "/s"
    assert out["volume_context"] == {"fsType": "ext4"} and out["publish_context"] == {"node": "a"}
    assert stage.secrets["password"] == "hunter2"  # the request itself is untouched

    create = csi_pb2.CreateVolumeRequest(
        name="pvc-1", secrets=SECRETS, parameters={"provisioning": "thin"},
        capacity_range=csi_pb2.CapacityRange(required_bytes=5))
    out = redacted(create)
    _no_secret_left(out)
    assert out["secrets"] == {"password": MASK, "token": MASK}
    assert out["name"] == "pvc-1" and out["parameters"] == {"provisioning": "thin"}
    assert out["capacity_range"] == {"required_bytes": "5"}

    snap = csi_pb2.CreateSnapshotRequest(source_volume_id="vol-1", name="s", secrets=SECRETS,
                                         parameters={"k": "v"})
    out = redacted(snap)
    _no_secret_left(out)
    assert out["secrets"] == {"password": MASK, "token": MASK}
    assert out["parameters"] == {"k": "v"} and out["source_volume_id"] == "vol-1"


def test_every_csi_secrets_field_is_marked():
    # redacted() relies on the option: every `secrets` field must carry it.
    found = 0
    for msg in csi_pb2.DESCRIPTOR.message_types_by_name.values():
        for field in msg.fields:
            if field.name == "secrets":
                assert field.GetOptions().Extensions[csi_pb2.csi_secret], msg.full_name
                found += 1
    assert found >= 15


@pytest.fixture(scope="module")
def wrapper_class():
    """A message nesting CSI requests at depth (singular, repeated, map) and
    holding secret fields of other types, built at run time."""
    pool = descriptor_pool.Default()
    fdp = descriptor_pb2.FileDescriptorProto(name="crust_test_redact.proto", package="crusttest",
                                             syntax="proto3", dependency=[csi_pb2.DESCRIPTOR.name])
    msg = fdp.message_type.add(name="Wrapper")
    entry = msg.nested_type.add(name="ByNameEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=FieldDescriptor.TYPE_STRING, label=FieldDescriptor.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=FieldDescriptor.TYPE_MESSAGE, label=FieldDescriptor.LABEL_OPTIONAL,
                    type_name=".csi.v1.CreateSnapshotRequest")
    msg.field.add(name="stage", number=1, type=FieldDescriptor.TYPE_MESSAGE, label=FieldDescriptor.LABEL_OPTIONAL,
                  type_name=".csi.v1.NodeStageVolumeRequest")
    msg.field.add(name="creates", number=2, type=FieldDescriptor.TYPE_MESSAGE,
                  label=FieldDescriptor.LABEL_REPEATED, type_name=".csi.v1.CreateVolumeRequest")
    msg.field.add(name="by_name", number=3, type=FieldDescriptor.TYPE_MESSAGE,
                  label=FieldDescriptor.LABEL_REPEATED, type_name=".crusttest.Wrapper.ByNameEntry")
    token = msg.field.add(name="token", number=4, type=FieldDescriptor.TYPE_STRING,
                          label=FieldDescriptor.LABEL_OPTIONAL)
    token.options.Extensions[csi_pb2.csi_secret] = True
    pin = msg.field.add(name="pin", number=5, type=FieldDescriptor.TYPE_INT64, label=FieldDescriptor.LABEL_OPTIONAL)
    pin.options.Extensions[csi_pb2.csi_secret] = True
    msg.field.add(name="note", number=6, type=FieldDescriptor.TYPE_STRING, label=FieldDescriptor.LABEL_OPTIONAL)
    msg.field.add(name="inner", number=7, type=FieldDescriptor.TYPE_MESSAGE, label=FieldDescriptor.LABEL_OPTIONAL,
                  type_name=".crusttest.Wrapper")
    try:
        desc = pool.FindMessageTypeByName("crusttest.Wrapper")
    except KeyError:
        pool.AddSerializedFile(fdp.SerializeToString())
        desc = pool.FindMessageTypeByName("crusttest.Wrapper")
    return message_factory.GetMessageClass(desc)


def test_redacted_strips_secrets_at_any_depth(wrapper_class):
    W = wrapper_class
    inner = W(
        stage=csi_pb2.NodeStageVolumeRequest(volume_id="vol-deep", secrets=SECRETS),
        creates=[csi_pb2.CreateVolumeRequest(name="a", secrets=SECRETS),
                 csi_pb2.CreateVolumeRequest(name="b", parameters={"p": "1"})],
        token="s3cr3t", pin=1234567, note="visible",
    )
    inner.by_name["x"].CopyFrom(csi_pb2.CreateSnapshotRequest(name="snap-x", secrets=SECRETS))
    outer = W(inner=inner, stage=csi_pb2.NodeStageVolumeRequest(volume_id="vol-top", secrets=SECRETS))
    out = redacted(outer)
    _no_secret_left(out)
    assert "1234567" not in repr(out)
    assert out["stage"] == {"volume_id": "vol-top", "secrets": {"password": MASK, "token": MASK}}
    deep = out["inner"]
    assert deep["stage"]["secrets"] == {"password": MASK, "token": MASK}
    assert deep["stage"]["volume_id"] == "vol-deep"
    assert deep["creates"][0] == {"name": "a", "secrets": {"password": MASK, "token": MASK}}
    assert deep["creates"][1] == {"name": "b", "parameters": {"p": "1"}}
    assert deep["by_name"]["x"] == {"name": "snap-x", "secrets": {"password": MASK, "token": MASK}}
    assert deep["token"] == MASK
    assert "pin" not in deep
    assert deep["note"] == "visible"
    assert outer.inner.token == "s3cr3t"  # original untouched


# -- atomicfile ---------------------------------------------------------------------------------


def _temporaries(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_write_atomic_replaces_whole_file(tmp_path):
    target = tmp_path / "rec.json"
    target.write_bytes(b"x" * 10000)
    os.chmod(target, 0o644)
    atomicfile.write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert _temporaries(tmp_path) == []
    atomicfile.write_atomic(target, b"other", mode=0o644)
    assert target.read_bytes() == b"other"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


@pytest.mark.parametrize("failing", ["rename", "fsync"])
def test_write_atomic_failure_keeps_old_content(tmp_path, monkeypatch, failing):
    target = tmp_path / "rec.json"
    atomicfile.write_atomic(target, b"old content")
    real = getattr(os, failing)
    calls = []

    def boom(*args, **kw):
        calls.append(args)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, boom)
    # A full disk is the caller's RESOURCE_EXHAUSTED, naming the directory.
    with pytest.raises(NoSpace, match=str(tmp_path)):
        atomicfile.write_atomic(target, b"new content that must not appear")
    monkeypatch.setattr(os, failing, real)
    assert calls, f"os.{failing} was never called: the failure was not simulated"
    assert target.read_bytes() == b"old content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


def test_clean_temporaries_and_remove_durably(tmp_path):
    (tmp_path / ".a.json.k3j4.tmp").write_bytes(b"partial")
    (tmp_path / "a.json").write_bytes(b"{}")
    (tmp_path / "keep.tmp").write_bytes(b"not ours: no leading dot")
    assert atomicfile.clean_temporaries(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "keep.tmp"]
    assert atomicfile.remove_durably(tmp_path / "a.json") is True
    assert atomicfile.remove_durably(tmp_path / "a.json") is False


def test_write_atomic_reuse_fills_the_replaced_inode(tmp_path):
    target, spare = tmp_path / "rec.json", tmp_path / ".rec.json.spare.tmp"
    atomicfile.write_atomic(target, b"first, and longer than what follows", reuse=True)
    first = target.stat().st_ino
    assert not spare.exists()  # nothing replaced yet
    atomicfile.write_atomic(target, b"second", reuse=True)
    assert target.read_bytes() == b"second"
    assert spare.stat().st_ino == first and spare.read_bytes() == b"first, and longer than what follows"
    second = target.stat().st_ino
    atomicfile.write_atomic(target, b"third", reuse=True)
    # No inode was made: the record is now the first one, cut at its new length.
    assert target.stat().st_ino == first and target.read_bytes() == b"third"
    assert spare.stat().st_ino == second
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert atomicfile.remove_durably(target, spare=True) is True
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("planted", ["symlink", "hardlink", "fifo", "directory"])
def test_write_atomic_reuse_never_writes_through_a_planted_spare(tmp_path, planted):
    target, spare = tmp_path / "rec.json", tmp_path / ".rec.json.spare.tmp"
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a record")
    atomicfile.write_atomic(target, b"old", reuse=True)
    if planted == "symlink":
        spare.symlink_to(victim)
    elif planted == "hardlink":
        os.link(victim, spare)
    elif planted == "fifo":
        os.mkfifo(spare)
    else:
        spare.mkdir()
    atomicfile.write_atomic(target, b"new", reuse=True)
    assert target.read_bytes() == b"new" and victim.read_bytes() == b"not a record"
    # The planted thing is gone or set aside under a temporary's name; the spare is the old record.
    assert spare.read_bytes() == b"old"


_REWRITER = """
import sys
from crust.common import atomicfile
versions = [b"A" * 5000, b"B" * 300, b'{"c": 1}']
i = 0
while True:
    atomicfile.write_atomic(sys.argv[1], versions[i % 3], reuse=True)
    i += 1
    if i == 3:
        print("ready", flush=True)
"""


def test_write_atomic_reuse_survives_sigkill(tmp_path):
    """A writer killed at any instant leaves the record whole, old or new."""
    target = tmp_path / "rec.json"
    for delay in (0.0, 0.003, 0.007, 0.013, 0.021, 0.034, 0.055, 0.089):
        proc = subprocess.Popen([sys.executable, "-c", _REWRITER, str(target)], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"ready\n"
            time.sleep(delay)
        finally:
            proc.kill()
            proc.wait()
        assert target.read_bytes() in (b"A" * 5000, b"B" * 300, b'{"c": 1}')
        assert atomicfile.clean_temporaries(tmp_path) <= 2  # the spare, and a temporary cut short
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


# -- recordstore ------------------------------------------------------------------------------------


class Rec(BaseModel):
    name: str
    size: int = 0
    tags: dict[str, str] = {}


async def test_recordstore_round_trip(tmp_path):
    store = RecordStore(tmp_path / "recs", Rec)
    assert stat.S_IMODE((tmp_path / "recs").stat().st_mode) == 0o700
    assert store.get("vol-1") is None
    store.put_sync("vol-1", Rec(name="one", size=1, tags={"a": "b"}))
    await store.put("vol-2", Rec(name="two", size=2))
    assert store.get("vol-1") == Rec(name="one", size=1, tags={"a": "b"})
    assert stat.S_IMODE((tmp_path / "recs" / "vol-1.json").stat().st_mode) == 0o600
    # A second store over the same directory (a restart) sees the same.
    again = RecordStore(tmp_path / "recs", Rec)
    assert dict(again.load_all()) == {"vol-1": Rec(name="one", size=1, tags={"a": "b"}),
                                      "vol-2": Rec(name="two", size=2)}
    await again.put("vol-1", Rec(name="one", size=10))
    assert store.get("vol-1").size == 10
    await again.delete("vol-1")
    again.delete_sync("vol-1")  # idempotent
    assert store.get("vol-1") is None
    assert [k for k, _ in store.load_all()] == ["vol-2"]
    assert sorted(p.name for p in (tmp_path / "recs").iterdir()) == ["vol-2.json"]


def test_recordstore_moves_corrupt_files_aside(tmp_path):
    d = tmp_path / "recs"
    store = RecordStore(d, Rec)
    store.put_sync("good", Rec(name="g"))
    (d / "broken.json").write_bytes(b'{"name": "trunc')
    (d / "wrongshape.json").write_bytes(b'{"size": "not a number"}')
    (d / "empty.json").write_bytes(b"")
    loaded = dict(store.load_all())
    assert loaded == {"good": Rec(name="g")}
    assert sorted(p.name for p in d.iterdir()) == ["broken.corrupt", "empty.corrupt", "good.json",
                                                   "wrongshape.corrupt"]
    assert (d / "broken.corrupt").read_bytes() == b'{"name": "trunc'  # kept for a human
    assert dict(store.load_all()) == {"good": Rec(name="g")}  # and stays out of the way


def test_recordstore_cleans_temporaries_at_open(tmp_path):
    d = tmp_path / "recs"
    d.mkdir()
    (d / ".vol-1.json.abcd1234.tmp").write_bytes(b'{"name": "half')
    store = RecordStore(d, Rec)
    assert list(d.iterdir()) == []
    assert list(store.load_all()) == []


@pytest.mark.parametrize("key", ["../x", "a/b", "/etc/passwd", "..", ".hidden", "", "x\n", "a b", "-x", "x" * 202])
def test_recordstore_rejects_unsafe_keys(tmp_path, key):
    store = RecordStore(tmp_path / "recs", Rec)
    with pytest.raises(ValueError):
        store.put_sync(key, Rec(name="evil"))
    # Nothing can be stored under such a key, so nothing is found or removed
    # (a CO may ask about any id: no error that would end in INTERNAL).
    (tmp_path / "x.json").write_text(Rec(name="bait").model_dump_json())
    assert store.get(key) is None
    store.delete_sync(key)
    assert (tmp_path / "x.json").exists()
    (tmp_path / "x.json").unlink()
    assert list((tmp_path / "recs").iterdir()) == []
    assert not (tmp_path / "x.json").exists()


# -- units ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("4096", 4096), ("0", 0), ("512Mi", 512 * MIB), ("10Gi", 10 * GIB), ("1G", 10**9), ("1g", 10**9),
    ("2Ti", 2 * 2**40), ("3k", 3000), ("3Ki", 3072), ("1KiB", 1024), ("1MB", 10**6), (" 7 Mi ", 7 * MIB),
    ("100Gi", 100 * GIB),
])
def test_parse_size(text, value):
    assert units.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "Mi", "1.5Gi", "-1", "1Pi", "1 2", "10 Gix", "ten"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        units.parse_size(text)


def test_format_size():
    assert units.format_size(0) == "0"
    assert units.format_size(1000) == "1000"
    assert units.format_size(1024) == "1Ki"
    assert units.format_size(1536 * MIB) == "1536Mi"
    assert units.format_size(GIB) == "1Gi"
    assert units.format_size(3 * 2**40) == "3Ti"
    assert units.format_size(GIB + 1) == str(GIB + 1)
    for n in (0, 1, 1023, 4096, 64 * MIB, 100 * GIB, 2**40 + 2**20):
        assert units.parse_size(units.format_size(n)) == n


# -- endpoint -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, path", [
    ("unix:///run/csi/csi.sock", "/run/csi/csi.sock"),
    ("unix:/run/csi/csi.sock", "/run/csi/csi.sock"),
    ("/run/csi/csi.sock", "/run/csi/csi.sock"),
    ("unix:///run/csi/../x.sock", "/run/x.sock"),
    ("unix:///run//csi/./csi.sock", "/run/csi/csi.sock"),
])
def test_socket_path_forms(value, path):
    assert endpoint.socket_path(value) == path
    assert endpoint.grpc_target(value) == "unix://" + path


@pytest.mark.parametrize("value, words", [
    ("tcp://127.0.0.1:10000", "only unix"),
    ("csi.sock", "only unix"),
    ("", "only unix"),
    ("unix://relative/csi.sock", "absolute"),
    ("unix:relative.sock", "absolute"),
    ("unix://", "absolute"),
])
def test_socket_path_errors(value, words):
    with pytest.raises(ValueError) as info:
        endpoint.socket_path(value)
    assert words in str(info.value)
    assert repr(value) in str(info.value)


def test_clear_stale_socket(tmp_path):
    path = str(tmp_path / "s.sock")
    endpoint.clear_stale_socket(path)  # nothing there: fine
    # A socket nobody listens on is removed.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    endpoint.clear_stale_socket(path)
    assert not os.path.lexists(path)
    # A live one is refused and kept.
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(path)
        live.listen(1)
        with pytest.raises(RuntimeError, match="another server"):
            endpoint.clear_stale_socket(path)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        live.close()
    os.unlink(path)
    # Something that is not a socket is never removed.
    Path(path).write_text("precious")
    with pytest.raises(RuntimeError, match="not a socket"):
        endpoint.clear_stale_socket(path)
    assert Path(path).read_text() == "precious"


# -- generated stubs ----------------------------------------------------------------------------------------


def _load_gen_stubs(path: Path):
    spec = importlib.util.spec_from_file_location(f"gen_stubs_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stub_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))


def _differences(a: Path, b: Path) -> list[str]:
    names_a, names_b = set(_stub_files(a)), set(_stub_files(b))
    diff = sorted(names_a ^ names_b)
    diff += sorted(n for n in names_a & names_b if (a / n).read_bytes() != (b / n).read_bytes())
    return diff


def test_gen_stubs_check_passes():
    result = subprocess.run([sys.executable, str(REPO / "tools" / "gen_stubs.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to date" in result.stdout


def test_gen_stubs_covers_every_proto_in_specs():
    """A proto added to specs/ gets its stubs without editing the tool."""
    gen = _load_gen_stubs(REPO / "tools" / "gen_stubs.py")
    protos = sorted(p.name for p in (REPO / "specs").glob("*.proto"))
    assert gen.PROTOS == protos and "cri.proto" in protos
    for proto in protos:
        stem = proto.removesuffix(".proto")
        assert (REPO / "crust" / "api" / f"{stem}_pb2.py").is_file(), proto


def test_cri_stubs_carry_the_wire_names():
    """The CRI's package and service names are what a runtime serves."""
    from crust.api import cri_pb2

    assert cri_pb2.DESCRIPTOR.package == "runtime.v1"
    services = cri_pb2.DESCRIPTOR.services_by_name
    assert services["RuntimeService"].full_name == "runtime.v1.RuntimeService"
    assert services["ImageService"].full_name == "runtime.v1.ImageService"
    fields = {f.name: f.number for f in cri_pb2.Mount.DESCRIPTOR.fields}
    assert (fields["container_path"], fields["host_path"], fields["propagation"]) == (1, 2, 5)


def test_generated_stubs_match_specs_byte_for_byte(tmp_path):
    """Regenerate from specs/ here and compare ourselves (independent of the
    tool's own comparison): editing specs/*.proto without regenerating, or
    editing crust/api by hand, fails this test."""
    gen = _load_gen_stubs(REPO / "tools" / "gen_stubs.py")
    assert gen.SPECS == REPO / "specs" and gen.API == REPO / "crust" / "api"
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    gen.generate(fresh)
    assert {"csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py", "__init__.py"} <= set(_stub_files(fresh))
    assert _differences(fresh, REPO / "crust" / "api") == []
    # The comparison itself can see a one-byte change.
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "crust" / "api", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert _differences(fresh, copy) == []
    data = bytearray((copy / "csi_pb2.py").read_bytes())
    middle = len(data) // 2
    data[middle] = ord("A") if data[middle] != ord("A") else ord("B")
    (copy / "csi_pb2.py").write_bytes(bytes(data))
    assert _differences(fresh, copy) == ["csi_pb2.py"]


def test_gen_stubs_check_fails_on_stale_stubs(tmp_path):
    """The tool's --check, run on a copy of the repository layout, fails for
    an edited proto, an edited stub and a stray stub."""
    for d in ("tools", "specs"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    api = tmp_path / "crust" / "api"
    shutil.copytree(REPO / "crust" / "api", api, ignore=shutil.ignore_patterns("__pycache__"))
    tool = tmp_path / "tools" / "gen_stubs.py"

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=60)

    assert check().returncode == 0  # the copy is faithful

    proto = tmp_path / "specs" / "csi.proto"
    original = proto.read_text()
    edited = original.replace("message NodeGetIDResponse {", "message NodeGetIDResponse {\n  string extra = 99;", 1)
    assert edited != original
    proto.write_text(edited)
    result = check()
    assert result.returncode == 1 and "csi_pb2" in result.stdout, result.stdout + result.stderr
    proto.write_text(original)
    assert check().returncode == 0

    stub = api / "csi_pb2_grpc.py"
    good = stub.read_bytes()
    stub.write_bytes(good.replace(b"NodeGetID", b"NodeGetId", 1))
    result = check()
    assert result.returncode == 1 and "csi_pb2_grpc.py" in result.stdout
    stub.write_bytes(good)

    (api / "old_pb2.py").write_text("# left over from a removed proto\n")
    result = check()
    assert result.returncode == 1 and "old_pb2.py" in result.stdout


# -- wire facts of specs/csi.proto ---------------------------------------------------------------------------


D = csi_pb2.DESCRIPTOR


def _field(message: str, name: str):
    desc = D.message_types_by_name[message.split(".")[0]]
    for part in message.split(".")[1:]:
        desc = desc.nested_types_by_name[part]
    return desc.fields_by_name[name]


def test_package():
    assert D.package == "csi.v1"
    assert D.services_by_name["Node"].full_name == "csi.v1.Node"
    assert D.services_by_name["Controller"].full_name == "csi.v1.Controller"


def test_alpha_enum_values():
    node = csi_pb2.NodeServiceCapability.RPC.Type
    assert node.Value("DEFER_FS_OPS") == 7
    assert node.Value("DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP") == 8
    assert node.Value("DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY") == 9
    assert node.Value("GET_ID") == 10
    ctrl = csi_pb2.ControllerServiceCapability.RPC.Type
    assert ctrl.Value("GET_NODE_INFO") == 16
    enum = D.message_types_by_name["NodeServiceCapability"].nested_types_by_name["RPC"].enum_types_by_name["Type"]
    for name in ("DEFER_FS_OPS", "DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP",
                 "DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY", "GET_ID"):
        assert enum.values_by_name[name].GetOptions().Extensions[csi_pb2.alpha_enum_value]


def test_upstream_enum_values():
    node = csi_pb2.NodeServiceCapability.RPC.Type
    assert [node.Value(n) for n in ("UNKNOWN", "STAGE_UNSTAGE_VOLUME", "GET_VOLUME_STATS", "EXPAND_VOLUME",
                                    "VOLUME_CONDITION", "SINGLE_NODE_MULTI_WRITER", "VOLUME_MOUNT_GROUP")] == \
        list(range(7))
    ctrl = csi_pb2.ControllerServiceCapability.RPC.Type
    upstream = ["UNKNOWN", "CREATE_DELETE_VOLUME", "PUBLISH_UNPUBLISH_VOLUME", "LIST_VOLUMES", "GET_CAPACITY",
                "CREATE_DELETE_SNAPSHOT", "LIST_SNAPSHOTS", "CLONE_VOLUME", "PUBLISH_READONLY", "EXPAND_VOLUME",
                "LIST_VOLUMES_PUBLISHED_NODES", "VOLUME_CONDITION", "GET_VOLUME", "SINGLE_NODE_MULTI_WRITER",
                "MODIFY_VOLUME", "GET_SNAPSHOT"]
    assert [ctrl.Value(n) for n in upstream] == list(range(16))
    mode = csi_pb2.VolumeCapability.AccessMode.Mode
    assert [mode.Value(n) for n in ("UNKNOWN", "SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY",
                                    "MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER",
                                    "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER")] == list(range(8))


@pytest.mark.parametrize("message, name, number", [
    ("NodePublishVolumeRequest", "defer_fs_ops", 9),
    ("NodeUnpublishVolumeRequest", "defer_fs_ops", 3),
    ("NodeGetVolumeStatsRequest", "defer_fs_ops", 4),
    ("NodeExpandVolumeRequest", "defer_fs_ops", 7),
])
def test_defer_fs_ops_fields(message, name, number):
    field = _field(message, name)
    assert field.number == number
    assert field.type == FieldDescriptor.TYPE_BOOL
    assert field.GetOptions().Extensions[csi_pb2.alpha_field]


def test_alpha_fields_and_messages():
    group = _field("VolumeCapability.MountVolume", "volume_supplemental_group")
    policy = _field("VolumeCapability.MountVolume", "volume_supplemental_group_change_policy")
    assert (group.number, policy.number) == (4, 5)
    assert group.type == policy.type == FieldDescriptor.TYPE_STRING
    deferred = _field("NodePublishVolumeResponse", "deferred_mount")
    assert deferred.number == 1000
    assert deferred.message_type.full_name == "csi.v1.DeferredMount"
    assert deferred.GetOptions().Extensions[csi_pb2.alpha_field]
    assert _field("NodeExpandVolumeRequest", "secrets").number == 6


def test_alpha_rpcs_exist():
    node = D.services_by_name["Node"].methods_by_name["NodeGetID"]
    assert node.input_type.full_name == "csi.v1.NodeGetIDRequest"
    assert node.output_type.full_name == "csi.v1.NodeGetIDResponse"
    ctrl = D.services_by_name["Controller"].methods_by_name["ControllerGetNodeInfo"]
    assert ctrl.input_type.full_name == "csi.v1.ControllerGetNodeInfoRequest"
    assert ctrl.output_type.full_name == "csi.v1.ControllerGetNodeInfoResponse"
    # and the generated gRPC stubs carry them
    from crust.api import csi_pb2_grpc
    assert hasattr(csi_pb2_grpc.NodeServicer, "NodeGetID")
    assert hasattr(csi_pb2_grpc.ControllerServicer, "ControllerGetNodeInfo")


@pytest.mark.parametrize("message, numbers", [
    ("CreateVolumeRequest", {"name": 1, "capacity_range": 2, "volume_capabilities": 3, "parameters": 4,
                             "secrets": 5, "volume_content_source": 6, "accessibility_requirements": 7,
                             "mutable_parameters": 8}),
    ("NodeStageVolumeRequest", {"volume_id": 1, "publish_context": 2, "staging_target_path": 3,
                                "volume_capability": 4, "secrets": 5, "volume_context": 6}),
    ("NodePublishVolumeRequest", {"volume_id": 1, "publish_context": 2, "staging_target_path": 3,
                                  "target_path": 4, "volume_capability": 5, "readonly": 6, "secrets": 7,
                                  "volume_context": 8}),
    ("NodeUnpublishVolumeRequest", {"volume_id": 1, "target_path": 2}),
    ("NodeGetVolumeStatsRequest", {"volume_id": 1, "volume_path": 2, "staging_target_path": 3}),
    ("NodeExpandVolumeRequest", {"volume_id": 1, "volume_path": 2, "capacity_range": 3,
                                 "staging_target_path": 4, "volume_capability": 5, "secrets": 6}),
    ("CreateVolumeResponse", {"volume": 1}),
    ("Volume", {"capacity_bytes": 1, "volume_id": 2, "volume_context": 3, "content_source": 4,
                "accessible_topology": 5}),
    ("CapacityRange", {"required_bytes": 1, "limit_bytes": 2}),
    ("VolumeCapability", {"block": 1, "mount": 2, "access_mode": 3}),
    ("VolumeCapability.MountVolume", {"fs_type": 1, "mount_flags": 2, "volume_mount_group": 3}),
    ("CreateSnapshotRequest", {"source_volume_id": 1, "name": 2, "secrets": 3, "parameters": 4}),
    ("DeleteVolumeRequest", {"volume_id": 1, "secrets": 2}),
    ("ListVolumesRequest", {"max_entries": 1, "starting_token": 2}),
    ("NodeGetInfoResponse", {"node_id": 1, "max_volumes_per_node": 2, "accessible_topology": 3}),
])
def test_upstream_field_numbers(message, numbers):
    got = {name: _field(message, name).number for name in numbers}
    assert got == numbers


def test_upstream_services_are_complete():
    methods = {s.name: sorted(m.name for m in s.methods) for s in D.services_by_name.values()}
    assert methods["Identity"] == ["GetPluginCapabilities", "GetPluginInfo", "Probe"]
    assert methods["Node"] == sorted(["NodeStageVolume", "NodeUnstageVolume", "NodePublishVolume",
                                      "NodeUnpublishVolume", "NodeGetVolumeStats", "NodeExpandVolume",
                                      "NodeGetCapabilities", "NodeGetInfo", "NodeGetID"])
    assert {"CreateVolume", "DeleteVolume", "ControllerPublishVolume", "ControllerUnpublishVolume",
            "ValidateVolumeCapabilities", "ListVolumes", "GetCapacity", "ControllerGetCapabilities",
            "CreateSnapshot", "DeleteSnapshot", "ListSnapshots", "GetSnapshot", "ControllerExpandVolume",
            "ControllerGetVolume", "ControllerModifyVolume", "ControllerGetNodeInfo"} == set(methods["Controller"])


async def test_in_thread_outlives_a_cancelled_caller():
    # A cancelled caller goes on only once the thread has ended, and its
    # then() has run: memory matches the disk before any cleanup or retry.
    release, steps = threading.Event(), []

    def work():
        release.wait(10)
        steps.append("thread")

    waiter = asyncio.ensure_future(in_thread(work, then=lambda: steps.append("then")))
    await asyncio.sleep(0.05)
    waiter.cancel()
    await asyncio.sleep(0.05)
    waiter.cancel()  # a second cancellation does not cut the wait short either
    await asyncio.sleep(0.05)
    assert not waiter.done() and steps == []
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert steps == ["thread", "then"]
    # A failing thread skips then() and raises its own error.
    with pytest.raises(ZeroDivisionError):
        await in_thread(lambda: 1 / 0, then=lambda: steps.append("no"))
    assert await in_thread(sum, [1, 2]) == 3 and steps == ["thread", "then"]


async def test_keyed_locks_exclude_per_key_and_keep_no_key_nobody_uses():
    locks, order = KeyedLocks(), []

    async def hold(key: str, name: str, seconds: float) -> None:
        async with locks[key]:
            order.append(f"{name} in")
            await asyncio.sleep(seconds)
            order.append(f"{name} out")

    # Two users of one key take turns; another key is not held up by them.
    first = asyncio.ensure_future(hold("pod-a", "a1", 0.05))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(hold("pod-a", "a2", 0))
    other = asyncio.ensure_future(hold("pod-b", "b", 0))
    await asyncio.gather(first, second, other)
    assert order.index("a1 out") < order.index("a2 in") and order.index("b out") < order.index("a1 out")
    assert len(locks) == 0
    # A waiter cancelled before its turn leaves the lock to the holder alone,
    # then nothing at all.
    holder = asyncio.ensure_future(hold("pod-a", "h", 0.05))
    await asyncio.sleep(0)
    waiter = asyncio.ensure_future(hold("pod-a", "w", 0))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(locks) == 1
    await holder
    assert len(locks) == 0 and "w in" not in order
    # A user that fails inside lets go too.
    with pytest.raises(ZeroDivisionError):
        async with locks["pod-c"]:
            raise ZeroDivisionError
    assert len(locks) == 0


async def test_first_done_takes_its_own_task_down_with_a_cancelled_caller():
    owned = asyncio.ensure_future(asyncio.sleep(60))
    shared = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(first_done(owned, shared))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert owned.cancelled() and not shared.done()
    # Not cancelled, it returns what completed first.
    quick = asyncio.ensure_future(asyncio.sleep(0, "x"))
    assert await first_done(quick, shared) == {quick} and quick.result() == "x"
    shared.cancel()


# -- saferead --------------------------------------------------------------------------


class _Small(BaseModel):
    name: str
    size: int


def test_read_bounded_reads_a_small_regular_file(tmp_path):
    from crust.common import saferead
    (tmp_path / "f").write_bytes(b'{"name": "a", "size": 1}')
    assert saferead.read_bounded(tmp_path / "f") == b'{"name": "a", "size": 1}'
    assert saferead.read_model(_Small, tmp_path / "f") == _Small(name="a", size=1)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert saferead.read_model(_Small, "f", dir_fd=dir_fd).size == 1
    finally:
        os.close(dir_fd)
    with pytest.raises(FileNotFoundError):
        saferead.read_bounded(tmp_path / "missing")


def test_read_bounded_refuses_what_is_not_a_small_regular_file(tmp_path):
    from crust.common import saferead
    (tmp_path / "target").write_text("secret")
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would hang here
    (tmp_path / "dir").mkdir()
    with open(tmp_path / "big", "wb") as f:
        f.truncate(8 * MIB)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for name, words in (("link", "symlink"), ("fifo", "FIFO"), ("dir", "directory"), ("big", "8388608 bytes"),
                            ("sock", "not a regular file")):
            with pytest.raises(saferead.Refused) as info:
                saferead.read_bounded(tmp_path / name)
            assert words in str(info.value) and str(tmp_path / name) in str(info.value)
        with pytest.raises(saferead.Refused, match="symlink"):
            saferead.read_bounded(tmp_path / "link", 10)
        with pytest.raises(saferead.Refused, match="character device"):
            saferead.read_bounded("/dev/null")
        assert saferead.read_bounded(tmp_path / "target", 6) == b"secret"
        with pytest.raises(saferead.Refused, match="more than the 5"):
            saferead.read_bounded(tmp_path / "target", 5)
    finally:
        sock.close()


@pytest.mark.parametrize("data, words", [
    (b"", "is empty"), (b"  \n", "is empty"), (b"not json", "is not a _Small"),
    (b'{"name": "a", "si', "is not a _Small"), (b'{"name": 1, "size": "x"}', "name"),
    (b"[1, 2]", "is not a _Small"), (b"\xff\xfe", "is not a _Small"),
])
def test_read_model_refuses_what_does_not_parse(tmp_path, data, words):
    from crust.common import saferead
    (tmp_path / "f").write_bytes(data)
    with pytest.raises(saferead.Refused) as info:
        saferead.read_model(_Small, tmp_path / "f")
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)


def test_a_kvm_probe_whose_vm_breaks_its_agent_connection_is_a_definite_no(monkeypatch, tmp_path):
    """A KVM that aborts on start can show as a reset agent connection
    rather than as an exit seen first (on a busy machine): that is the probe
    VM failing, not an unexpected error."""
    from crust.kata import accel
    from crust.kata.qemu import Vm, VmConfig

    killed = []

    async def start(self, ready_timeout):
        raise ConnectionResetError(104, "Connection reset by peer")

    async def kill(self):
        killed.append(self.name)

    monkeypatch.setattr(Vm, "start", start)
    monkeypatch.setattr(Vm, "kill", kill)
    config = VmConfig(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd")
    works, reason, definite = asyncio.run(accel.probe_kvm(config, tmp_path / "probe"))
    assert (works, definite) == (False, True) and "probe VM" in reason and "reset" in reason, reason
    assert killed, "the probe VM is killed"


def test_release_under_detaches_a_loop_device_over_a_file_system_it_unmounts(tmp_path):
    """A loop device whose file lives on a file system mounted under the
    root is detached too: after the unmount sysfs would name its file from
    that file system's own root, outside the root."""
    import subprocess

    from crust.sys import loop as sysloop
    from crust.sys.sweep import release_under

    data = tmp_path / "data"
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(data)], check=True)
    device = None
    try:
        backing = data / "pools" / "vol.img"
        # The device over this file, by either of the names sysfs gives it
        # (after the unmount, from the tmpfs's own root): another test may
        # attach the same /dev/loopN once it is free.
        ours = (str(backing), "/pools/vol.img")
        backing.parent.mkdir(parents=True)
        with open(backing, "wb") as f:
            f.truncate(4 << 20)
        device = subprocess.run(["losetup", "-f", "--show", str(backing)], check=True, capture_output=True,
                                text=True).stdout.strip()
        released = release_under(tmp_path)
        assert device in released and str(data) in released
        assert sysloop.attached().get(device) not in ours, "the device went with its file system"
        assert not os.path.ismount(data)
    finally:
        if device is not None and sysloop.attached().get(device) in ours:
            subprocess.run(["losetup", "-d", device], capture_output=True)
        if os.path.ismount(data):
            subprocess.run(["umount", "-l", str(data)], capture_output=True)


def test_a_sandbox_work_directory_is_short_and_an_earlier_releases_is_kept(tmp_path):
    """CRI's 64-character ids get a hashed work directory (the VM's sockets
    must fit a unix socket path); a directory an earlier release named by
    the id itself is still the sandbox's."""
    from crust.runtime_handler.handler import WORKDIR_NAME_MAX, RuntimeHandler

    handler = RuntimeHandler.__new__(RuntimeHandler)
    handler.state_dir = tmp_path
    short, long_id, old_id = "pod-1", "a" * 64, "b" * 64
    assert handler.workdir(short) == tmp_path / "run" / short
    hashed = handler.workdir(long_id)
    assert hashed.parent == tmp_path / "run" and len(hashed.name) == WORKDIR_NAME_MAX
    assert handler.workdir(long_id) == hashed and handler.workdir("c" * 64) != hashed
    (tmp_path / "run" / old_id).mkdir(parents=True)
    assert handler.workdir(old_id) == tmp_path / "run" / old_id


@pytest.mark.parametrize("source, expected", [
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~configmap/cfg", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~secret/creds/db/password", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~projected/kube-api-access-x7k2p", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~downward-api/info/", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~empty-dir/cache", False),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~configmap", False),      # the plugin's directory
    ("/var/lib/kubelet/pods/uid-1/volume-subpaths/cfg/app/0", False),           # a subPath: never updated
    ("/var/lib/kubelet/pods/uid-1/etc-hosts", False),
    ("/srv/kubernetes.io~configmap/cfg", False),
    ("/pods/volumes/kubernetes.io~secret/x", False),
])
def test_an_atomic_writer_volume_is_known_by_kubelets_path(source, expected):
    from crust.kata.share import is_atomic_writer_volume

    assert is_atomic_writer_volume(source) is expected


@pytest.mark.parametrize("source, cached, mirrored", [
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/scratch", True, False),
    ("/var/lib/kubelet/pods/u1/volume-subpaths/config/app/0", True, False),
    ("/var/lib/kubelet/pods/u1/etc-hosts", True, False),
    ("/var/lib/kubelet/pods/u1/containers/app/1a2b", True, False),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~configmap/cfg", False, True),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~projected/kube-api-access-x", False, True),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~secret/creds/key", False, False),
    ("/srv/data", False, False),                        # a hostPath
    ("/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/9f/resolv.conf", False, False),
    ("/var/lib/kubelet/pods", False, False),
])
def test_what_the_guest_caches_and_what_its_agent_mirrors(source, cached, mirrored):
    """Only what nobody but the pod changes is cached in the guest; the
    atomic writer's volumes themselves (not a path inside one) are mirrored."""
    from crust.kata.share import cached_in_guest, is_atomic_writer_volume_root

    assert cached_in_guest(source) is cached
    assert is_atomic_writer_volume_root(source) is mirrored


def _containerd_like_spec(**linux) -> dict:
    return {"ociVersion": "1.0.2", "hostname": "web-0", "root": {"path": "rootfs", "readonly": True},
            "process": {"args": ["/app"], "env": ["A=1"], "cwd": "/", "user": {"uid": 1000, "gid": 1000},
                        "noNewPrivileges": True, "apparmorProfile": "cri-containerd.apparmor.d",
                        "capabilities": {"bounding": ["CAP_CHOWN"], "effective": ["CAP_CHOWN"]}},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                       {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/x/hosts",
                        "options": ["rbind", "ro"]},
                       {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"}],
            "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc", "path": "/proc/9/ns/ipc"},
                                     {"type": "uts", "path": "/proc/9/ns/uts"}, {"type": "mount"},
                                     {"type": "network", "path": "/var/run/netns/cni-1"}],
                      "cgroupsPath": "/kubepods/besteffort/pod1/abc", "devices": [{"path": "/dev/fuse"}],
                      "maskedPaths": ["/proc/kcore"], "readonlyPaths": ["/proc/sys"],
                      "sysctl": {"net.ipv4.ip_unprivileged_port_start": "0"},
                      "seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}, "mountLabel": "x", **linux}}


def test_a_containers_spec_for_the_guest_keeps_its_confinement_and_drops_the_hosts_paths():
    from crust.kata import guest_oci

    spec, sysctls, hostname = guest_oci.guest_spec(_containerd_like_spec(), "/run/crust/containers/c/rootfs", "c")
    assert spec["root"] == {"path": "/run/crust/containers/c/rootfs", "readonly": True}
    assert spec["mounts"][0] == {"destination": "/proc", "type": "proc", "source": "proc"}
    assert spec["process"]["noNewPrivileges"] is True and spec["process"]["user"]["uid"] == 1000
    assert "apparmorProfile" not in spec["process"]
    assert spec["process"]["capabilities"]["bounding"] == ["CAP_CHOWN"]
    # The host's mounts in its order: the kernel's and tmpfs fresh, a bind's
    # source left for the guest's path, and none run before it has one; the
    # terminals and /dev/shm containerd's default spec has, below /dev.
    assert [m["destination"] for m in spec["mounts"]] == ["/proc", "/dev", "/dev/shm", "/dev/pts", "/etc/hosts",
                                                         "/sys/fs/cgroup"]
    assert spec["mounts"][3]["type"] == "devpts" and spec["mounts"][2]["type"] == "tmpfs"
    assert spec["mounts"][4] == {"destination": "/etc/hosts", "type": "bind", "source": "", "options": ["bind"]}
    bare, _, _ = guest_oci.guest_spec({"process": {"args": ["/x"]}}, "/r", "c")
    assert [m["destination"] for m in bare["mounts"]] == ["/dev", "/dev/shm", "/dev/pts", "/proc"]
    # A new namespace stays; the pod's (a path) is the guest's own; no new network.
    assert spec["linux"]["namespaces"] == [{"type": "pid"}, {"type": "mount"}]
    # crun's cgroup below one the agent keeps until the container is deleted (its OOM count).
    assert spec["linux"]["cgroupsPath"] == "/crust/c/ctr"
    assert spec["linux"]["maskedPaths"] == ["/proc/kcore"] and spec["linux"]["readonlyPaths"] == ["/proc/sys"]
    assert spec["linux"]["seccomp"] == {"defaultAction": "SCMP_ACT_ERRNO"}
    assert "devices" not in spec["linux"] and "mountLabel" not in spec["linux"] and "sysctl" not in spec["linux"]
    # The pod's settings go to the guest: its UTS namespace is the pod's.
    assert sysctls == {"net.ipv4.ip_unprivileged_port_start": "0"} and hostname == "web-0"
    assert "hostname" not in spec
    process = guest_oci.exec_process(spec["process"], ["id"], ["B=2"], "/tmp", 5, 6, None)
    assert process["args"] == ["id"] and process["user"] == {"uid": 5, "gid": 6} and process["noNewPrivileges"]
    assert spec["process"]["args"] == ["/app"]   # the container's own untouched


def test_a_process_on_a_terminal_keeps_it_for_crun_and_an_exec_sizes_its_own():
    from crust.kata import guest_oci

    host = _containerd_like_spec()
    host["process"].update(terminal=True, consoleSize={"width": 100, "height": 30})
    spec, _, _ = guest_oci.guest_spec(host, "/r", "c")
    # crun makes the terminal in the container's devpts, of the spec's size.
    assert spec["process"]["terminal"] is True and spec["process"]["consoleSize"] == {"width": 100, "height": 30}
    process = guest_oci.exec_process(spec["process"], ["sh"], [], "/", 0, 0, terminal=True)
    assert process["terminal"] is True and "consoleSize" not in process


def test_cgroup_numbers_become_containerds_cgroup_v2_metrics():
    from crust.containerd_shim.task import CGROUP_V2_METRICS_TYPE, cgroup_metrics
    from crust.api import handler_pb2

    response = handler_pb2.ContainerStatsResponse(
        cpu={"usage_usec": 1500, "user_usec": 1000, "system_usec": 500, "new_key": 7},
        memory={"anon": 4096, "inactive_file": 8192}, memory_current=65536, memory_max=0,
        memory_events={"oom_kill": 1, "max": 3}, pids_current=2, pids_max=100, timestamp_ns=1)
    metrics = cgroup_metrics(response)
    assert (metrics.cpu.usage_usec, metrics.cpu.user_usec, metrics.cpu.system_usec) == (1500, 1000, 500)
    assert (metrics.memory.usage, metrics.memory.anon, metrics.memory.inactive_file) == (65536, 4096, 8192)
    assert (metrics.pids.current, metrics.pids.limit, metrics.memory_events.oom_kill) == (2, 100, 1)
    assert CGROUP_V2_METRICS_TYPE == metrics.DESCRIPTOR.full_name


def test_a_shared_pid_namespace_is_the_pods_in_the_guest():
    from crust.kata import guest_oci

    shared = _containerd_like_spec(namespaces=[{"type": "pid", "path": "/proc/9/ns/pid"}, {"type": "mount"}])
    assert guest_oci.needs_pod_pid_namespace(shared)
    assert not guest_oci.needs_pod_pid_namespace(_containerd_like_spec())
    # The guest's agent adds the pod's namespace's path (CreateContainer's
    # pod_pid_namespace): the spec names none, and no namespace of the host.
    spec, _, _ = guest_oci.guest_spec(shared, "/r", "c")
    assert [ns for ns in spec["linux"]["namespaces"] if ns["type"] == "pid"] == []


def test_the_guest_spec_states_its_own_version_whatever_1x_the_host_wrote():
    """CRI-O writes 1.3.0; the guest's crun takes only 1.0 specs, and the
    guest's spec is guest_oci's own."""
    from crust.kata import guest_oci

    for version in ("1.0.2-dev", "1.3.0"):
        spec, _, _ = guest_oci.guest_spec({**_containerd_like_spec(), "ociVersion": version}, "/r", "c")
        assert spec["ociVersion"] == guest_oci.GUEST_OCI_VERSION == "1.0.2"


@pytest.mark.parametrize("change, field", [
    ({"linux": {"uidMappings": [{"containerID": 0, "hostID": 1000, "size": 1}]}}, "linux.uidMappings"),
    ({"linux": {"namespaces": [{"type": "user"}, {"type": "pid"}]}}, "linux.namespaces"),
    ({"hooks": {"prestart": [{"path": "/bin/true"}]}}, "hooks"),
    ({"linux": {"namespaces": [{"type": "pid"}], "sysctl": {"net.core/../x": "1"}}}, "linux.sysctl"),
    ({"hostname": "a b"}, "hostname"),
    ({"ociVersion": "2.0.0"}, "ociVersion"),
])
def test_what_the_guest_cannot_honour_is_refused_naming_the_field(change, field):
    from crust.common.errors import InvalidArgument
    from crust.kata import guest_oci

    spec = {**_containerd_like_spec(), **change}
    with pytest.raises(InvalidArgument) as refused:
        guest_oci.guest_spec(spec, "/r", "c")
    assert str(refused.value.message if hasattr(refused.value, "message") else refused.value).startswith(field)


# -- kata.bzimage -------------------------------------------------------------------------------


def _elf_with_notes(notes: list[tuple[bytes, int, bytes]], machine: int = 62) -> bytes:
    """A 64-bit little-endian ELF header, one PT_NOTE program header and the notes."""
    body = b""
    for name, kind, desc in notes:
        name += b"\0"
        body += struct.pack("<III", len(name), len(desc), kind)
        body += name.ljust((len(name) + 3) & ~3, b"\0") + desc.ljust((len(desc) + 3) & ~3, b"\0")
    header = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, 64, 0, 0, 64,
                                                                 56, 1, 64, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", bzimage.PT_NOTE, 4, 64 + 56, 0, 0, len(body), len(body), 4)
    return header + phdr + body


def _bzimage(kernel: bytes, compress=gzip.compress, setup_sects: int = 4, version: int = 0x20f,
             size: int | None = None) -> bytes:
    """A bzImage shaped as Linux's boot protocol says: setup sectors, then the
    protected-mode part with the payload (and its uncompressed size) in it."""
    compressed = compress(kernel) + struct.pack("<I", len(kernel) if size is None else size)
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1f1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    decompressor = b"\x90" * 300   # what the payload's offset skips
    struct.pack_into("<II", setup, 0x248, len(decompressor), len(compressed))
    return bytes(setup) + decompressor + compressed + b"\0" * 64


PVH_NOTE = (b"Xen", bzimage.XEN_ELFNOTE_PHYS32_ENTRY, (0x1000850).to_bytes(4, "little"))


@pytest.mark.parametrize("compress", [gzip.compress, lambda b: lzma.compress(b, format=lzma.FORMAT_XZ)],
                         ids=["gzip", "xz"])
def test_bzimage_gives_the_kernel_with_its_pvh_entry(compress):
    kernel = _elf_with_notes([(b"Xen", 6, b"linux\0"), (b"GNU", 3, b"x" * 20), PVH_NOTE])
    assert bzimage.vmlinux(_bzimage(kernel, compress)) == kernel
    assert bzimage.pvh_entry(kernel) == 0x1000850
    assert kata_image.boot_kernel(_bzimage(kernel, compress))[:2] == ("vmlinux", kernel)


@pytest.mark.parametrize("image, why", [
    (b"MZ" + b"\0" * 2000, "not a bzImage"),
    (_bzimage(b"x", version=0x207), "boot protocol 2.7 names no payload"),
    (_bzimage(_elf_with_notes([(b"Xen", 6, b"linux\0")])), "no PVH entry point"),
    (_bzimage(_elf_with_notes([PVH_NOTE]), size=12), "the image says 12"),
    (_bzimage(_elf_with_notes([PVH_NOTE], machine=183)), "not an x86-64 kernel"),
    (_bzimage(b"plain bytes, not ELF"), "not a 64-bit little-endian ELF"),
    (_bzimage(b"k", compress=lambda b: b"\x89LZO" + b), "unknown format (magic 894c5a4f6b"),
    (_bzimage(b"k", compress=lambda b: b"\x1f\x8b\x08\x00" + b"\xff" * 40), "the payload does not decompress"),
    (_bzimage(_elf_with_notes([PVH_NOTE])[:70]), "cut short"),
], ids=["no-header", "old-protocol", "no-pvh-note", "wrong-size", "not-x86-64", "not-elf", "unknown-compression",
        "corrupt-payload", "cut-short-elf"])
def test_bzimage_says_why_a_kernel_cannot_be_booted_directly_and_the_bzimage_is_booted(image, why):
    with pytest.raises(bzimage.NotBootable, match=re.escape(why)):
        bzimage.vmlinux(image)
    name, kernel, reason = kata_image.boot_kernel(image)
    assert (name, kernel) == ("vmlinuz", image) and reason.startswith("bzImage: ") and why in reason


def test_a_pods_uid_comes_from_containerds_annotations_and_its_volumes_from_the_index():
    from crust.contract.mountinfo import MountInfo, digest
    from crust.kata.pods import pod_uid
    from crust.runtime_handler.resolve import pod_volumes

    uid = "0c6d8a2e-5b8f-4e0c-9d3a-1f2e3d4c5b6a"
    assert pod_uid({"annotations": {"io.kubernetes.cri.sandbox-uid": uid}}) == uid
    # containerd before the uid annotation: the log directory's last part.
    assert pod_uid({"annotations": {"io.kubernetes.cri.sandbox-log-directory":
                                    f"/var/log/pods/my_ns_web_{uid}/"}}) == uid
    for spec in ({}, {"annotations": {}}, {"annotations": {"io.kubernetes.cri.sandbox-uid": "../x/y"}},
                 {"annotations": {"io.kubernetes.cri.sandbox-log-directory": "/var/log/pods/nouid"}}):
        assert pod_uid(spec) == "", spec

    def target(pod: str, pv: str, leaf: str = "mount") -> str:
        return f"/var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~csi/{pv}/{leaf}"

    class Index:   # the one method pod_volumes asks
        def __init__(self, paths):
            self.entries = {digest(p): MountInfo(device="/dev/null", fstype="ext4", target_path=p) for p in paths}

        def items(self):
            return list(self.entries.items())

    ours = [target(uid, "pv-b"), target(uid, "pv-a")]
    index = Index(ours + [target("another-pod", "pv-c"), target(uid, "pv-d", "elsewhere"),
                          f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/pv-e/mount",
                          f"/var/lib/kubelet/pods/{uid}/volume-subpaths/pv-f/c/0",
                          f"/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/{uid}/mount"])
    found = pod_volumes(uid, index)
    assert [r.info.target_path for r in found] == sorted(ours)
    assert all(r.digest == digest(r.info.target_path) and r.subpath == "" for r in found)
    assert pod_volumes("another-pod", index)[0].info.target_path == target("another-pod", "pv-c")
    assert pod_volumes("nobody", index) == []


def test_mount_points_are_made_inside_the_root_whatever_links_the_image_holds(tmp_path):
    from crust.common.inroot import make_mount_point

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "run").mkdir()
    os.symlink("/run/crust", root / "data")            # absolute, dangling: resolved from the root
    os.symlink("../../../outside", root / "run" / "up")   # .. stops at the root
    os.symlink("loop", root / "loop")
    (root / "file").write_text("x")
    make_mount_point(str(root), "/data/out", "dir")
    assert (root / "run" / "crust" / "out").is_dir() and not (tmp_path / "run").exists()
    make_mount_point(str(root), "/run/up/hosts", "file")
    assert (root / "outside" / "hosts").is_file() and list(outside.iterdir()) == []
    make_mount_point(str(root), "/a/b/c", "parents")
    assert (root / "a" / "b").is_dir() and not (root / "a" / "b" / "c").exists()
    make_mount_point(str(root), "/data/out", "dir")   # again: nothing to make
    make_mount_point(str(root), "/", "dir")
    with pytest.raises(OSError) as too_many:
        make_mount_point(str(root), "/loop/x", "dir")
    assert too_many.value.errno == errno.ELOOP
    with pytest.raises(OSError) as not_dir:
        make_mount_point(str(root), "/file/x", "dir")
    assert not_dir.value.errno == errno.ENOTDIR
    with pytest.raises(ValueError):
        make_mount_point(str(root), "/x", "socket")


def test_shim_reads_the_runtime_options_as_protobuf_does(tmp_path):
    """`start` decodes containerd's runtime options (an Any around Options)
    without the protobuf library: the same fields as protobuf's parser,
    unknown fields of every wire type skipped, a broken message refused."""
    from google.protobuf import any_pb2

    from crust.api import containerd_runtimeoptions_pb2 as runtimeoptions
    from crust.containerd_shim.main import handler_endpoint, message_strings

    settings = tmp_path / "shim.toml"
    settings.write_text('handler_endpoint = "unix:///run/elsewhere.sock"\n')
    inner = runtimeoptions.Options(type_url="x", config_path=str(settings)).SerializeToString()
    wrapped = any_pb2.Any(type_url="runtimeoptions.v1.Options", value=inner).SerializeToString()
    assert message_strings(wrapped) == {1: b"runtimeoptions.v1.Options", 2: inner}
    assert message_strings(inner) == {1: b"x", 2: str(settings).encode()}
    assert handler_endpoint(wrapped) == "unix:///run/elsewhere.sock"
    # Fields protobuf would skip (a varint, a fixed64, a fixed32 of numbers
    # it does not know) and a string given twice (the last one counts).
    unknown = bytes([0x18, 0x96, 0x01, 0x21, *b"\0" * 8, 0x2D, *b"\0" * 4])
    twice = runtimeoptions.Options(config_path="/first").SerializeToString() + inner
    parsed = runtimeoptions.Options()
    parsed.ParseFromString(unknown + twice)
    assert message_strings(unknown + twice)[2].decode() == parsed.config_path == str(settings)
    long_value = "a" * 300   # a two-byte length
    assert message_strings(runtimeoptions.Options(config_path=long_value).SerializeToString()) == \
        {2: long_value.encode()}
    for broken in (b"\x12\x05ab", b"\x12", b"\x80", b"\x0b", b"\x00\x01", b"\x21\x00"):
        with pytest.raises(ValueError):
            message_strings(broken)
    # Options of another type, or none: the environment's endpoint, then the default.
    other = any_pb2.Any(type_url="other.Options", value=inner).SerializeToString()
    assert handler_endpoint(other) == handler_endpoint(b"") == handler_endpoint(b"\x12\x05ab")


def test_every_file_the_guest_image_takes_is_packaged():
    """The image builder reads its guest files from the installed package
    (`crust kata image` in the container image): each must match the
    package data pyproject.toml declares."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())[
        "tool"]["setuptools"]["package-data"]["crust.kata"]
    for name in (*kata_image.GUEST_FILES.values(), *kata_image.GUEST_PROGRAMS.values()):
        assert any(fnmatch.fnmatch(f"guest/{name}", p) for p in patterns), (name, patterns)


def test_a_vm_on_the_scsi_bus_boots_with_its_controller_and_says_so_to_the_guest(tmp_path):
    """virtio-scsi: one controller on QEMU's command line, and the guest's
    kernel told to load its SCSI modules and scan nothing at boot;
    virtio-blk (the default): neither. An unknown bus is refused."""
    from crust.kata.qemu import Vm, VmConfig

    def vm(**settings) -> Vm:
        return Vm("crust-units", tmp_path / "vm", VmConfig(kernel=tmp_path / "k", initrd=tmp_path / "i", **settings))

    scsi, blk = vm(disk_bus="virtio-scsi"), vm()
    argv = scsi.argv()
    assert argv[argv.index("virtio-scsi-pci,id=scsi0") - 1] == "-device"
    append = argv[argv.index("-append") + 1].split()
    assert "crust.disks=scsi" in append and "scsi_mod.scan=none" in append and "console=ttyS0" in append
    plain = blk.argv()
    assert "virtio-scsi-pci,id=scsi0" not in plain
    assert not any("scsi" in word for word in plain[plain.index("-append") + 1].split())
    with pytest.raises(ValueError, match="disk bus 'ide'"):
        vm(disk_bus="ide")


def test_a_handler_without_a_template_removes_only_what_a_template_left(tmp_path):
    """remove_saved: the saved state, its record, a build's leftovers and
    the directory go; a file that is no template's stays, and with it the
    directory. Nothing there: nothing done."""
    from crust.kata.template import BUILD_DIR, RECORD_FILE, STATE_FILE, remove_saved

    directory = tmp_path / "template"
    assert remove_saved(directory) == [] and not directory.exists()
    (directory / BUILD_DIR).mkdir(parents=True)
    (directory / BUILD_DIR / "console.log").write_text("a build's\n")
    template_files = [STATE_FILE, STATE_FILE + ".ram", RECORD_FILE, STATE_FILE + ".partial",
                      STATE_FILE + ".partial.ram"]
    for name in template_files:
        (directory / name).write_bytes(b"x")
    (directory / "notes.txt").write_text("an operator's\n")
    assert sorted(remove_saved(directory)) == sorted(template_files)
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]
    (directory / "notes.txt").unlink()
    (directory / STATE_FILE).write_bytes(b"x")
    assert remove_saved(directory) == [STATE_FILE] and not directory.exists()


@pytest.mark.parametrize("namespaces, expected", [
    # containerd's CRI plugin: the pod's network, ipc and uts, by its sandbox process.
    ([{"type": "pid"}, {"type": "ipc", "path": "/proc/4242/ns/ipc"}, {"type": "uts", "path": "/proc/4242/ns/uts"},
      {"type": "mount"}, {"type": "network", "path": "/proc/4242/ns/net"}], 4242),
    ([{"type": "ipc", "path": "/proc/4242/ns/ipc"}], 4242),
    # Two processes named: neither is certainly the pod's.
    ([{"type": "ipc", "path": "/proc/4242/ns/ipc"}, {"type": "uts", "path": "/proc/4343/ns/uts"}], 0),
    # The node's init, pinned namespaces (CRI-O), the host's namespaces, other paths.
    ([{"type": "ipc", "path": "/proc/1/ns/ipc"}], 0),
    ([{"type": "ipc", "path": "/var/run/ipcns/0d8f"}, {"type": "network", "path": "/var/run/netns/cni-1"}], 0),
    ([{"type": "pid"}, {"type": "mount"}], 0),
    ([{"type": "ipc", "path": "/proc/self/ns/ipc"}, {"type": "ipc", "path": "/proc/042/ns/ipc"}], 0),
    ([{"type": "ipc", "path": "/proc/4242/ns/mnt"}, {"type": "ipc", "path": "/proc/4242/ns/ipc/"}], 0),
    # What a hostile or broken spec may hold instead.
    ("namespaces", 0), ([7, None, {"path": 5}, {"type": "ipc", "path": ["/proc/4242/ns/ipc"]}], 0),
])
def test_the_pods_sandbox_process_is_read_from_the_namespaces_a_container_joins(namespaces, expected):
    from crust.runtime_handler.containers import pod_process
    assert pod_process({"linux": {"namespaces": namespaces}}) == expected
    assert pod_process({}) == pod_process({"linux": "x"}) == 0


def test_the_guest_agents_refusal_of_a_bind_is_said_as_the_pods_spec_says_the_mount():
    from crust.common.errors import FailedPrecondition, InvalidArgument
    from crust.kata.mount_plan import in_pod_terms

    names = ["mount /config: /var/lib/kubelet/pods/u/volumes/cm", "mount /mnt: subPath 's' of the emptyDir shared"]
    told = in_pod_terms(InvalidArgument("container c1: the guest's agent: binds[1].source.subpath: subpath s: "
                                        "resolves outside its volume"), names)
    missing = in_pod_terms(FailedPrecondition("container c1: the guest's agent: binds[0].source.share.path: "
                                              "config in the share crust: No such file or directory"), names)
    other = FailedPrecondition("container c1: the guest's agent: oci_spec: the OCI runtime refused it: x")
    beyond = InvalidArgument("binds[5].source.subpath: subpath q: resolves outside its volume")
    assert (type(told), told.message) == (InvalidArgument, "mount /mnt: subPath 's' of the emptyDir shared: "
                                                            "resolves outside its volume")
    assert (type(missing), missing.message) == (FailedPrecondition, "mount /config: /var/lib/kubelet/pods/u/"
                                                                    "volumes/cm: config in the share crust: No "
                                                                    "such file or directory")
    assert in_pod_terms(other, names) is other and in_pod_terms(beyond, names) is beyond


def test_a_delete_while_the_reaper_tears_a_dead_sandbox_down_waits_for_it(tmp_path):
    """The reaper's own teardown of a dead sandbox is housekeeping: a
    DeleteSandbox (or a pod's DeleteContainer) that comes meanwhile waits
    for it and succeeds, instead of being told ABORTED."""
    from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord

    class Registration:
        on_register = None

    class DeadSandbox:
        def __init__(self) -> None:
            self.stopping, self.release = asyncio.Event(), asyncio.Event()
            self.stops = 0

        def alive(self) -> bool:
            return False

        async def stop_process(self) -> None:
            self.stopping.set()
            await self.release.wait()

        async def stop(self) -> None:
            self.stops += 1

    async def scenario() -> None:
        handler = RuntimeHandler(name="h", volumes_dir=tmp_path / "volumes", state_dir=tmp_path / "state",
                                 registration=Registration(), make_sandbox=None)
        sandbox, record = DeadSandbox(), SandboxRecord(sandbox_id="pod-1", bundle="")
        handler.sandboxes["pod-1"] = (sandbox, record)
        await handler.records.put("pod-1", record)
        reaper = asyncio.create_task(handler.reap_once())
        await asyncio.wait_for(sandbox.stopping.wait(), 5)
        deleting = asyncio.create_task(handler.delete_sandbox("pod-1"))
        await asyncio.sleep(0.05)
        assert not deleting.done(), "the delete did not wait for the reaper's teardown"
        sandbox.release.set()
        await asyncio.wait_for(asyncio.gather(reaper, deleting), 5)
        assert handler.sandboxes == {} and sandbox.stops == 1
        assert [key for key, _ in handler.records.load_all()] == []

    asyncio.run(scenario())


def test_a_vms_port_keeps_the_first_reason_it_was_lost_for():
    """A VM killed because its file server died is then seen to exit: the
    pod's record must name the file server, not the exit that followed."""
    from crust.kata.port_agent import PortAgent

    async def scenario() -> PortAgent:
        port = PortAgent("/nonexistent/port.sock", qmp=None, vm_name="vm")
        await port.close()
        assert port.dead == ""
        await port.close("its virtiofsd (virtiofsd, cache=auto) was killed by signal 9")
        await port.close("QEMU exited with code -9")
        assert await port.ready(wait=1.0) is None   # gone: nothing is opened any more
        return port

    assert asyncio.run(scenario()).dead == "its virtiofsd (virtiofsd, cache=auto) was killed by signal 9"
