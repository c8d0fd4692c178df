"""The microVM handler (`crust kata handler`) end to end, on real parts:
`crust demo --runtime kata`, and a sandbox's volumes step by step (mounted,
measured and grown in the guest; a crashed VM, a broken file system, a
restarted handler, a guest that stops answering).

Real driver -> shim -> proxy processes, a real `crust kata handler`
registered with the proxy (tests/harness/kata_env.py), real QEMU microVMs (software
emulation where KVM does not work) booting the guest image built from
Debian packages, real loop devices hot-plugged as virtio-blk or
virtio-scsi. kubelet is played over the proxy's CSI socket; sandboxes are
started with `crust sandbox run` on OCI bundles.

What is checked is what the host kernel, the disks and the daemons say: no
process on the host has the volume's file system in its mount table, the
QEMU process holds the device open, bytes read back on the host after the
sandbox stopped, the guest's own `df` (printed on its console) against
NodeGetVolumeStats, gRPC status codes and the registry's claims.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from crust.api import handler_pb2
from crust.kata.vmm.qemu import qemu_pids_under
from tests.harness.daemons import MIB
from tests.harness.daemons import wait_until
from tests.harness.kata_env import DF_SCRIPT, DISK_BUSES, anyone_mounts, guest_df, holds_device, usage_dict
from tests.harness.kata_env import kenv  # noqa: F401 - a fixture
from tests.harness.kata_env import kenv_bus  # noqa: F401 - a fixture
from tests.harness.kata_env import kenv_bus_short_lease  # noqa: F401 - a fixture

Code = grpc.StatusCode
PROJECT = Path(__file__).resolve().parents[2]
SIZE_XFS_GROWN = 400 * MIB  # from the 300 MiB tests/harness/handler_env.py gives an xfs volume


# A container's script line that prints what /data is a mount of.
PRINT_DATA_SOURCE = "echo DATA-FROM $(grep ' /data ' /proc/mounts)"


def data_source(console: str) -> str:
    """The device PRINT_DATA_SOURCE printed (its line on the console)."""
    found = re.search(r"DATA-FROM (\S+) /data ", console)
    return found.group(1) if found else ""


# -- the demo --------------------------------------------------------------------------------


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_kata_demo_runs_every_step_and_leaves_nothing(root, fs):
    tmp = root.path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "crust", "demo", "--runtime", "kata", "--fs", fs, "--json"],
                          cwd=PROJECT, env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True,
                          timeout=600)
    result = json.loads(proc.stdout) if proc.stdout.startswith("{") else {}
    # On failure, name the steps that failed (with their details) first: the
    # whole report would be cut short by pytest.
    failed = [(s["name"], s["detail"]) for s in result.get("steps", []) if not s["ok"]]
    assert proc.returncode == 0, (failed, proc.stderr[-3000:], proc.stdout[-3000:])
    assert result["ok"] is True and result["runtime"] == "kata" and result["fs_type"] == fs
    assert [s["name"] for s in result["steps"] if not s["ok"]] == []
    # The data written in the guest read back on the host after the sandbox stopped.
    assert result["data_verified"] is True
    # At no moment did the host mount the file system.
    assert result["host_mounted_during_sandbox"] is False
    # NodeGetVolumeStats equals what df said inside the guest, field by field.
    assert result["stats_match_df"] is True
    assert len(result["guest_df"]) == 6 and result["stats"] == result["guest_df"]
    # Online expansion: the guest saw the new size (ext4 too, which this
    # host's kernel refuses to grow online).
    expand = next(s for s in result["steps"] if s["name"] == "NodeExpandVolume")
    assert "grown online inside the sandbox" in expand["detail"]
    assert result["size_after"] > result["size_before"] > 0
    assert list(tmp.iterdir()) == [] and qemu_pids_under(tmp) == []


# -- the handler, step by step -----------------------------------------------------------------


def test_the_guest_mounts_measures_and_grows_and_the_host_never_mounts(kenv_bus):
    kenv = kenv_bus
    bus = kenv.handler.extra[kenv.handler.extra.index("--disk-bus") + 1]
    v = kenv.create("pv-k1", "ext4")
    # A host publish lays the volume out: a subpath and a symlink out of it.
    kenv.publish_on_host(v)
    (v.target / "sub" / "dir").mkdir(parents=True)
    (v.target / "sub" / "dir" / "inner").write_text("deep\n")
    (v.target / "link").symlink_to("/etc")
    kenv.unpublish(v)
    kenv.publish_deferred(v)

    script = ("echo written-in-the-guest > /data/hello && cat /sub/inner > /sub/copy && ls /sub > /data/ls && "
              "sync && " + DF_SCRIPT.format(path="/data") + f" && {PRINT_DATA_SOURCE} && echo WRITTEN && "
              "exec sleep 600")
    bundle = kenv.bundle("k1", script, [("/data", str(v.target)), ("/sub", f"{v.target}/sub/dir")])
    info = kenv.run_ok(bundle, "sb-k1")
    (volume,) = info["volumes"]
    assert volume["destinations"] == ["/data", "/sub"] and volume["subpaths"] == ["", "sub/dir"]
    qemu = info["pid"]
    assert qemu in qemu_pids_under(kenv.handler.state_dir)
    assert holds_device(qemu, v.majmin), "QEMU does not hold the volume's device"
    console = kenv.wait_console("sb-k1", "WRITTEN")
    assert anyone_mounts(v.majmin) == [], "a host process has the guest's file system mounted"
    # The volume reached the guest on the handler's bus.
    assert data_source(console) == ("/dev/vda" if bus == "virtio-blk" else "/dev/sda"), console

    # Stats come from the guest and equal its df.
    first = kenv.stats(v)
    assert not first.volume_condition.abnormal, first.volume_condition.message
    assert usage_dict(first.usage) == guest_df(console)

    # The VM was ready once its agent answered: that agent mounted the volume.
    assert "volume mounted in the guest" in kenv.handler.log_path.read_text()
    assert usage_dict(kenv.stats(v).usage) == usage_dict(first.usage)

    # Online growth of ext4 in the guest (this host's kernel refuses it).
    before = usage_dict(first.usage)["bytes_total"]
    assert kenv.expand(v, 96 * MIB) >= 96 * MIB
    after = usage_dict(kenv.stats(v).usage)["bytes_total"]
    assert after > before + 48 * MIB, (before, after)
    assert anyone_mounts(v.majmin) == []

    kenv.delete("sb-k1")
    assert kenv.claims() == []
    wait_until(lambda: qemu not in qemu_pids_under(kenv.handler.state_dir), what="QEMU to exit")
    assert anyone_mounts(v.majmin) == []

    # The bytes the guest wrote, read back on the host; the subpath view was
    # the directory, not the volume's root.
    kenv.unpublish(v)
    kenv.publish_on_host(v)
    assert (v.target / "hello").read_text() == "written-in-the-guest\n"
    assert (v.target / "sub" / "dir" / "copy").read_text() == "deep\n"
    assert (v.target / "ls").read_text().split() == ["copy", "inner"]  # the directory, not the root
    assert os.statvfs(v.target).f_blocks * os.statvfs(v.target).f_frsize > before + 48 * MIB
    kenv.unpublish(v)

    # A subpath through a symlink is refused by the guest, and the refused
    # sandbox is undone: no claim, no VM, nothing mounted.
    kenv.publish_deferred(v)
    out = kenv.run(kenv.bundle("k1-link", "exec sleep 600", [("/x", f"{v.target}/link")]), "sb-k1-link")
    assert out.returncode != 0 and "INVALID_ARGUMENT" in out.stderr and "symlink" in out.stderr, out.stderr
    assert kenv.claims() == [] and kenv.sandboxes() == {}
    wait_until(lambda: qemu_pids_under(kenv.handler.state_dir) == [], what="the refused sandbox's QEMU to exit")
    kenv.unpublish(v)


def test_a_crashed_vm_gives_its_volumes_back_marked_abnormal(kenv):
    v = kenv.volume("pv-k2", "xfs")
    info = kenv.run_ok(kenv.bundle("k2", "exec sleep 600", [("/data", str(v.target))]), "sb-k2")
    assert {c.sandbox_id for c in kenv.claims()} == {"sb-k2"}
    os.kill(info["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: kenv.claims() == [], timeout=15, interval=0.05, what="the claim to be released")
    detected = time.monotonic() - killed
    assert detected < 5, f"a dead VM was noticed after {detected:.1f} s"

    rsp = kenv.stats(v)
    assert rsp.volume_condition.abnormal and "died" in rsp.volume_condition.message, rsp
    channel, stub = kenv.handler_stub()
    with channel:
        state = stub.GetSandbox(handler_pb2.GetSandboxRequest(sandbox_id="sb-k2"), timeout=10).state
    assert state == handler_pb2.GetSandboxResponse.State.GONE
    assert kenv.sandboxes() == {}
    assert anyone_mounts(v.majmin) == []
    # kubelet can unpublish, and the volume is usable again.
    kenv.unpublish(v)
    kenv.publish_deferred(v)
    kenv.run_ok(kenv.bundle("k2b", "exec sleep 600", [("/data", str(v.target))]), "sb-k2b")
    rsp = kenv.stats(v)
    assert not rsp.volume_condition.abnormal, rsp.volume_condition.message
    kenv.delete("sb-k2b")
    kenv.unpublish(v)


def test_errors_and_a_read_only_remount_in_the_guest_make_the_volume_abnormal(kenv):
    """Kata says OK whatever happens; here the condition is the guest's."""
    e, x = kenv.volume("pv-k4e", "ext4"), kenv.volume("pv-k4x", "xfs")
    # ext4 records an error (the kernel's own test hook), xfs goes read-only.
    script = ("for d in /sys/fs/ext4/vd*; do echo 1 > $d/trigger_fs_error; done && "
              "mount -o remount,ro /x && echo BROKEN && exec sleep 600")
    kenv.run_ok(kenv.bundle("k4", script, [("/e", str(e.target)), ("/x", str(x.target))]), "sb-k4")
    kenv.wait_console("sb-k4", "BROKEN")
    ext4, xfs = kenv.stats(e), kenv.stats(x)
    assert ext4.volume_condition.abnormal and "errors" in ext4.volume_condition.message, ext4
    assert xfs.volume_condition.abnormal and "read-only" in xfs.volume_condition.message, xfs
    assert usage_dict(ext4.usage)["bytes_total"] > 0 and usage_dict(xfs.usage)["bytes_total"] > 0
    kenv.delete("sb-k4")
    kenv.unpublish(e)
    kenv.unpublish(x)


def test_a_vm_survives_a_handler_restart_and_is_taken_over(kenv_bus_short_lease):
    kenv = kenv_bus_short_lease
    bus = kenv.handler.extra[kenv.handler.extra.index("--disk-bus") + 1]
    v = kenv.volume("pv-k5", "xfs")
    script = "echo before > /data/a && sync && echo WRITTEN && exec sleep 600"
    info = kenv.run_ok(kenv.bundle("k5", script, [("/data", str(v.target))]), "sb-k5")
    kenv.wait_console("sb-k5", "WRITTEN")
    before = usage_dict(kenv.stats(v).usage)

    kenv.handler.kill()
    # Meanwhile kubelet's stats say who does not answer: the handler, not the proxy.
    with pytest.raises(grpc.RpcError) as down:
        kenv.stats(v)
    assert down.value.code() == Code.UNAVAILABLE and "handler kata" in down.value.details(), down.value.details()
    assert "proxy" not in down.value.details().split("handler")[0], down.value.details()
    wait_until(lambda: kenv.handlers()["kata"].lease_expired, timeout=15, what="the lease to expire")
    assert info["pid"] in qemu_pids_under(kenv.handler.state_dir)  # the VM runs on without its handler
    # The new handler is set to the other disk bus: the VM keeps its own.
    other = DISK_BUSES[1 - DISK_BUSES.index(bus)]
    kenv.handler.extra[kenv.handler.extra.index("--disk-bus") + 1] = other
    kenv.handler.start(timeout=120)
    listed = kenv.sandboxes()
    assert list(listed) == ["sb-k5"] and listed["sb-k5"]["pid"] == info["pid"]
    assert listed["sb-k5"]["state"] == "RUNNING"
    assert [(c.target_path, c.sandbox_id) for c in kenv.claims()] == [(str(v.target), "sb-k5")]

    # The new handler talks to the guest again: stats, growth, then a clean stop.
    rsp = kenv.stats(v)
    assert not rsp.volume_condition.abnormal, rsp.volume_condition.message
    assert usage_dict(rsp.usage)["bytes_total"] == before["bytes_total"]
    kenv.expand(v, SIZE_XFS_GROWN)
    assert usage_dict(kenv.stats(v).usage)["bytes_total"] > before["bytes_total"] + 32 * MIB
    kenv.delete("sb-k5")
    assert kenv.claims() == [] and kenv.sandboxes() == {}
    wait_until(lambda: info["pid"] not in qemu_pids_under(kenv.handler.state_dir), what="QEMU to exit")
    assert "could not" not in kenv.handler.log_path.read_text()
    kenv.unpublish(v)
    kenv.publish_on_host(v)
    assert (v.target / "a").read_text() == "before\n"
    kenv.unpublish(v)


def test_a_guest_that_stops_answering_is_reported_not_waited_for(kenv):
    v = kenv.volume("pv-k3", "ext4")
    info = kenv.run_ok(kenv.bundle("k3", "exec sleep 600", [("/data", str(v.target))]), "sb-k3")
    os.kill(info["pid"], signal.SIGSTOP)
    try:
        started = time.monotonic()
        rsp = kenv.stats(v)
        took = time.monotonic() - started
    finally:
        os.kill(info["pid"], signal.SIGCONT)
    assert rsp.volume_condition.abnormal and "did not answer" in rsp.volume_condition.message, rsp
    assert took < 20, f"stats of a hung guest took {took:.1f} s"
    # Once the guest runs again, it answers again (the late answer to the
    # timed-out request is dropped, not taken for the next one).
    wait_until(lambda: not kenv.stats(v).volume_condition.abnormal, timeout=30, interval=0.5,
               what="stats to be normal again")
    assert usage_dict(kenv.stats(v).usage)["bytes_total"] > 0
    kenv.delete("sb-k3")
    kenv.unpublish(v)
