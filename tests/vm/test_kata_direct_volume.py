"""Kata's direct-volume verbs through the microVM handler: the layout of
Kata's direct-volume directory and its input checks
(crust.kata.sandbox.direct_volume), a Kata-style CSI driver working unchanged
through the shipped kata-runtime wrapper (`direct-volume add`, `stats`,
`resize`, `remove`) on the real stack (tests/harness/kata_env.py), and planted
entries refused at a sandbox's start. What is checked is Kata's layout on
disk, the exit codes and JSON of `crust kata direct-volume`, what the guest
wrote on the device, and the gRPC status codes.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crust.api import csi_pb2
from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.kata.sandbox.direct_volume import DirectVolumes, entry_name, parse_mount_info
from crust.kata.vmm.qemu import qemu_pids_under
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB
from tests.harness.daemons import wait_until
from tests.harness.kata_env import DF_SCRIPT, anyone_mounts, guest_df, holds_device, make_loop_volume
from tests.harness.kata_env import kenv  # noqa: F401 - a fixture
from tests.harness.loops import release_each

Usage = csi_pb2.VolumeUsage
PROJECT = Path(__file__).resolve().parents[2]


def test_direct_volume_layout_and_input_checks(tmp_path):
    volumes = DirectVolumes(tmp_path / "dv")
    path = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount"
    info = '{"volume-type": "block", "device": "/dev/loop9", "fstype": "ext4", "metadata": {"fsGroup": "2000"}}'
    assert volumes.add(path, info) is True
    entry = tmp_path / "dv" / base64.urlsafe_b64encode(path.encode()).decode()
    assert entry_name(path) == entry.name and entry.name.endswith("=")  # padded, as Kata names it
    assert stat.S_IMODE(entry.stat().st_mode) == 0o700
    assert stat.S_IMODE((entry / "mountInfo.json").stat().st_mode) == 0o600
    assert (entry / "mountInfo.json").read_text() == info
    assert volumes.add(path, info) is False  # a retry changes nothing
    read = volumes.read(path)
    assert (read.device, read.fstype, read.metadata, read.target_path) == ("/dev/loop9", "ext4",
                                                                         {"fsGroup": "2000"}, path)
    # Below a CSI volume, a subpath source resolves to the volume.
    resolved = volumes.resolve(path + "/a/b")
    assert resolved.info.target_path == path and resolved.subpath == "a/b"
    # One sandbox at a time; its marker sits next to mountInfo.json.
    volumes.claim(path, "sb-1")
    assert (entry / "sb-1").exists() and volumes.sandbox_of(path) == "sb-1"
    with pytest.raises(FailedPrecondition, match="sb-1"):
        volumes.claim(path, "sb-2")
    with pytest.raises(FailedPrecondition, match="in use by sandbox sb-1"):
        volumes.add(path, info.replace("loop9", "loop8"))
    volumes.release(path, "sb-1")
    assert volumes.sandbox_of(path) is None
    assert volumes.remove(path) is True and not entry.exists() and volumes.remove(path) is False
    # The proxy's mirror of its own entry (same layout, crust's keys) is not
    # a direct volume: it is claimed through the proxy's registry.
    volumes.add(path, json.dumps({**json.loads(info), "crust-schema-version": 1, "target-path": path}))
    assert volumes.read(path) is None and volumes.resolve(path) is None
    volumes.remove(path)

    # A symlink planted where an entry would be is no entry, and is never followed.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mountInfo.json").write_text(info)
    (tmp_path / "dv" / entry_name(path)).symlink_to(elsewhere)
    assert volumes.read(path) is None and volumes.sandbox_of(path) is None
    with pytest.raises(FailedPrecondition, match="no longer a direct volume"):
        volumes.claim(path, "sb-1")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["mountInfo.json"]
    assert volumes.remove(path) is True and elsewhere.exists()  # the link goes, not its target
    (tmp_path / "dv" / entry_name(path) / "mountInfo.json").mkdir(parents=True)
    assert volumes.read(path) is None
    os.rmdir(tmp_path / "dv" / entry_name(path) / "mountInfo.json")
    assert volumes.remove(path) is True

    for bad, field in [("{", "not JSON"), ("[]", "JSON object"), ('{"device": "/dev/x", "fstype": "ext4"}',
                                                                   "'volume-type'"),
                       ('{"volume-type": "block", "fstype": "ext4"}', "'device'"),
                       ('{"volume-type": "block", "device": "loop0", "fstype": "ext4"}', "'device'"),
                       ('{"volume-type": "mountedblock", "device": "/dev/x", "fstype": "ext4"}', "'volume-type'"),
                       ('{"volume-type": "block", "device": "/dev/x", "fstype": ""}', "'fstype'")]:
        with pytest.raises(InvalidArgument, match=field):
            parse_mount_info(bad)
    for bad_path in ["", "relative/path", "/" + "x" * 300]:
        with pytest.raises(InvalidArgument, match="--volume-path"):
            volumes.add(bad_path, info)
    assert list((tmp_path / "dv").iterdir()) == []


def test_a_kata_style_driver_works_unchanged_through_direct_volume(kenv):
    """A driver that publishes with `kata-runtime direct-volume add`, answers
    stats and expansion with `... stats` and `... resize`, and unpublishes
    with `... remove`, played with the shipped kata-runtime wrapper."""
    backing, device = make_loop_volume(kenv.path, "kata-style", 64 * MIB, "ext4")
    majmin = (os.major(os.stat(device).st_rdev), os.minor(os.stat(device).st_rdev))
    target = kenv.proxy.target("pod-dv", "pv-dv")
    wrapper_env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                   "CRUST_KATA_DIR": str(kenv.kata_dir),
                   "CRUST_KATA_HANDLER_ENDPOINT": f"unix://{kenv.handler.socket}"}
    wrapper = [str(PROJECT / "deploy" / "kata-runtime"), "direct-volume"]

    def kata_runtime(verb: str, *args: str) -> subprocess.CompletedProcess:
        return kenv.direct_volume(verb, *args, cli=wrapper, env=wrapper_env)

    try:
        # "directvol", as Kata's own CSI driver writes it for Kata 4 (older
        # drivers write "block", which the verbs take as well).
        info = json.dumps({"volume-type": "directvol", "device": device, "fstype": "ext4",
                           "metadata": {"fsGroup": "3000", "fsGroupChangePolicy": "Always"}, "options": []})
        out = kata_runtime("add", "--volume-path", str(target), "--mount-info", info)
        assert out.returncode == 0, out.stderr
        entry = kenv.kata_dir / entry_name(str(target))
        assert json.loads((entry / "mountInfo.json").read_text())["device"] == device

        script = ("echo from-a-kata-driver > /data/f && sync && " + DF_SCRIPT.format(path="/data")
                  + " && echo GID=$(stat -c %g /data) && echo WRITTEN && exec sleep 600")
        sandbox = kenv.run_ok(kenv.bundle("dv", script, [("/data", str(target))]), "sb-dv")
        console = kenv.wait_console("sb-dv", "WRITTEN")
        assert "GID=3000" in console  # fsGroup from Kata's metadata, applied in the guest
        assert sorted(p.name for p in entry.iterdir()) == ["mountInfo.json", "sb-dv"]
        assert kenv.claims() == []  # not the proxy's volume: the marker is the claim
        assert holds_device(sandbox["pid"], majmin) and anyone_mounts(majmin) == []

        # stats prints what Kata prints: the CSI response, proto field names.
        out = kata_runtime("stats", "--volume-path", str(target))
        assert out.returncode == 0, out.stderr
        stats = json.loads(out.stdout)
        units = {u["unit"]: u for u in stats["usage"]}
        assert set(units) == {Usage.BYTES, Usage.INODES} and stats["volume_condition"]["abnormal"] is False
        df = guest_df(console)
        assert (units[Usage.BYTES]["total"], units[Usage.INODES]["total"]) == (df["bytes_total"],
                                                                              df["inodes_total"])

        # resize: refused while the device is smaller than asked; then the
        # driver grows the device and the guest grows the file system online.
        out = kata_runtime("resize", "--volume-path", str(target), "--size", str(128 * MIB))
        assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr and "grow the device" in out.stderr
        with open(backing, "r+b") as f:
            f.truncate(128 * MIB)
        subprocess.run(["losetup", "--set-capacity", device], check=True)
        out = kata_runtime("resize", "--volume-path", str(target), "--size", str(128 * MIB))
        assert out.returncode == 0, out.stderr
        grown = json.loads(kata_runtime("stats", "--volume-path", str(target)).stdout)
        assert {u["unit"]: u for u in grown["usage"]}[Usage.BYTES]["total"] > units[Usage.BYTES]["total"] + 32 * MIB

        # One sandbox at a time; remove is refused while the sandbox runs.
        out = kenv.run(kenv.bundle("dv2", "exec sleep 600", [("/data", str(target))]), "sb-dv2")
        assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and "sb-dv" in out.stderr, out.stderr
        out = kata_runtime("remove", "--volume-path", str(target))
        assert out.returncode == 1 and "in use by sandbox sb-dv" in out.stderr and entry.exists()

        kenv.delete("sb-dv")
        assert sorted(p.name for p in entry.iterdir()) == ["mountInfo.json"]
        out = kata_runtime("stats", "--volume-path", str(target))
        assert out.returncode == 1 and "not in use" in out.stderr
        out = kata_runtime("remove", "--volume-path", str(target))
        assert out.returncode == 0, out.stderr
        assert not entry.exists()

        # Bad input: exit 1, a message naming the flag or key, nothing on disk.
        for args, words in [(["add", "--volume-path", str(target), "--mount-info", "{}"], "'volume-type'"),
                            (["add", "--volume-path", "relative", "--mount-info", info], "--volume-path"),
                            (["stats", "--volume-path", "/nowhere"], "not a direct volume")]:
            out = kata_runtime(*args)
            assert out.returncode == 1 and words in out.stderr, (args, out.stderr)
        assert not entry.exists()

        # The data the guest wrote, on the device.
        mnt = kenv.path / "check"
        mnt.mkdir()
        subprocess.run(["mount", "-o", "ro", device, str(mnt)], check=True)
        try:
            assert (mnt / "f").read_text() == "from-a-kata-driver\n"
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        try:
            for sb in list(kenv.sandboxes()):
                kenv.handler.sandbox("delete", sb)
            if sysmount.at(str(kenv.path / "check")) is not None:
                subprocess.run(["umount", str(kenv.path / "check")], check=True)
            wait_until(lambda: not qemu_pids_under(kenv.handler.state_dir), timeout=30, what="QEMU to exit")
        finally:
            release_each([(device, backing)])


@pytest.mark.parametrize("damage, words", [
    ("symlink", "symlink"), ("entry-symlink", "symbolic link"), ("fifo", "FIFO"),
    ("oversized", "more than"), ("not-json", "not JSON"), ("not-a-description", "'device'")])
def test_a_planted_direct_volume_entry_is_refused_at_the_start_naming_it(kenv, damage, words):
    """A Kata direct-volume entry for a bundle's mount source that is a
    symlink (its mountInfo.json, or the entry itself), a FIFO, 100 MiB, not
    JSON, or not a description: the sandbox start is refused at once with
    FAILED_PRECONDITION naming the entry and what is wrong with it; no VM
    boots, nothing is claimed."""
    target = kenv.proxy.target("pod-planted", "pv-planted")
    target.mkdir(parents=True)
    entry = kenv.kata_dir / entry_name(str(target))
    good = json.dumps({"volume-type": "block", "device": "/dev/loop0", "fstype": "ext4"})
    outside = kenv.path / "outside"
    outside.mkdir()
    (outside / "mountInfo.json").write_text(good)
    if damage == "entry-symlink":
        entry.symlink_to(outside)
    else:
        entry.mkdir(mode=0o700)
        info = entry / "mountInfo.json"
        if damage == "symlink":
            info.symlink_to(outside / "mountInfo.json")
        elif damage == "fifo":
            os.mkfifo(info)
        elif damage == "oversized":
            with open(info, "wb") as f:
                f.truncate(100 * MIB)
        elif damage == "not-json":
            info.write_text(good[:20])
        else:
            info.write_text(json.dumps({"volume-type": "block", "fstype": "ext4"}))
    started = time.monotonic()
    out = kenv.run(kenv.bundle("planted", "exec sleep 600", [("/data", str(target))]), "sb-planted")
    took = time.monotonic() - started
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr, out.stderr
    assert str(entry) in out.stderr and words in out.stderr, out.stderr
    assert kenv.sandboxes() == {} and kenv.claims() == [] and not qemu_pids_under(kenv.handler.state_dir)
    assert not os.path.lexists(entry / "sb-planted") if damage != "entry-symlink" else \
        sorted(p.name for p in outside.iterdir()) == ["mountInfo.json"]
    assert took < 5, f"refused after {took:.1f} s"
