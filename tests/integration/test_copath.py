"""crust.common.copath (reaching CO paths) and crust.common.limits (the
generic request bounds), on real directories, links and mounts."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from crust.api import csi_pb2, runtime_pb2
from crust.common import copath, limits
from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.sys import mount as sysmount
from tests.harness import loops
from tests.harness.daemons import device_held


@pytest.fixture
def tree():
    root = Path(tempfile.mkdtemp(prefix="crust-cp-"))
    outside = Path(tempfile.mkdtemp(prefix="crust-cp-out-"))
    left: list[str] = []
    try:
        yield root, outside
    finally:
        try:
            for base in (root, outside):
                # A loop device a test left attached is a leak (named, and
                # released first: it may be what keeps a mount below busy);
                # the mounts below are the fixture's to undo.
                left += loops.release_all_under(base)
                for m in sorted(sysmount.mounts(), key=lambda m: -len(m.mount_point)):
                    if (m.mount_point + "/").startswith(str(base) + "/"):
                        sysmount.unmount_all(m.mount_point)
        finally:
            for base in (root, outside):
                shutil.rmtree(base, ignore_errors=True)
    assert left == [], "loop devices the test left attached"


def refused(fn, *args, **kw) -> str:
    with pytest.raises(InvalidArgument) as info:
        fn(*args, **kw)
    return info.value.message


def test_a_symlink_anywhere_on_the_way_is_refused_naming_the_field(tree):
    root, outside = tree
    (root / "a").mkdir()
    (root / "a" / "link").symlink_to(outside)
    (root / "a" / "last").symlink_to(outside)
    message = refused(copath.reach, str(root / "a" / "link" / "x"), "target_path")
    assert "target_path" in message and "symlink" in message and str(root / "a" / "link") in message
    with copath.reach(str(root / "a" / "last"), "target_path") as at:
        assert "symlink" in refused(at.refuse_symlink)
        assert "symlink" in refused(at.mkdir)
        assert "symlink" in refused(at.remove)
    # Creating parents never goes through a link either, and makes nothing outside.
    refused(copath.reach, str(root / "a" / "link" / "new" / "t"), "target_path", create_parents=True)
    assert list(outside.iterdir()) == []


def test_text_checks_come_first(tree):
    root, _ = tree
    assert "component" in refused(copath.reach, str(root / ("x" * 256)), "staging_target_path")
    assert "4096" in refused(copath.reach, "/" + "/".join(["d" * 200] * 21), "target_path")
    assert "NUL" in refused(copath.reach, str(root / "a\x00b"), "target_path")
    assert "normalised" in refused(copath.reach, str(root) + "/a/../b", "target_path")


def test_make_remove_and_missing_parents(tree):
    root, _ = tree
    with copath.reach(str(root / "p" / "q" / "t"), "target_path") as at:
        assert at.parent_fd is None and at.lstat() is None
        at.remove()  # absent: fine
        at.ensure_parents()
        assert at.mkdir() is True and at.mkdir() is False
        assert (root / "p" / "q" / "t").is_dir()
        at.remove()
        assert at.make_file() is True and (root / "p" / "q" / "t").is_file()
        with pytest.raises(FailedPrecondition):
            at.mkdir()  # a file is there
        at.remove()
        assert not (root / "p" / "q" / "t").exists()


def test_a_read_only_bind_is_read_only_and_found_by_mount_id(tree):
    root, _ = tree
    (root / "src").mkdir()
    (root / "src" / "f").write_text("x")
    with copath.reach(str(root / "src"), "staging_target_path") as src, \
            copath.reach(str(root / "dst"), "target_path") as dst:
        dst.mkdir()
        assert dst.mount_entry() is None
        dst.bind_from(src, readonly=True)
        entry = dst.mount_entry()
        assert entry is not None and entry.mount_point == str(root / "dst") and entry.readonly
        assert sysmount.at(str(root / "dst")) == entry
        with pytest.raises(OSError) as info:
            (root / "dst" / "g").write_text("y")
        assert info.value.errno == errno.EROFS
        assert (root / "dst" / "f").read_text() == "x"
        with pytest.raises(FailedPrecondition):
            dst.remove()  # still a mount point
        assert dst.unmount_all() == 1 and dst.unmount_all() == 0
        assert sysmount.at(str(root / "dst")) is None
        dst.remove()


def test_the_entry_of_one_mount_is_its_mount_table_line(tree):
    """entry_of() asks the kernel about one mount (statmount) instead of
    reading the table; what it answers must be what the table says, for
    odd names, options, read-only binds and stacked mounts alike."""
    root, _ = tree
    odd = root / "a b\\134c"
    for path in (root / "plain", odd, root / "ro", root / "stacked"):
        path.mkdir()
    made = [
        (root / "plain", "tmpfs", ["size=1m", "mode=0700", "noexec", "nosuid"]),
        (odd, "tmpfs", ["size=2m"]),
        (root / "stacked", "tmpfs", ["size=1m"]),
        (root / "stacked", "tmpfs", ["ro", "size=3m", "noatime"]),
    ]
    for path, fs_type, options in made:
        fd = os.open(path, os.O_PATH)
        try:
            asyncio.run(sysmount.mount_fd("src with space", fd, fs_type, options))
        finally:
            os.close(fd)
    with copath.reach(str(root / "plain"), "staging_target_path") as src, \
            copath.reach(str(root / "ro"), "target_path") as dst:
        dst.bind_from(src, readonly=True)
    answered_in_place = 0
    for path in (root / "plain", odd, root / "ro", root / "stacked"):
        fd = os.open(path, os.O_PATH)
        try:
            from_table = sysmount.by_id(sysmount.mount_id(fd))
            assert sysmount.entry_of(fd) == from_table
            ids = sysmount._statx_mount_ids(fd)
            if ids is not None and ids[1] is not None and sysmount._statmount(ids[1]) == from_table:
                answered_in_place += 1
        finally:
            os.close(fd)
    assert sysmount.entry_of(os.open(root / "stacked", os.O_PATH)).super_options[0] == "ro"
    if os.uname().release.split(".")[:2] >= ["6", "15"]:  # statmount with the source string
        assert answered_in_place == 4


def test_a_file_system_read_ahead_is_mounted_nowhere_and_shared_by_the_next_mount(tree):
    """open_filesystem: the device's file system in a super block, mounted
    in no table; a mount of the device meanwhile shares it (its options
    must agree on read-only, which is why the caller passes the options the
    mount will use); closing the descriptor lets go of it, and of the file
    system once nothing else holds it. A bad option is an error naming it."""
    root, _ = tree
    image = root / "disk.img"
    with open(image, "wb") as f:
        f.truncate(320 << 20)
    subprocess.run(["mkfs.xfs", "-q", str(image)], check=True)
    mnt = root / "mnt"
    mnt.mkdir()
    # Released however the test ends: its mounts (of the device) first.
    with loops.attached(image) as device:
        held = sysmount.open_filesystem(device, "xfs", ["rw", "nouuid", "noatime"])
        try:
            assert device_held(device)
            assert sysmount.of_device_node(device) == [] and device not in Path("/proc/self/mountinfo").read_text()
            sysmount.mount_path(device, str(mnt), "xfs", ["rw", "nouuid"])
            (mnt / "file").write_bytes(b"written")
        finally:
            os.close(held)
        assert (mnt / "file").read_bytes() == b"written", "closing the read-ahead unmounted the mount's file system"
        assert device_held(device)
        sysmount.unmount_all(str(mnt))
        assert not device_held(device)

        readonly = sysmount.open_filesystem(device, "xfs", ["ro", "nouuid"])
        try:
            with pytest.raises(OSError) as refused:
                sysmount.mount_path(device, str(mnt), "xfs", ["rw", "nouuid"])
            assert refused.value.errno == errno.EBUSY
            sysmount.mount_path(device, str(mnt), "xfs", ["ro", "nouuid"])
            assert (mnt / "file").read_bytes() == b"written"
            sysmount.unmount_all(str(mnt))
        finally:
            os.close(readonly)
        assert not device_held(device)

        with pytest.raises(OSError) as bad:
            sysmount.open_filesystem(device, "xfs", ["rw", "no_such_option=1"])
        assert "no_such_option" in str(bad.value) and device in str(bad.value)
        assert not device_held(device)


def test_a_directory_moved_between_the_walk_and_the_mount_gets_no_mount(tree):
    root, outside = tree
    (root / "pod").mkdir()
    at = copath.reach(str(root / "pod" / "mount"), "target_path")
    try:
        at.mkdir()
        # Someone renames the walked directory away and plants a link.
        os.rename(root / "pod", root / "pod.moved")
        (root / "pod").symlink_to(outside)
        message = refused(asyncio.run, at.mount("crust-test", "tmpfs", ["size=4k"]))
        assert "moved" in message and "undone" in message
    finally:
        at.close()
    assert sysmount.at(str(root / "pod.moved" / "mount")) is None
    assert sysmount.at(str(outside / "mount")) is None and list(outside.iterdir()) == []


def test_limits_name_the_field():
    cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume())
    cap.access_mode.mode = 99
    request = csi_pb2.CreateVolumeRequest(name="v", volume_capabilities=[cap])
    assert "volume_capabilities[0].access_mode.mode is 99" in refused(limits.check, request)
    assert "NUL" in refused(limits.check, csi_pb2.NodeUnpublishVolumeRequest(volume_id="a\x00"))
    assert "volume_id" in refused(limits.check, csi_pb2.NodeUnpublishVolumeRequest(volume_id="v" * 4097))
    many = csi_pb2.CreateVolumeRequest(name="v", parameters={f"k{i}": "v" for i in range(257)})
    assert "parameters has 257 entries" in refused(limits.check, many)
    big = csi_pb2.CreateVolumeRequest(name="v", parameters={f"k{i}": "v" * 4000 for i in range(17)})
    assert "parameters holds" in refused(limits.check, big)
    repeated = csi_pb2.CreateVolumeRequest(name="v", volume_capabilities=[csi_pb2.VolumeCapability()] * 257)
    assert "volume_capabilities has 257" in refused(limits.check, repeated)
    bad_type = runtime_pb2.RuntimeStageVolumeRequest()
    bad_type.volume_type = 42
    assert "volume_type is 42" in refused(limits.check, bad_type)
    # Secrets are opaque: forwarded as they are, NUL and a long certificate included.
    limits.check(csi_pb2.NodeStageVolumeRequest(secrets={"cert": "a\x00" + "b" * 10000}))
    limits.check(csi_pb2.CreateVolumeRequest(name="v", volume_capabilities=[csi_pb2.VolumeCapability()]))


def test_a_process_takes_what_the_kernel_takes():
    """A process's args and env are bounded as execve bounds them (128 KiB a
    string, 2 MiB in all), not by the bounds of other fields."""
    from crust.api import handler_pb2

    links = [f"SVC_{n}_SERVICE_HOST=10.96.0.{n % 256}" for n in range(280)]
    script = "echo " + "x" * 5120
    limits.check(handler_pb2.StartProcessRequest(container_id="c", exec_id="e", process=handler_pb2.ProcessSpec(
        args=["/bin/sh", "-c", script], env=links + ["BIG=" + "v" * (limits.MAX_ARG_STRING - 4)])))
    too_long = handler_pb2.ProcessSpec(args=["a" * (limits.MAX_ARG_STRING + 1)])
    assert "process.args[0] is 131072 bytes" in refused(
        limits.check, handler_pb2.StartProcessRequest(container_id="c", exec_id="e", process=too_long))
    too_much = handler_pb2.ProcessSpec(args=["sh"], env=[f"V{n}=" + "v" * 100000 for n in range(25)])
    assert "process.args and process.env hold" in refused(
        limits.check, handler_pb2.StartProcessRequest(container_id="c", exec_id="e", process=too_much))
    assert "NUL" in refused(limits.check, handler_pb2.ProcessSpec(env=["A=\x00"]))
    # The other fields of the message keep their bounds.
    assert "cwd is" in refused(limits.check, handler_pb2.ProcessSpec(cwd="/" * 5000))
