"""The microVM handler (`crust kata handler`) end to end, on real parts.

Real driver -> shim -> proxy processes, a real `crust kata handler`
registered with the proxy, real QEMU microVMs (software emulation where KVM
does not work) booting the guest image built from Debian packages, real loop
devices hot-plugged as virtio-blk. kubelet is played over the proxy's CSI
socket; sandboxes are started with `crust sandbox run` on OCI bundles.

What is checked is what the host kernel, the disks and the daemons say: no
process on the host has the volume's file system in its mount table, the
QEMU process holds the device open, bytes read back on the host after the
sandbox stopped, the guest's own `df` (printed on its console) against
NodeGetVolumeStats, gRPC status codes, the registry's claims, Kata's
direct-volume layout on disk and the exit codes and JSON of
`crust kata direct-volume`.

The guest image must exist (`./run tests` builds it first); a handler that
finds it missing or stale builds it before registering.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest

from crust.api import agent_pb2, csi_pb2, handler_pb2, handler_pb2_grpc
from crust.common import ttrpc
from crust.common.errors import CrustError, FailedPrecondition, InvalidArgument
from crust.kata import accel as kata_accel
from crust.kata import bzimage, image_packages, port_process, port_volumes, virtiofsd
from crust.kata import image as kata_image
from crust.kata.direct_volume import DirectVolumes, entry_name, parse_mount_info
from crust.kata.qemu import SharedDir, Vm, VmConfig, qemu_pids_under
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.guest_vm import Guest, ScsiGuest, guest
from tests.harness import MIB
from tests.handler_env import Env, namespaces_mounting
from tests.harness import wait_until

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage
PROJECT = Path(__file__).resolve().parents[2]
SIZE_XFS_GROWN = 400 * MIB  # from the 300 MiB tests/integration/test_handler.py gives an xfs volume


# -- helpers ---------------------------------------------------------------------------------


def holds_device(pid: int, majmin: tuple[int, int]) -> bool:
    """Whether the process has the block device open (QEMU's virtio-blk backend)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            st = os.stat(fd)
        except OSError:
            continue
        if stat.S_ISBLK(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == majmin:
            return True
    return False


def anyone_mounts(majmin: tuple[int, int]) -> list[int]:
    """Every process on the host whose mount table has this device: none may."""
    return namespaces_mounting(majmin)


DF_SCRIPT = ('echo "df-bytes: $(df -P -B1 {path} | tail -n 1)" && '
             'echo "df-inodes: $(df -P -i {path} | tail -n 1)"')


def guest_df(console: str, tag: str = "") -> dict[str, int]:
    """The last df lines a guest process printed on the console."""
    found: dict[str, int] = {}
    for line in console.splitlines():
        for key, names in ((f"{tag}df-bytes:", ("bytes_total", "bytes_used", "bytes_available")),
                           (f"{tag}df-inodes:", ("inodes_total", "inodes_used", "inodes_available"))):
            if key in line:
                fields = line.split(key, 1)[1].split()
                found.update(zip(names, map(int, fields[1:4])))
    return found


def usage_dict(usage) -> dict[str, int]:
    by_unit = {u.unit: u for u in usage}
    b, i = by_unit[Usage.BYTES], by_unit[Usage.INODES]
    return {"bytes_total": b.total, "bytes_used": b.used, "bytes_available": b.available,
            "inodes_total": i.total, "inodes_used": i.used, "inodes_available": i.available}


class KataEnv(Env):
    """Env (tests/integration/test_handler.py) with the microVM handler in place of the
    mount-namespace one; Kata's direct-volume directory is the proxy's
    mirror directory, as on a node where both are in use."""

    def console(self, sandbox_id: str) -> str:
        path = self.handler.state_dir / "run" / sandbox_id / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_console(self, sandbox_id: str, text: str, timeout: float = 60) -> str:
        return wait_until(lambda: text in self.console(sandbox_id) and self.console(sandbox_id), timeout=timeout,
                          interval=0.1, what=f"{text!r} on the console of {sandbox_id}")

    def stats(self, v) -> csi_pb2.NodeGetVolumeStatsResponse:
        return self.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=v.volume_id, volume_path=str(v.target)), timeout=60)

    def expand(self, v, size: int) -> int:
        self.proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=60)
        return self.proxy.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
            volume_id=v.volume_id, volume_path=str(v.target),
            capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=180).capacity_bytes

    def handler_stub(self) -> tuple[grpc.Channel, handler_pb2_grpc.HandlerStub]:
        channel = grpc.insecure_channel(f"unix://{self.handler.socket}")
        return channel, handler_pb2_grpc.HandlerStub(channel)

    def direct_volume(self, verb: str, *args: str, cli: list[str] | None = None,
                      env: dict | None = None) -> subprocess.CompletedProcess:
        argv = cli or [sys.executable, "-m", "crust", "kata", "direct-volume"]
        extra = [] if env else ["--kata-dir", str(self.kata_dir), "--handler-endpoint",
                                f"unix://{self.handler.socket}"]
        return subprocess.run([*argv, verb, *args, *extra], capture_output=True, text=True, timeout=240,
                              env={**os.environ, **(env or {})})

    @property
    def kata_dir(self) -> Path:
        return self.proxy.kata_dir


def kata_env(root, proxy_extra=(), handler_extra=()):
    """driver -> shim -> proxy, and `crust kata handler` registered with it;
    its sandboxes deleted at the end. Root.close() then stops the daemons and
    kills this root's QEMU processes. CRUST_TEST_KATA_CACHE names another
    guest image cache than the default (a tree whose guest agent differs
    from the one other trees build into the shared cache)."""
    cache = os.environ.get("CRUST_TEST_KATA_CACHE")
    e = KataEnv(root, proxy_extra=proxy_extra, start_handler=False, name="kata", endpoint_name="kata.sock",
                command=("kata", "handler"),
                extra=["--kata-dir", str(root.path / "kata"), *(["--cache", cache] if cache else []),
                       *handler_extra])
    e.handler.start(timeout=900)  # builds the guest image if it is missing
    try:
        yield e
    finally:
        e.delete_sandboxes()


@pytest.fixture
def kenv(root):
    yield from kata_env(root)


@pytest.fixture
def kenv_short_lease(root):
    """With 3 s leases: a killed handler is seen gone quickly."""
    yield from kata_env(root, proxy_extra=["--lease-seconds", "3"])


DISK_BUSES = ["virtio-blk", "virtio-scsi"]


@pytest.fixture(params=DISK_BUSES)
def kenv_bus(root, request):
    """kenv, its handler's volumes on each disk bus in turn."""
    yield from kata_env(root, handler_extra=["--disk-bus", request.param])


@pytest.fixture(params=DISK_BUSES)
def kenv_bus_short_lease(root, request):
    yield from kata_env(root, proxy_extra=["--lease-seconds", "3"], handler_extra=["--disk-bus", request.param])


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


# -- Kata's direct-volume verbs --------------------------------------------------------------


def make_loop_volume(root: Path, name: str, size: int, fs: str) -> tuple[Path, str]:
    """What a Kata-style CSI driver has at NodePublishVolume: a formatted device."""
    backing = root / f"{name}.img"
    with open(backing, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs." + fs, "-q", str(backing)] if fs == "ext4" else ["mkfs.xfs", "-q", str(backing)],
                   check=True, capture_output=True)
    device = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True, capture_output=True,
                            text=True).stdout.strip()
    return backing, device


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
        info = json.dumps({"volume-type": "block", "device": device, "fstype": "ext4",
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
        for sb in list(kenv.sandboxes()):
            kenv.handler.sandbox("delete", sb)
        if sysmount.at(str(kenv.path / "check")) is not None:
            subprocess.run(["umount", str(kenv.path / "check")])
        wait_until(lambda: not qemu_pids_under(kenv.handler.state_dir), timeout=30, what="QEMU to exit")
        sysloop.detach_sync(device)


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


# -- the accelerator ----------------------------------------------------------------------------


def test_auto_accelerator_picks_one_that_boots_and_keeps_the_verdict(tmp_path):
    kernel, initrd = kata_image.image_paths()
    config = VmConfig(kernel=kernel, initrd=initrd)
    cache, workdir = tmp_path / "cache", tmp_path / "probe"
    record_path = cache / kata_accel.RECORD_NAME

    chosen, reason = asyncio.run(kata_accel.choose("auto", config, cache, workdir))
    assert chosen in ("kvm", "tcg"), (chosen, reason)
    assert not workdir.exists() and not qemu_pids_under(tmp_path)  # the probe VM is gone
    if kata_accel.KVM_DEVICE.exists():
        assert "probe VM" in reason, reason
        record = json.loads(record_path.read_text())
        assert (record["key"], record["accel"], record["reason"]) == (kata_accel.probe_key(config), chosen, reason)
        assert stat.S_IMODE(record_path.stat().st_mode) == 0o644
        # A restart on the same node takes the kept verdict: no probe.
        again, again_reason = asyncio.run(kata_accel.choose("auto", config, cache, workdir))
        assert again == chosen and again_reason.startswith(reason + " (probed "), again_reason
        # A verdict about another kernel, QEMU or /dev/kvm is not taken.
        record_path.write_text(json.dumps({**record, "key": "0" * 64, "accel": "nonsense"}))
        third, third_reason = asyncio.run(kata_accel.choose("auto", config, cache, workdir))
        assert third == chosen and "(probed " not in third_reason
        assert json.loads(record_path.read_text())["key"] == kata_accel.probe_key(config)
    else:
        assert chosen == "tcg" and "does not exist" in reason and not record_path.exists()

    # What auto chose really runs the guest.
    async def boot() -> float:
        vm = Vm("accel-check", tmp_path / "vm", VmConfig(kernel=kernel, initrd=initrd, accel=chosen))
        try:
            return await vm.start(ready_timeout=120)
        finally:
            await vm.kill()
    assert asyncio.run(boot()) > 0
    # Explicit choices are taken as given; anything else is refused.
    assert asyncio.run(kata_accel.choose("tcg", config, cache, workdir)) == ("tcg", "chosen by --accel")
    with pytest.raises(ValueError, match="'fast'"):
        asyncio.run(kata_accel.choose("fast", config, cache, workdir))


def test_probe_vms_left_by_a_killed_handler_are_reaped_and_nothing_else(tmp_path):
    # Stand-ins that look like QEMU to /proc (argv[0] and a socket path),
    # one in this handler's probe directory and one in a neighbour's.
    def qemu_lookalike(workdir: Path) -> subprocess.Popen:
        return subprocess.Popen(["qemu-system-x86_64", "-c", "import time; time.sleep(120)", "-name",
                                 "crust-accel-probe-1", f"{workdir}/agent.sock"], executable=sys.executable)
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe-of-another").mkdir()
    ours = qemu_lookalike(tmp_path / "probe")
    other = qemu_lookalike(tmp_path / "probe-of-another")
    try:
        wait_until(lambda: sorted(qemu_pids_under(tmp_path)) == sorted([ours.pid, other.pid]),
                   timeout=10, what="both processes to start")
        assert kata_accel.reap_leftover_probes(tmp_path / "probe") == [ours.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_qemu_that_hangs_before_greeting_is_a_timed_out_probe_not_a_crash(tmp_path):
    """A QEMU that creates its QMP socket and then hangs (KVM under nested
    virtualisation can stop it before its main loop): the VM start fails as
    hung, the probe's verdict is the retryable "did not answer", and the
    stand-in is killed."""
    fake = tmp_path / "hanging-qemu"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import socket, sys, time
        path = sys.argv[sys.argv.index("-qmp") + 1].removeprefix("unix:").split(",")[0]
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(4)   # connections are taken by the kernel; nobody greets
        time.sleep(120)
        """))
    fake.chmod(0o755)
    config = VmConfig(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd", qemu_binary=str(fake))
    workdir = tmp_path / "probe"

    started = time.monotonic()
    works, reason, definite = asyncio.run(kata_accel.probe_kvm(config, workdir, timeout=10))
    assert (works, definite) == (False, False) and "did not answer within 10s" in reason, reason
    assert time.monotonic() - started < 40
    leftover = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True).stdout.split()
    assert leftover == [], "the hung stand-in was not killed"


# -- the guest image cache ----------------------------------------------------------------------


def test_the_guest_kernel_is_built_uncompressed_and_boots_at_its_pvh_entry():
    """Debian's cloud kernel, decompressed once at build time: every VM
    starts at the kernel's PVH entry, not in the bzImage's decompressor."""
    built = kata_image.build()
    assert built.kernel.name == "vmlinux", built.manifest.get("kernel_boot")
    assert built.manifest["kernel_boot"].startswith("pvh"), built.manifest["kernel_boot"]
    assert bzimage.pvh_entry(built.kernel.read_bytes()) is not None
    assert built.kernel.stat().st_size == built.manifest["sizes"]["vmlinux"]
    assert kata_image.image_paths() == (built.kernel, built.initrd)


def test_the_guest_image_holds_python_and_the_agent_imports_from_pycs_compiled_at_build(tmp_path):
    """The Python agent's interpreter (Debian's python3.11), the standard
    library modules it imports and nothing of ssl, the protobuf runtime and
    crust's own modules: in the image's file tree (chrooted), the agent
    imports from the .pyc files the builder compiled, unchecked-hash, so
    nothing is compiled or written there. Every file is a Debian package's
    but crust's own and the protobuf runtime's the manifest names."""
    import google.protobuf

    built = kata_image.build()
    tree = tmp_path / "tree"
    tree.mkdir()
    with built.initrd.open("rb") as archive:
        subprocess.run(["busybox", "cpio", "-i", "-d"], cwd=tree, stdin=archive, check=True, capture_output=True)
    python = built.manifest["inputs"]["python"]
    assert python["protobuf"] == google.protobuf.__version__
    assert (tree / "usr/bin/python3.11").is_file() and (tree / "usr/lib/python3.11/asyncio/base_events.py").is_file()
    assert not list(tree.rglob("ssl.py")) and not list(tree.rglob("_ssl.*.so"))
    assert {"/usr/lib/crust/python/crust/guest/__main__.py", "/usr/lib/crust/python/crust/api/agent_pb2.py",
            "/usr/lib/crust/python/google/protobuf/descriptor_pool.py"} <= set(python["files"])
    # Every source has its pyc, hash-based and never checked against it (flags 0b01).
    sources = {p.relative_to(tree) for p in tree.rglob("*.py")}
    compiled = {p.relative_to(tree) for p in tree.rglob("*.pyc")}
    assert compiled == {s.parent / "__pycache__" / f"{s.stem}.cpython-311.pyc" for s in sources}
    assert {int.from_bytes((tree / c).read_bytes()[4:8], "little") for c in compiled} == {0b01}

    def chrooted(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([shutil.which("chroot"), str(tree), "/usr/bin/python3.11", "-S", *argv], capture_output=True,
                              text=True, timeout=120, env={"PYTHONPATH": "/usr/lib/crust/python"})
    before = {p: p.stat().st_mtime_ns for p in tree.rglob("*")}
    done = chrooted("-c", "import sys, crust.guest.agent; print([m for m in ('ssl', '_ssl') if m in sys.modules])")
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", ""), done
    done = chrooted("-m", "crust.guest", "--help")       # as /init runs it
    assert done.returncode == 0 and done.stdout.startswith("usage: python3 -m crust.guest"), done
    assert {p: p.stat().st_mtime_ns for p in tree.rglob("*")} == before

    # Owners: what the builder makes or takes from its downloads, the
    # listed Python files, and the host's files, each a Debian package's.
    release = built.manifest["kernel_release"]
    extracted = kata_image.DEFAULT_CACHE / "extract"
    kernel = extracted / f"{built.manifest['inputs']['kernel_package']}_"
    own = {"init", "etc/crust/image", "etc/passwd", "etc/group", f"lib/modules/{release}/modules.dep",
           *kata_image.GUEST_FILES, *kata_image.GUEST_PROGRAMS}
    from_host = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = str(path.relative_to(tree))
        if rel in own or rel.startswith("etc/crust/modules"):
            continue
        if rel.endswith(".pyc"):
            assert (path.parent.parent / (path.name.split(".")[0] + ".py")).is_file(), rel
        elif "/" + rel in python["files"]:
            assert rel.startswith("usr/lib/crust/python/"), rel
        elif rel.startswith("lib/modules/"):
            assert any((d / rel).is_file() for d in extracted.glob(glob.escape(kernel.name) + "*")), rel
        elif rel == "bin/busybox":
            assert any((d / rel).is_file() for d in extracted.glob("busybox-static_*")), rel
        elif rel.startswith("sbin/"):      # a tool, wherever its package put it on the host
            from_host.append(shutil.which(path.name, path=kata_image.SBIN_PATH))
        else:
            from_host.append("/" + rel)
    assert "/usr/bin/python3.11" in from_host
    assert image_packages.owners(from_host)["/usr/bin/python3.11"][0] == "python3.11-minimal"


def test_apt_cache_keeps_its_package_cache_in_the_image_cache(tmp_path):
    """The inputs are read with a package cache of crust's own (Debian's
    images keep none), built once and then reused: the same answers."""
    options = image_packages.apt_cache_options(tmp_path)
    first = kata_image.collect_inputs(kata_image.FLAVORS["cloud"], options)
    made = tmp_path / "apt-pkgcache.bin"
    assert made.is_file() and made.stat().st_size > 0
    stamp = made.stat().st_mtime_ns
    again = kata_image.collect_inputs(kata_image.FLAVORS["cloud"], options)
    assert again.digest == first.digest and made.stat().st_mtime_ns == stamp
    assert first.digest == kata_image.collect_inputs(kata_image.FLAVORS["cloud"]).digest


def test_each_image_keeps_its_own_directory_and_the_oldest_beyond_the_limit_go(tmp_path):
    """Two releases (or checkouts) on one node each boot the image they
    checked: a build of another never overwrites it."""
    flavor = kata_image.FLAVORS["cloud"]
    top = tmp_path / "images" / "cloud"
    made = []
    for n in range(kata_image.KEEP_IMAGES + 2):
        out = kata_image._output_dir(tmp_path, flavor, f"{n:02d}" * 32)
        out.mkdir(parents=True)
        for name in ("vmlinuz", kata_image.INITRD):
            (out / name).write_bytes(f"{name} {n}".encode())
        (out / "manifest.json").write_text("{}")
        os.utime(out / "manifest.json", (1000 + n, 1000 + n))
        made.append(out)
    (top / "vmlinuz").write_text("the one-image layout")
    # The second image confirmed again (its handler restarted): it becomes current and newest.
    kata_image._mark_current(tmp_path, flavor, made[1])
    assert kata_image.image_paths(tmp_path) == (made[1] / "vmlinuz", made[1] / kata_image.INITRD)
    kept = sorted(d.name for d in top.iterdir() if d.is_dir())
    assert kept == sorted(d.name for d in [made[1], *made[-(kata_image.KEEP_IMAGES - 1):]])
    assert (made[1] / "vmlinuz").read_bytes() == b"vmlinuz 1"
    assert not (top / "vmlinuz").exists()
    with pytest.raises(FileNotFoundError):
        kata_image.image_paths(tmp_path / "elsewhere")
    # A build that decompressed the kernel (crust.kata.bzimage) names the file it boots.
    (made[1] / "manifest.json").write_text(json.dumps({"kernel_file": "vmlinux"}))
    assert kata_image.image_paths(tmp_path) == (made[1] / "vmlinux", made[1] / kata_image.INITRD)


# -- the guest's OCI runtime ----------------------------------------------------------------------


def test_crun_in_the_guest_starts_once_per_call_from_a_binary_nobody_can_write(root):
    """crun's guard against CVE-2019-5736 (a container rewriting the
    runtime's binary through /proc/self/exe) holds with crun started once:
    its binary is a read-only mount, so crun runs it as it is instead of
    copying itself into a memfd and re-executing at every call (on the
    rootfs it did so twice: three starts per run, exec, state, delete)."""
    async def run(g: Guest):
        code, out = await g.sh("LD_DEBUG=files /sbin/crun --version 2>&1 | grep -c 'initialize program:'")
        assert (code, out.strip()) == (0, "1"), out
        code, out = await g.sh("/sbin/crun --version")
        assert code == 0 and out.startswith("crun version "), out
        # Read-only to everyone in the guest: a write fails, whoever asks.
        code, out = await g.sh("echo overwritten >> /sbin/crun")
        assert code != 0 and "Read-only file system" in out, out
        code, out = await g.sh("awk '$5 == \"/sbin/crun\"' /proc/self/mountinfo")
        fields = out.split()
        assert code == 0 and fields[5].split(",")[0] == "ro" and "ramfs" in fields, out
        code, out = await g.sh("head -c 4 /sbin/crun | od -c | head -1")
        assert "E   L   F" in out, out
    guest(root, run)


def test_warm_runs_one_container_through_crun_and_leaves_nothing(root):
    """The agent's Warm, what a pooled VM runs while it waits: crun runs a
    container of a pod's shape from the image's warm spec (the answer only
    once it printed what its spec says), and the guest keeps nothing of it:
    no container in crun's state, no bundle, no cgroup, no mount; again,
    the same. A warm that cannot make its bundle says so, and leaves the
    way clear for the next."""
    leftovers = ("ls /run/crust/crun 2>/dev/null; ls -d /run/crust/warm /sys/fs/cgroup/crust/crust-warm 2>/dev/null;"
                 " grep -e crust-warm -e /run/crust/warm /proc/mounts; true")

    async def run(g):
        client = await g.port()
        assert g.vm.port.has("warm")
        code, before = await g.sh("cat /proc/mounts | wc -l")
        for _ in range(2):
            await client.call("Warm", agent_pb2.WarmRequest(), timeout=120)
            assert await g.sh(leftovers) == (0, "")
        assert await g.sh("cat /proc/mounts | wc -l") == (code, before)
        assert await g.sh(": > /run/crust/warm") == (0, "")
        with pytest.raises(ttrpc.TtrpcError) as refused:
            await client.call("Warm", agent_pb2.WarmRequest(), timeout=120)
        assert refused.value.code == ttrpc.FAILED_PRECONDITION and "/run/crust/warm" in refused.value.message, \
            refused.value
        assert await g.sh("rm /run/crust/warm") == (0, "")
        await client.call("Warm", agent_pb2.WarmRequest(), timeout=120)
        assert await g.sh(leftovers) == (0, "")
    guest(root, run)


@pytest.mark.parametrize("kind", [Guest, ScsiGuest], ids=DISK_BUSES)
def test_a_waiting_vm_plugs_mounts_and_unplugs_a_disk_of_its_own_once(root, kind):
    """The pool's disk warm-up: an image made once in the pool's directory
    (by mkfs only), hot-plugged read-only, mounted and unmounted by the
    guest, unplugged; the guest then holds no disk and no mount of it (a
    LUN's removal, which QEMU announces, within 2 s), and the image is kept
    for the next VM."""
    from crust.kata.pool import WARM_DISK_IMAGE, WARM_DISK_MOUNT, VmPool, warm_disk

    pool = VmPool(0, root.path / "pool", None)
    pool.directory.mkdir()
    image = pool.directory / WARM_DISK_IMAGE

    async def run(g):
        # The guest's agent mounts it: connected and serving this bus.
        await g.port()
        assert port_volumes.serves(g.vm.port, g.vm.config.disk_bus, "ext4")
        await warm_disk(g.vm, await g.port(), pool.directory)
        made = image.stat().st_mtime_ns
        assert g.vm.disks == {}
        leftovers = ("i=0; while ls /sys/block | grep -q -e vd -e sd && [ $i -lt 40 ]; do usleep 50000; "
                     f"i=$((i + 1)); done; ls /sys/block | grep -e vd -e sd; grep {WARM_DISK_MOUNT} /proc/mounts; true")
        assert await g.sh(leftovers) == (0, "")
        await warm_disk(g.vm, await g.port(), pool.directory)
        assert image.stat().st_mtime_ns == made and g.vm.disks == {}
        assert await g.sh(leftovers) == (0, "")
        assert sorted(p.name for p in pool.directory.iterdir()) == [WARM_DISK_IMAGE]
    guest(root, run, kind)
    assert subprocess.run(["blkid", "-o", "value", "-s", "TYPE", str(image)], capture_output=True, text=True,
                          check=True).stdout.strip() == "ext4"


@pytest.mark.parametrize("bus", DISK_BUSES)
def test_vms_restored_from_a_template_go_on_from_the_save_each_with_its_own_clock_and_numbers(root, bus):
    """VmTemplate boots a VM, warms it, saves it (vm.state, and template.json
    naming what it was made from) and stops it; its build directory and QEMU
    go. Each VM restored from the file goes on from the save instead of
    booting (its guest's uptime is past QEMU's age), with the host's wall
    clock although the template is 5 s old (without `resume` it would be the
    template's), and with a boot_id and random bytes of its own; it takes a
    share and a disk on its bus as a booted VM does, through its agent's
    port. Its agent's Resume refuses a seed too short to reseed from. A
    second VmTemplate over the kept files uses them; one for another VM
    size makes its own."""
    from crust.common.formats import decode
    from crust.kata.pool import warm_disk
    from crust.kata.guest_ram import ram_path
    from crust.kata.template import RECORD_FILE, STATE_FILE, TemplateRecord, VmTemplate
    from tests.guest_vm import guest_config

    directory = root.path / "template"
    config = guest_config(bus)

    template = VmTemplate(directory, config)
    state = asyncio.run(_saved_by(template))
    assert template.builds == 1 and state == directory / STATE_FILE
    record = decode(TemplateRecord, (directory / RECORD_FILE).read_bytes())
    # The state holds the devices; the guest's RAM is apart, its pages of
    # zeros left as holes.
    ram = ram_path(state)
    assert record.saved_bytes == state.stat().st_size < 4 * MIB
    assert ram.stat().st_size == config.memory_mib * MIB
    assert 32 * MIB < record.ram_bytes < config.memory_mib * MIB // 2
    assert sorted(p.name for p in directory.iterdir()) == sorted([STATE_FILE, ram.name, RECORD_FILE])
    assert qemu_pids_under(directory) == []
    while time.time() < record.saved_at + 5:
        time.sleep(0.1)

    share = root.path / "share"
    share.mkdir()
    (share / "from-host").write_text("host\n")
    seen = []
    for n in range(2):
        async def run(g, n=n):
            # A restored VM holds the saved pages, not all of its RAM.
            held = os.stat(f"/proc/{g.vm.pid}/fd/{g.vm.ram_fd}").st_blocks * 512
            assert record.ram_bytes <= held < record.ram_bytes + 16 * MIB, (held, record.ram_bytes)
            await g.vm.plug_shared_dir(SharedDir("crust", share))
            shared = await port_process.mount_share(await g.port(), "crust")
            started = time.time()
            code, out = await g.sh(f"cat /proc/uptime; date +%s; cat /proc/sys/kernel/random/boot_id; "
                                   f"head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo; "
                                   f"cat {shared}/from-host; echo {n} > {shared}/from-guest-{n}")
            ended = time.time()
            assert code == 0, out
            uptime, clock, boot_id, numbers, from_host = out.splitlines()
            # No boot: /init never started the agent again (it says so on the
            # console when it does), and the guest's clock since boot goes on.
            assert "crust-init: starting the agent" not in g.vm.console_log.read_text(errors="replace")
            assert float(uptime.split()[0]) > record.guest_uptime_s > 1.0, (uptime, record)
            # Read between the request and its answer (seconds apart on a
            # busy machine), to `date`'s whole second.
            assert started - 2 <= int(clock) <= ended + 1, (started, clock, ended)
            assert from_host == "host"
            assert port_volumes.serves(g.vm.port, bus, "ext4")
            await warm_disk(g.vm, await g.port(), root.path)
            client = await g.port()
            with pytest.raises(ttrpc.TtrpcError) as caught:
                await client.call("Resume", agent_pb2.ResumeRequest(seconds=int(time.time()), seed=b"short"),
                                  timeout=10)
            assert caught.value.code == ttrpc.INVALID_ARGUMENT and caught.value.message.startswith("seed: ")
            return boot_id, numbers
        kept = Guest(root.path / f"restored-{n}", name=f"restored-{n}", disk_bus=bus, saved=state)
        seen.append(asyncio.run(_run_guest(kept, run)))
        assert (share / f"from-guest-{n}").read_text() == f"{n}\n"
    (first_boot, first_numbers), (second_boot, second_numbers) = seen
    assert first_boot != second_boot and first_numbers != second_numbers and len(first_numbers) == 64

    again = VmTemplate(directory, config)
    assert asyncio.run(_saved_by(again)) == state and again.builds == 0
    bigger = VmTemplate(directory, dataclasses.replace(config, memory_mib=320))
    assert asyncio.run(_saved_by(bigger)) == state and bigger.builds == 1
    assert decode(TemplateRecord, (directory / RECORD_FILE).read_bytes()).key != record.key


async def _run_guest(kept: Guest, body):
    async with kept as g:
        return await body(g)


async def _saved_by(template) -> Path:
    """The state file a VmTemplate saved (made now, or kept from before)."""
    await template.start()
    try:
        deadline = time.monotonic() + 180
        while (state := template.saved()) is None:
            assert time.monotonic() < deadline, "no template saved within 180 s"
            await asyncio.sleep(0.1)
        return state
    finally:
        await template.stop()


RESTORES_IN_A_ROW = 40


def test_every_vm_restored_in_a_row_on_a_busy_machine_mounts_its_share(root):
    """A pod's VM restored from the template gets its share hot-plugged at
    once, while the guest's virtio-fs driver may still be probing the
    device: the agent's MountShare waits until the driver has registered
    the tag, however long the probe takes. 40 VMs restored one after the
    other, with a process spinning on one of the host's CPUs all along,
    each mount their share and read through it a file the host wrote for
    that VM; each VM is killed after, and neither a QEMU nor a virtiofsd
    is left."""
    from crust.kata.template import VmTemplate
    from tests.guest_vm import guest_config

    config = guest_config()
    state = asyncio.run(_saved_by(VmTemplate(root.path / "template", config)))
    share = root.path / "share"
    share.mkdir()

    async def restore(n: int) -> str | None:
        """None if VM n mounted its share and read its file through it, or why not."""
        (share / "for-guest").write_text(f"{n}\n")
        g = Guest(root.path / f"restored-{n}", name=f"restored-{n}", saved=state, config=config)
        await g.vm.start(saved=state)
        try:
            await g.vm.plug_shared_dir(SharedDir("crust", share))
            try:
                shared = await port_process.mount_share(await g.port(), "crust")
            except CrustError as exc:
                _, kernel = await g.sh("dmesg | grep -e virtio -e fuse | tail -4; "
                                       "cat /sys/bus/virtio/drivers/virtiofs/virtio*/status")
                return f"{exc.message}; guest kernel: {kernel.splitlines()}"
            code, out = await g.sh(f"cat {shared}/for-guest")
            return None if (code, out) == (0, f"{n}\n") else f"read {code} {out!r}"
        finally:
            await g.vm.kill()

    spinner = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    failed = {}
    try:
        for n in range(RESTORES_IN_A_ROW):
            if (why := asyncio.run(restore(n))) is not None:
                failed[n] = why
                if len(failed) == 3:
                    break   # each failure waits out the agent's wait for the tag (a minute)
    finally:
        spinner.kill()
        spinner.wait()
    assert failed == {}, f"{len(failed)} restores failed, up to restore {n + 1} of {RESTORES_IN_A_ROW}: {failed}"
    assert qemu_pids_under(root.path) == [] and virtiofsd.pids_under(root.path) == []


def test_scsi_luns_are_found_by_serial_never_reused_and_a_taken_over_vm_keeps_its_bus(root):
    """On the virtio-scsi bus each disk is the next LUN (one just unplugged
    is not announced again), the agent finds each by its serial, whatever
    its LUN; an unplug returns once the guest removed the disk, so the same
    serial plugged again at once finds the new one; a VM taken over by a
    process set to virtio-blk keeps its disks on the controller (their LUNs
    read back from QEMU) and plugs its next disk there too, past the LUNs
    in use."""
    images = []
    for name in "abcd":
        image = root.path / f"{name}.img"
        with open(image, "wb") as f:
            f.truncate(16 * MIB)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-L", f"disk-{name}", str(image)], check=True)
        images.append(image)

    async def where(g, serial: str, target: str) -> tuple[int, str]:
        """(LUN, label) of the disk the agent mounted at target."""
        client = await g.port()
        answer = await port_volumes.mount(client, port_volumes.storage(serial, "ext4", [], True, target, None))
        device = answer.device
        assert device.startswith("sd") and answer.mount_point == target, answer
        code, out = await g.sh(f"readlink /sys/block/{device}/device; cat /sys/block/{device}/ro; "
                               f"blkid -s LABEL -o value /dev/{device}")
        address, ro, label = out.split()
        assert code == 0 and ro == "0", out     # read-only is the mount's, not the disk's
        assert await port_volumes.unmount(client, target)
        return int(address.rsplit(":", 1)[1]), label

    async def luns(g) -> list[int]:
        """The LUNs of the guest's SCSI disks."""
        code, out = await g.sh("ls /sys/class/scsi_disk")
        assert code == 0, out
        return sorted(int(address.rsplit(":", 1)[1]) for address in out.split())

    async def run(g):
        for serial, image in zip(("lun-a", "lun-b"), images):
            await g.attach(image, serial)
        assert [(d.lun, d.device_id) for d in g.vm.disks.values()] == [(0, "vscsi-lun-a"), (1, "vscsi-lun-b")]
        assert await where(g, "lun-b", "/run/b") == (1, "disk-b")
        assert await where(g, "lun-a", "/run/a") == (0, "disk-a")
        await g.vm.detach_disk("lun-a")
        # No wait here: detach_disk returns once the guest removed the disk.
        assert await luns(g) == [1]
        # The same serial plugged again at once is a new LUN, and the one found.
        await g.vm.attach_disk(g.loops["lun-a"], "lun-a")
        assert g.vm.disks["lun-a"].lun == 2
        assert await where(g, "lun-a", "/run/a") == (2, "disk-a")
        await g.vm.detach_disk("lun-a")
        await g.attach(images[2], "lun-c")
        assert g.vm.disks["lun-c"].lun == 3
        assert await where(g, "lun-c", "/run/c") == (3, "disk-c")
        # The unplugged serial is not found: the mount waits for it until
        # its deadline, then names it; nothing is mounted.
        with pytest.raises(ttrpc.TtrpcError) as refused:
            await (await g.port()).call("MountVolume", agent_pb2.MountVolumeRequest(
                storage=port_volumes.storage("lun-a", "ext4", [], True, "/run/a", None)), timeout=5)
        assert refused.value.code == ttrpc.DEADLINE_EXCEEDED and "'lun-a'" in refused.value.message, refused.value
        assert await g.sh("grep -c ' /run/a ' /proc/mounts") == (1, "0\n")

        # A new process takes the VM over, set to the other bus: this one's
        # connections go first, as its exit would close them.
        identity = g.vm.identity
        await g.vm.port.close()
        await g.vm.qmp.close()
        config = VmConfig(kernel=g.vm.config.kernel, initrd=g.vm.config.initrd)
        taken = Vm(g.vm.name, g.vm.workdir, config, socket_dir=g.vm.socket_dir)
        await taken.adopt(identity, [(g.loops["lun-b"], "lun-b"), (g.loops["lun-c"], "lun-c")])
        g.vm = taken   # stopped by the guest's teardown
        assert taken.config.disk_bus == "virtio-scsi" and config.disk_bus == "virtio-blk"
        assert {s: (d.lun, d.device_id) for s, d in taken.disks.items()} == {
            "lun-b": (1, "vscsi-lun-b"), "lun-c": (3, "vscsi-lun-c")}
        await g.attach(images[3], "lun-d")
        assert taken.disks["lun-d"].lun == 4
        assert await where(g, "lun-d", "/run/d") == (4, "disk-d")
        # The agent's WaitDiskRemoved answers once the guest removed a LUN QEMU dropped.
        mark = taken.qmp.mark()
        await taken.qmp.execute("device_del", {"id": "vscsi-lun-b"})
        await port_volumes.wait_disk_removed(await g.port(), "lun-b", timeout=60)
        assert await luns(g) == [3, 4]
        # QEMU lets go of the LUN's node only when it reports the device
        # deleted, which may come after the guest removed the disk.
        await taken.qmp.wait_event("DEVICE_DELETED", mark, lambda d: d.get("device") == "vscsi-lun-b", timeout=30)
        await taken.detach_disk("lun-b")   # its device gone already: the node goes all the same
        assert "lun-b" not in taken.disks
        with pytest.raises(InvalidArgument, match="'no/such' is not 1..20 characters"):
            await port_volumes.wait_disk_removed(await g.port(), "no/such", timeout=60)
    guest(root, run, ScsiGuest)
