"""The tests' own loop devices (tests.harness.loops): a device that cannot
be let go at the end of a test fails it naming what holds it, on real
devices held as a leak holds them, instead of staying attached."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from crust.sys import loop as sysloop
from tests.harness import loops
from tests.harness.daemons import wait_until


@pytest.fixture
def image():
    base = Path(tempfile.mkdtemp(prefix="crust-lr-"))
    path = base / "disk.img"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(path)], check=True, capture_output=True)
    try:
        yield path
    finally:
        left = loops.release_all_under(base)
        shutil.rmtree(base, ignore_errors=True)
        assert left == []


def test_a_device_held_open_is_named_and_goes_once_let_go(image):
    device = sysloop.attach_sync(image)
    holder = os.open(device, os.O_RDONLY)
    try:
        with pytest.raises(AssertionError) as held:
            loops.release(device, image, timeout=0.5)
        assert f"pid {os.getpid()}" in str(held.value) and "has it open" in str(held.value), held.value
        assert sysloop.serves(device, image)   # detached at its last close only
    finally:
        os.close(holder)
    wait_until(lambda: not sysloop.serves(device, image), what="the device to go at its last close")


def test_a_mount_in_another_namespace_is_named(image):
    """As a daemon or container another test starts holds a copy of a
    mount: here a namespace of its own mounts the device."""
    device = sysloop.attach_sync(image)
    mnt = image.parent / "mnt"
    mnt.mkdir()
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               f"mount {device} {mnt} && echo mounted && exec sleep 600"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "mounted\n"
        with pytest.raises(AssertionError) as held:
            loops.release(device, image, timeout=0.5)
        assert f"pid {holder.pid} (sleep)" in str(held.value) and f"at {mnt}" in str(held.value), held.value
    finally:
        holder.kill()
        holder.wait()
    wait_until(lambda: not sysloop.serves(device, image), what="the device to go with the namespace")


def test_a_block_that_leaves_releases_the_device_and_its_mounts(image):
    mnt = image.parent / "mnt"
    mnt.mkdir()
    with pytest.raises(RuntimeError):
        with loops.attached(image) as device:
            subprocess.run(["mount", device, str(mnt)], check=True)
            raise RuntimeError("the test failed half way")
    assert not sysloop.serves(device, image) and not os.path.ismount(mnt)
