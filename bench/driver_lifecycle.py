#!/usr/bin/env python3
"""Time every CSI lifecycle step of a volume on a real `crust driver`.

Starts `python -m crust driver --mode all` on a unix socket in a temporary
root, plays the CO over real gRPC, and times each RPC of a volume's life as
the client sees it:

    CreateVolume, ControllerPublishVolume, NodeStageVolume, NodePublishVolume,
    NodeGetVolumeStats, NodeUnpublishVolume, NodeUnstageVolume,
    ControllerUnpublishVolume, DeleteVolume      (mount access, ext4, 64 MiB)

    ControllerExpandVolume + NodeExpandVolume    (on a second volume per
    iteration, mount access, xfs 320 MiB -> 384 MiB, published: ext4 online
    grow is refused by some kernels, xfs grows online everywhere; that
    volume's other steps are timed too and reported separately)

It does so at several scales: with N "background" volumes already present
in the driver, each created, controller-published, staged and published (so
mountinfo, the loop devices and the records all grow). Each scale reports
median and p90 per step; the table shows the scales side by side with the
ratio largest/smallest.

Run from the project root as root (loop devices and mounts):

    .venv/bin/python bench/driver_lifecycle.py [--volumes 30] [--background 10,500] [--json OUT]

The driver runs in a private mount namespace of its own (as a node plugin
does in its container): the benchmark's 1,000 mounts stay out of the host's
mount table, so mount namespaces other programs create meanwhile cannot copy
and pin them, and the host's mounts do not inflate the driver's mountinfo.

Everything it makes lives under one temporary root and is removed on exit,
also on Ctrl-C, SIGTERM or failure: volumes are unpublished, unstaged and
deleted through the driver, the driver is stopped (its namespace, and any
mount still in it, goes with it), any mount left below the root is unmounted
and any loop device over a file below it is detached; the loop device nodes
the run made the kernel create are removed again (unless --keep-loop-nodes),
so the next run starts from the same /sys/block.
"""

from __future__ import annotations

import argparse
import fcntl
import inspect
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root: bench, crust, tests

import grpc  # noqa: E402

from bench.benchlib import (  # noqa: E402
    PROJECT,
    Interrupted,
    cores,
    die_with_parent,
    file_text,
    ignore_signals,
    left_below,
    machine,
    machine_ticks,
    own_ticks,
    proc_ticks,
    project_on_pythonpath,
    raise_on_signals,
    run_header,
    stop_process,
    write_json,
)
from crust.api import csi_pb2, csi_pb2_grpc  # noqa: E402
from crust.sys import loop as sysloop  # noqa: E402
from crust.sys import mount as sysmount  # noqa: E402

MIB = 1024**2
AccessMode = csi_pb2.VolumeCapability.AccessMode
SYS_BLOCK = Path("/sys/block")
LOOP_CTL_REMOVE = 0x4C81
RPC_TIMEOUT = 120

EXT4_STEPS = [
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "NodeGetVolumeStats",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
]
XFS_STEPS = [
    "CreateVolume",
    "ControllerPublishVolume",
    "NodeStageVolume",
    "NodePublishVolume",
    "ControllerExpandVolume",
    "NodeExpandVolume",
    "NodeUnpublishVolume",
    "NodeUnstageVolume",
    "ControllerUnpublishVolume",
    "DeleteVolume",
]


def mount_cap(fs_type: str) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type),
        access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER),
    )


# -- the driver process --------------------------------------------------------


# Run inside the driver's own mount namespace, before exec'ing the driver:
# the namespace starts as a copy of the host's, so first let go of every
# loop-device file system (and loop device node bind) that other users of
# this machine have mounted; keeping them would pin their devices for as long
# as the benchmark runs.
_LAUNCHER = """
import os, subprocess, sys
from crust.sys import mount
for e in sorted(mount.mounts(), key=lambda e: -len(e.mount_point)):
    if e.major == 7 or (e.fs_type == "devtmpfs" and e.root.startswith("/loop")):
        subprocess.run(["umount", "-l", "--", e.mount_point], capture_output=True)
os.execv(sys.executable, [sys.executable, "-m", "crust", *sys.argv[1:]])
"""


class Driver:
    def __init__(self, root: Path, node_id: str = "bench-node"):
        self.root = root
        self.node_id = node_id
        self.socket = root / "csi.sock"
        self.data_dir = root / "data"
        self.log_path = root / "driver.log"
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self.controller: csi_pb2_grpc.ControllerStub | None = None
        self.node: csi_pb2_grpc.NodeStub | None = None

    @property
    def mountinfo(self) -> str:
        """The driver's view of the mounts (its own namespace)."""
        return f"/proc/{self.proc.pid}/mountinfo" if self.proc is not None else "/proc/self/mountinfo"

    def start(self, timeout: float = 20.0) -> None:
        # The driver gets a private mount namespace of its own, as a node
        # plugin has in its container: the benchmark's mounts never show in
        # the host's mount table, so mount namespaces that other programs
        # create meanwhile (`unshare -m`) do not copy and pin them, and the
        # host's other mounts do not inflate the driver's mountinfo.
        argv = ["unshare", "--mount", "--propagation", "private", "--", sys.executable, "-c", _LAUNCHER,
                "driver", "--endpoint", f"unix://{self.socket}",
                "--node-id", self.node_id, "--data-dir", str(self.data_dir), "--mode", "all",
                # Volumes are sparse: the capacity is a provisioning limit only.
                "--capacity", "1Ti",
                # The default attach limit (64) would refuse the background
                # volumes' ControllerPublishVolume; 4096 is the maximum.
                "--max-volumes-per-node", "4096"]
        env = dict(os.environ)
        project_on_pythonpath(env)
        # In its own session (a Ctrl-C at the terminal must not stop it before
        # the cleanup RPCs), and ending if we are killed.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, cwd=PROJECT, env=env,
                                         start_new_session=True, preexec_fn=die_with_parent)
        identity = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"driver exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists():
                if self.channel is None:
                    self.channel = grpc.insecure_channel(f"unix://{self.socket}")
                    identity = csi_pb2_grpc.IdentityStub(self.channel)
                try:
                    if identity.Probe(csi_pb2.ProbeRequest(), timeout=2).ready.value:
                        self.controller = csi_pb2_grpc.ControllerStub(self.channel)
                        self.node = csi_pb2_grpc.NodeStub(self.channel)
                        return
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"driver not ready within {timeout}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        stop_process(self.proc, 20)
        self.proc = None


# -- volumes as a CO sees them ----------------------------------------------------


@dataclass
class Vol:
    name: str
    fs_type: str
    size: int
    staging: str
    target: str
    volume_id: str = ""


class CO:
    """Plays the CO for one driver; every call can be timed into `into`."""

    def __init__(self, driver: Driver):
        self.d = driver
        self.node_id = driver.node_id
        # Everything that may exist, for the cleanup (a name is added before
        # its CreateVolume is sent, and removed only after DeleteVolume).
        self.live: dict[str, Vol] = {}
        self.lock = threading.Lock()
        self.retries: dict[str, int] = {}
        self.last_retry_reason: dict[str, str] = {}

    def _timed(self, into: dict | None, step: str, fn, req, retry_precondition: bool = False):
        """One RPC, timed. With retry_precondition, FAILED_PRECONDITION is
        retried as a CO would (every 50 ms, up to 10 s): the time kept is
        that of the call that succeeded, and the retries are counted."""
        deadline = time.monotonic() + 10
        while True:
            t0 = time.perf_counter()
            try:
                resp = fn(req, timeout=RPC_TIMEOUT)
                break
            except grpc.RpcError as exc:
                if not (retry_precondition and exc.code() == grpc.StatusCode.FAILED_PRECONDITION
                        and time.monotonic() < deadline):
                    raise
                with self.lock:
                    self.retries[step] = self.retries.get(step, 0) + 1
                    self.last_retry_reason[step] = exc.details()
                time.sleep(0.05)
        if into is not None:
            into[step] = (time.perf_counter() - t0) * 1e3
        return resp

    def round_trip(self, into=None) -> None:
        """A call that does no work: the gRPC + event-loop floor under every step."""
        self._timed(into, "NodeGetCapabilities", self.d.node.NodeGetCapabilities,
                    csi_pb2.NodeGetCapabilitiesRequest())

    def create(self, v: Vol, into=None) -> None:
        with self.lock:
            self.live[v.name] = v
        resp = self._timed(into, "CreateVolume", self.d.controller.CreateVolume, csi_pb2.CreateVolumeRequest(
            name=v.name, capacity_range=csi_pb2.CapacityRange(required_bytes=v.size),
            volume_capabilities=[mount_cap(v.fs_type)]))
        v.volume_id = resp.volume.volume_id

    def controller_publish(self, v: Vol, into=None) -> None:
        self._timed(into, "ControllerPublishVolume", self.d.controller.ControllerPublishVolume,
                    csi_pb2.ControllerPublishVolumeRequest(volume_id=v.volume_id, node_id=self.node_id,
                                                           volume_capability=mount_cap(v.fs_type)))

    def stage(self, v: Vol, into=None) -> None:
        self._timed(into, "NodeStageVolume", self.d.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
            volume_id=v.volume_id, staging_target_path=v.staging, volume_capability=mount_cap(v.fs_type),
            publish_context={"node": self.node_id}))

    def publish(self, v: Vol, into=None) -> None:
        self._timed(into, "NodePublishVolume", self.d.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
            volume_id=v.volume_id, staging_target_path=v.staging, target_path=v.target,
            volume_capability=mount_cap(v.fs_type), publish_context={"node": self.node_id}))

    def stats(self, v: Vol, into=None) -> None:
        resp = self._timed(into, "NodeGetVolumeStats", self.d.node.NodeGetVolumeStats,
                           csi_pb2.NodeGetVolumeStatsRequest(volume_id=v.volume_id, volume_path=v.target,
                                                             staging_target_path=v.staging))
        if resp.volume_condition.abnormal:
            raise RuntimeError(f"{v.name}: abnormal volume condition: {resp.volume_condition.message}")

    def expand(self, v: Vol, new_size: int, into=None) -> None:
        resp = self._timed(into, "ControllerExpandVolume", self.d.controller.ControllerExpandVolume,
                           csi_pb2.ControllerExpandVolumeRequest(
                               volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=new_size),
                               volume_capability=mount_cap(v.fs_type)))
        if resp.node_expansion_required:
            resp = self._timed(into, "NodeExpandVolume", self.d.node.NodeExpandVolume,
                               csi_pb2.NodeExpandVolumeRequest(
                                   volume_id=v.volume_id, volume_path=v.target, staging_target_path=v.staging,
                                   capacity_range=csi_pb2.CapacityRange(required_bytes=new_size),
                                   volume_capability=mount_cap(v.fs_type)))
        if resp.capacity_bytes < new_size:
            raise RuntimeError(f"{v.name}: expanded to {resp.capacity_bytes}, wanted {new_size}")

    def unpublish(self, v: Vol, into=None) -> None:
        self._timed(into, "NodeUnpublishVolume", self.d.node.NodeUnpublishVolume,
                    csi_pb2.NodeUnpublishVolumeRequest(volume_id=v.volume_id, target_path=v.target))

    def unstage(self, v: Vol, into=None) -> None:
        self._timed(into, "NodeUnstageVolume", self.d.node.NodeUnstageVolume,
                    csi_pb2.NodeUnstageVolumeRequest(volume_id=v.volume_id, staging_target_path=v.staging))

    def controller_unpublish(self, v: Vol, into=None) -> None:
        self._timed(into, "ControllerUnpublishVolume", self.d.controller.ControllerUnpublishVolume,
                    csi_pb2.ControllerUnpublishVolumeRequest(volume_id=v.volume_id, node_id=self.node_id))

    def delete(self, v: Vol, into=None) -> None:
        # The driver refuses to delete a volume whose loop device it still
        # sees; right after NodeUnstageVolume the kernel may not have finished
        # the detach (see docs/benchmarks.md), and a CO retries.
        self._timed(into, "DeleteVolume", self.d.controller.DeleteVolume,
                    csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id), retry_precondition=True)
        with self.lock:
            self.live.pop(v.name, None)

    def bring_up(self, v: Vol, into=None) -> None:
        self.create(v, into)
        self.controller_publish(v, into)
        self.stage(v, into)
        self.publish(v, into)

    def tear_down(self, v: Vol, into=None) -> None:
        self.unpublish(v, into)
        self.unstage(v, into)
        self.controller_unpublish(v, into)
        self.delete(v, into)

    def tear_down_quietly(self, v: Vol) -> str | None:
        """Cleanup: every step is idempotent, so run them all and keep going."""
        if not v.volume_id:
            try:  # CreateVolume may have gone through before an interrupt
                resp = self.d.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
                    name=v.name, capacity_range=csi_pb2.CapacityRange(required_bytes=v.size),
                    volume_capabilities=[mount_cap(v.fs_type)]), timeout=RPC_TIMEOUT)
                v.volume_id = resp.volume.volume_id
            except grpc.RpcError as exc:
                return f"{v.name}: {exc.code().name}"
        errors = []
        for step in (self.unpublish, self.unstage, self.controller_unpublish, self.delete):
            try:
                step(v)
            except grpc.RpcError as exc:
                errors.append(f"{step.__name__}: {exc.code().name} {exc.details()}")
        return f"{v.name}: {'; '.join(errors)}" if errors else None


# -- kernel state -----------------------------------------------------------------


def loop_names() -> set[str]:
    return {p.name for p in SYS_BLOCK.glob("loop*")}


def ours(root: Path) -> dict[str, str]:
    prefix = str(root) + "/"
    return {dev: b for dev, b in sysloop.attached().items() if b.startswith(prefix)}


def snapshot_env(root: Path, driver: Driver) -> dict:
    """What the driver's per-RPC scans walk over at this scale, and what one
    such scan costs (the same crust.sys functions, called here against the
    driver's mount namespace)."""
    text = Path(driver.mountinfo).read_text()
    mounts = sysmount.parse_mountinfo(text)
    prefix = str(root) + "/"
    records = driver.data_dir / "node" / driver.node_id / "volumes"
    probe_file = driver.data_dir / "pools" / driver.node_id / "volumes" / "vol-0000000000000000deadbeef.img"

    def cost(fn, n=30) -> float:
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return round(statistics.median(samples), 3)

    env = {
        "mountinfo_lines": len(mounts),
        "mountinfo_bytes": len(text),
        "mounts_under_root": sum(1 for m in mounts if (m.mount_point + "/").startswith(prefix)),
        "loop_nodes_in_sys_block": len(loop_names()),
        "loop_devices_attached": len(sysloop.attached()),
        "node_records": len(list(records.glob("*.json"))) if records.exists() else 0,
        "loadavg_before": file_text("/proc/loadavg").split(" ")[0],
        "ms_read_mountinfo": cost(lambda: Path(driver.mountinfo).read_bytes()),
        "ms_loop_devices_for": cost(lambda: sysloop.devices_for(probe_file)),
    }
    # Time crust.sys.mount against the driver's namespace: pass the table
    # where the function takes one, else point the module's path at it.
    nowhere = str(root / "nowhere")
    if "table" in inspect.signature(sysmount.mounts).parameters:
        env["ms_mount_mounts"] = cost(lambda: sysmount.mounts(driver.mountinfo))
        env["ms_mount_at"] = cost(lambda: sysmount.at(nowhere, driver.mountinfo))
    else:
        saved, sysmount.MOUNTINFO = sysmount.MOUNTINFO, driver.mountinfo
        try:
            env["ms_mount_mounts"] = cost(sysmount.mounts)
            env["ms_mount_at"] = cost(lambda: sysmount.at(nowhere))
        finally:
            sysmount.MOUNTINFO = saved
    return env


def loops_in_log(driver: Driver) -> set[str]:
    """Every loop device the driver logged (it logs the device it attaches and stages)."""
    try:
        text = driver.log_path.read_text(errors="replace")
    except OSError:
        return set()
    return set(re.findall(r'"/dev/(loop[0-9]+)"', text))


def cpu_sample(driver_pid: int | None) -> dict:
    """Clock ticks: whole machine busy/iowait, this process, the driver (with
    its reaped children: mkfs, mount, losetup...)."""
    busy, iowait = machine_ticks()
    own = own_ticks()
    driver = proc_ticks(driver_pid, with_children=True) if driver_pid else 0
    return {"t": time.monotonic(), "busy": busy, "iowait": iowait, "driver": driver, "own": own}


def foreign_cpu(a: dict, b: dict) -> dict:
    """CPU the rest of the machine used between two samples, in cores."""
    secs = b["t"] - a["t"]
    others = (b["busy"] - a["busy"]) - (b["driver"] - a["driver"]) - (b["own"] - a["own"])
    return {"other_processes_cpu_cores": cores(max(0, others), secs),
            "iowait_cores": cores(b["iowait"] - a["iowait"], secs)}


def remove_loop_nodes(names: set[str]) -> int:
    """Remove free loop device nodes by name (LOOP_CTL_REMOVE); busy ones stay."""
    removed = 0
    try:
        fd = os.open("/dev/loop-control", os.O_RDWR)
    except OSError:
        return 0
    try:
        for name in sorted(names):
            if not name.startswith("loop") or not name[4:].isdigit():
                continue
            if (SYS_BLOCK / name / "loop" / "backing_file").exists():
                continue  # attached again (by someone else): leave it
            try:
                fcntl.ioctl(fd, LOOP_CTL_REMOVE, int(name[4:]))
                removed += 1
            except OSError:
                pass
    finally:
        os.close(fd)
    return removed


def force_cleanup(root: Path) -> tuple[int, int]:
    """Unmount whatever is mounted below root (deepest first), detach every
    loop device whose backing file is below root."""
    prefix = str(root) + "/"
    unmounted = detached = 0
    for _ in range(5):
        found = [m for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]
        if not found:
            break
        for m in sorted(found, key=lambda m: -len(m.mount_point)):
            if subprocess.run(["umount", "-l", "--", m.mount_point], capture_output=True).returncode == 0:
                unmounted += 1
    for dev in ours(root):
        if subprocess.run(["losetup", "--detach", dev], capture_output=True).returncode == 0:
            detached += 1
    return unmounted, detached


# -- statistics and output ------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(samples: list[float]) -> dict:
    return {
        "n": len(samples),
        "median_ms": round(percentile(samples, 0.5), 2),
        "p90_ms": round(percentile(samples, 0.9), 2),
        "min_ms": round(min(samples), 2) if samples else None,
        "max_ms": round(max(samples), 2) if samples else None,
        "samples_ms": [round(x, 2) for x in samples],
    }


def fmt(x: float) -> str:
    if x != x:  # nan
        return "-"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def render_table(result: dict) -> str:
    scales = [s["background"] for s in result["scales"]]
    by = {s["background"]: s for s in result["scales"]}
    lo, hi = scales[0], scales[-1]
    head = ["step"] + [f"{n} bg: median / p90 ms" for n in scales]
    if len(scales) > 1:
        head.append(f"ratio {hi}/{lo} (median)")
    rows = []

    def add(label: str, group: str, step: str) -> None:
        row = [label]
        for n in scales:
            st = by[n]["steps"][group].get(step)
            row.append(f"{fmt(st['median_ms'])} / {fmt(st['p90_ms'])}" if st else "-")
        if len(scales) > 1:
            a, b = by[lo]["steps"][group].get(step), by[hi]["steps"][group].get(step)
            row.append(f"{b['median_ms'] / a['median_ms']:.2f}x" if a and b and a["median_ms"] > 0 else "-")
        rows.append(row)

    size = result["config"]
    ext4 = f"ext4 {size['ext4_mib']} MiB"
    add("gRPC round trip, no work (NodeGetCapabilities)", "ext4", "NodeGetCapabilities")
    for step in EXT4_STEPS:
        add(f"{step} ({ext4})", "ext4", step)
    add(f"whole lifecycle ({ext4}, sum)", "ext4", "total")
    xfs = f"xfs {size['xfs_mib']}->{size['xfs_grown_mib']} MiB"
    add(f"ControllerExpandVolume ({xfs})", "xfs", "ControllerExpandVolume")
    add(f"NodeExpandVolume ({xfs})", "xfs", "NodeExpandVolume")
    rows.append(["(the expand step's xfs volume, other steps)"] + [""] * (len(head) - 1))
    for step in XFS_STEPS:
        if "Expand" not in step:
            add(f"{step} (xfs {size['xfs_mib']} MiB)", "xfs", step)

    widths = [max(len(head[i]), *(len(r[i]) for r in rows if r)) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                          for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [line(head), "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":")
                                    for i, w in enumerate(widths)) + "|"]
    for r in rows:
        out.append(line(r))
    env_keys = [("mountinfo_lines", "mountinfo lines (driver's namespace)"),
                ("loop_nodes_in_sys_block", "/sys/block/loop* nodes"),
                ("loop_devices_attached", "attached loop devices (all users)"),
                ("node_records", "node records on disk"),
                ("ms_read_mountinfo", "one raw read of the driver's /proc/PID/mountinfo, ms"),
                ("ms_mount_mounts", "one crust.sys.mount.mounts() (read + parse), ms"),
                ("ms_mount_at", "one crust.sys.mount.at(), ms"),
                ("ms_loop_devices_for", "one crust.sys.loop.devices_for() scan, ms"),
                ("other_processes_cpu_cores", "CPU used by other processes while measuring, cores"),
                ("iowait_cores", "iowait while measuring, cores")]
    out.append("")
    out.append("| state during the measurement | " + " | ".join(f"{n} bg" for n in scales) + " |")
    out.append("|---|" + "---:|" * len(scales))
    for key, label in env_keys:
        out.append(f"| {label} | " + " | ".join(str(by[n]["env"].get(key, "-")) for n in scales) + " |")
    return "\n".join(out)


# -- the benchmark ------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="driver_lifecycle.py",
        description="Time each CSI lifecycle RPC of a volume on a real `crust driver --mode all` (loop backend), "
                    "with N pre-existing staged and published volumes, at several N. Needs root.")
    p.add_argument("--volumes", type=int, default=30, metavar="N",
                   help="measured volumes per scale (each goes through the whole lifecycle; default 30)")
    p.add_argument("--background", default="10,500", metavar="N,M,...",
                   help="pre-existing (created, controller-published, staged, published) volume counts, "
                        "ascending; default 10,500")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write every sample and the environment as JSON")
    p.add_argument("--jobs", type=int, default=4,
                   help="parallel CO calls while building/removing background volumes (never while measuring; "
                        "default 4)")
    p.add_argument("--ext4-size", type=int, default=64, metavar="MIB",
                   help="size of the measured ext4 volumes and the background volumes (default 64)")
    p.add_argument("--xfs-size", type=int, default=320, metavar="MIB",
                   help="size of the xfs volume of the expand step before growth (default 320; mkfs.xfs "
                        "needs 300)")
    p.add_argument("--xfs-grow", type=int, default=64, metavar="MIB", help="growth of the expand step (default 64)")
    p.add_argument("--keep-loop-nodes", action="store_true",
                   help="do not remove the (detached) loop device nodes this run made the kernel create")
    args = p.parse_args(argv)
    try:
        args.scales = sorted({int(x) for x in args.background.split(",") if x.strip()})
    except ValueError:
        p.error("--background takes comma-separated integers, e.g. 10,500")
    if not args.scales or args.scales[0] < 0:
        p.error("--background needs at least one count >= 0")
    if args.volumes < 1:
        p.error("--volumes must be at least 1")
    return args


def measure_one(co: CO, root: Path, tag: str, args) -> tuple[dict, dict]:
    base = root / "m" / tag
    a = Vol(f"m-{tag}-ext4", "ext4", args.ext4_size * MIB, str(base / "e-staging"), str(base / "e-target"))
    b = Vol(f"m-{tag}-xfs", "xfs", args.xfs_size * MIB, str(base / "x-staging"), str(base / "x-target"))
    te: dict[str, float] = {}
    tx: dict[str, float] = {}
    co.round_trip(te)
    # The ext4 volume's life, in the order a CO calls it...
    co.create(a, te)
    co.controller_publish(a, te)
    co.stage(a, te)
    co.publish(a, te)
    co.stats(a, te)
    # ...the expand step on a published xfs volume, at the same point of the
    # life (same mounts and loop devices present, plus the ext4 volume's)...
    co.bring_up(b, tx)
    co.expand(b, (args.xfs_size + args.xfs_grow) * MIB, tx)
    co.tear_down(b, tx)
    # ...and the rest of the ext4 volume's life.
    co.tear_down(a, te)
    te["total"] = sum(te[s] for s in EXT4_STEPS)
    return te, tx


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("driver_lifecycle.py needs root (loop devices, mkfs, mount)", file=sys.stderr)
        return 2

    raise_on_signals()

    # Short path: unix socket paths must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="crust-bench-")).resolve()
    loops_before = loop_names()
    seen_loops: set[str] = set()
    driver = Driver(root)
    co = CO(driver)
    pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))
    result = {
        **run_header("driver_lifecycle", argv, machine(
            loop_max_loop=file_text("/sys/module/loop/parameters/max_loop"))),
        "config": {"volumes_per_scale": args.volumes, "background": args.scales, "ext4_mib": args.ext4_size,
                   "xfs_mib": args.xfs_size, "xfs_grown_mib": args.xfs_size + args.xfs_grow,
                   "access": "mount, SINGLE_NODE_WRITER", "jobs": args.jobs},
        "scales": [],
    }
    background: list[Vol] = []
    status = 1
    started = time.monotonic()
    try:
        driver.start()
        print(f"crust driver ({result['code']}) up in {root} ({result['machine']['cpus']} CPUs, "
              f"kernel {result['machine']['kernel']})", flush=True)
        # One warm-up lifecycle (imports, first subprocesses, page cache), not counted.
        measure_one(co, root, "warmup", args)

        for n in args.scales:
            t0 = time.monotonic()
            todo = [Vol(f"bg-{i:05d}", "ext4", args.ext4_size * MIB, str(root / "bg" / f"{i:05d}" / "staging"),
                        str(root / "bg" / f"{i:05d}" / "target")) for i in range(len(background), n)]
            background.extend(todo)
            for fut in [pool.submit(co.bring_up, v) for v in todo]:
                fut.result()
            seen_loops |= {d.removeprefix("/dev/") for d in ours(root)}
            built = time.monotonic() - t0
            # Start each measurement from a clean page cache: writeback of what
            # building the background dirtied would otherwise slow every fsync.
            t_sync = time.monotonic()
            os.sync()
            synced = time.monotonic() - t_sync
            env = snapshot_env(root, driver)
            env["sync_seconds_after_build"] = round(synced, 1)
            print(f"\n[{n} background volumes] ready (+{len(todo)} in {built:.1f}s); mountinfo {env['mountinfo_lines']} "
                  f"lines, {env['loop_nodes_in_sys_block']} loop nodes; measuring {args.volumes} volumes",
                  flush=True)
            ext4 = {s: [] for s in EXT4_STEPS + ["total", "NodeGetCapabilities"]}
            xfs = {s: [] for s in XFS_STEPS}
            t1 = time.monotonic()
            retries0 = dict(co.retries)
            cpu0 = cpu_sample(driver.proc.pid if driver.proc else None)
            for i in range(args.volumes):
                te, tx = measure_one(co, root, f"{n}-{i:03d}", args)
                for k, v in te.items():
                    ext4[k].append(v)
                for k, v in tx.items():
                    xfs[k].append(v)
                if (i + 1) % 10 == 0:
                    print(f"  {i + 1}/{args.volumes} (lifecycle median so far "
                          f"{statistics.median(ext4['total']):.0f} ms)", flush=True)
            seen_loops |= {d.removeprefix("/dev/") for d in ours(root)}
            env["retries_while_measuring"] = {k: v - retries0.get(k, 0) for k, v in co.retries.items()
                                              if v - retries0.get(k, 0)}
            if env["retries_while_measuring"]:
                print(f"  retried (FAILED_PRECONDITION): {env['retries_while_measuring']}; last reason: "
                      f"{co.last_retry_reason}", flush=True)
            env["loadavg_after"] = file_text("/proc/loadavg").split(" ")[0]
            env.update(foreign_cpu(cpu0, cpu_sample(driver.proc.pid if driver.proc else None)))
            result["scales"].append({
                "background": n, "build_seconds": round(built, 1),
                "measure_seconds": round(time.monotonic() - t1, 1), "env": env,
                "steps": {"ext4": {k: summarize(v) for k, v in ext4.items()},
                          "xfs": {k: summarize(v) for k, v in xfs.items()}},
            })

        result["wall_seconds"] = round(time.monotonic() - started, 1)
        print()
        print(render_table(result))
        status = 0
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\ninterrupted ({str(exc) or 'SIGINT'}); cleaning up", file=sys.stderr, flush=True)
        status = 130
    except Exception as exc:  # noqa: BLE001 - report, then clean up
        why = ""
        if driver.proc is not None and driver.proc.poll() is not None:
            why = f"the driver exited (code {driver.proc.returncode}); "
        elif driver.proc is not None and not driver.socket.exists():
            why = "the driver's socket disappeared (something removed files under the root?); "
        print(f"\nbenchmark failed: {why}{exc!r}\n--- driver log tail ---\n{driver.log_tail()}", file=sys.stderr,
              flush=True)
        status = 1
    finally:
        ignore_signals()
        pool.shutdown(wait=True, cancel_futures=True)
        try:
            seen_loops |= {d.removeprefix("/dev/") for d in ours(root)}
        except Exception:  # noqa: BLE001
            pass
        seen_loops |= loops_in_log(driver)
        t0 = time.monotonic()
        problems = []
        if driver.proc is not None and driver.proc.poll() is None and driver.controller is not None:
            leftovers = list(co.live.values())
            with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as cleaners:
                problems = [p for p in cleaners.map(co.tear_down_quietly, leftovers) if p]
        ns_mounts = 0
        try:
            if driver.proc is not None and driver.proc.poll() is None:
                ns_mounts = sum(1 for m in sysmount.parse_mountinfo(Path(driver.mountinfo).read_text())
                                if (m.mount_point + "/").startswith(str(root) + "/"))
        except OSError:
            pass
        try:
            # Stopping the driver ends its mount namespace: the kernel unmounts
            # whatever is still mounted there.
            driver.stop()
        except Exception as exc:  # noqa: BLE001 - the kernel-side cleanup below must still run
            problems.append(f"stopping the driver: {exc!r}")
        unmounted = detached = removed_nodes = 0
        try:
            deadline = time.monotonic() + 5
            while ours(root) and time.monotonic() < deadline and ns_mounts:
                time.sleep(0.1)  # file systems of the ended namespace let go of their devices
            unmounted, detached = force_cleanup(root)
            if not args.keep_loop_nodes:
                removed_nodes = remove_loop_nodes(seen_loops - loops_before)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"forced cleanup: {exc!r}")
        left_mounts, left_loops = left_below(str(root) + "/")
        if not left_mounts and not left_loops:
            shutil.rmtree(root, ignore_errors=True)
        print(f"\ncleanup: {len(co.live)} volumes not deleted through the driver, {len(problems)} teardown errors, "
              f"{ns_mounts} mounts left in the driver's namespace (released with it), "
              f"{unmounted} forced unmounts, {detached} forced detaches, {removed_nodes} loop nodes removed "
              f"({time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)
        for p in problems[:10]:
            print(f"  {p}", file=sys.stderr)
        if left_mounts or left_loops:
            print(f"cleanup INCOMPLETE: mounts {left_mounts[:5]}, loop devices {sorted(left_loops)[:5]}; "
                  f"root kept at {root}", file=sys.stderr)
            status = status or 1
        if args.json and result["scales"]:
            result["retries_total"] = co.retries
            result["cleanup"] = {"teardown_errors": problems, "mounts_left_in_driver_namespace": ns_mounts,
                                 "forced_unmounts": unmounted,
                                 "forced_detaches": detached, "loop_nodes_removed": removed_nodes}
            write_json(args.json, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
