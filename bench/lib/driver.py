"""The driver that bench/csi/driver_lifecycle.py measures, and the CO it plays.

- Driver: `crust driver --mode all` in a private mount namespace of its
  own, as a node plugin runs in its container;
- Volume and CO: a volume as the CO knows it, and every CSI call of its
  life, each timed as the client sees it;
- snapshot_env(): what the driver's calls walk over at a scale (mount
  table, loop devices, records) and what one such walk costs;
- tear_down(): the end of a run, also after Ctrl-C, SIGTERM or a failure:
  every volume taken down through the driver, the driver stopped, then
  whatever is left below the root released by force.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.lib.benchlib import file_text, left_below, median_ms
from bench.lib.kernel import LoopNodes, force_cleanup, loop_names, loops_below
from bench.lib.stack import (
    project_on_pythonpath,
    start_daemon,
    stop_process,
    wait_until,
)
from crust.api import csi_pb2, csi_pb2_grpc
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness.daemons import mount_cap

RPC_TIMEOUT = 120

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
    """`crust driver --mode all` on a unix socket below root, and its stubs."""

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

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

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
        # In its own session: a Ctrl-C at the terminal must not stop it before the cleanup RPCs.
        self.proc = start_daemon(argv, self.log_path, env)
        wait_until(self.proc, self._ready, timeout,
                   lambda: RuntimeError(f"driver exited with {self.proc.returncode}:\n{self.log_tail()}"),
                   lambda: TimeoutError(f"driver not ready within {timeout}s:\n{self.log_tail()}"))

    def _ready(self) -> bool:
        if not self.socket.exists():
            return False
        if self.channel is None:
            self.channel = grpc.insecure_channel(f"unix://{self.socket}")
        try:
            if csi_pb2_grpc.IdentityStub(self.channel).Probe(csi_pb2.ProbeRequest(), timeout=2).ready.value:
                self.controller = csi_pb2_grpc.ControllerStub(self.channel)
                self.node = csi_pb2_grpc.NodeStub(self.channel)
                return True
        except grpc.RpcError:
            pass
        return False

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


@dataclass
class Volume:
    """A volume as the CO knows it: its name and shape, its paths on the node, its id once created."""

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
        self.live: dict[str, Volume] = {}
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

    def _create_request(self, v: Volume) -> csi_pb2.CreateVolumeRequest:
        return csi_pb2.CreateVolumeRequest(name=v.name, capacity_range=csi_pb2.CapacityRange(required_bytes=v.size),
                                           volume_capabilities=[mount_cap(v.fs_type)])

    def create(self, v: Volume, into=None) -> None:
        with self.lock:
            self.live[v.name] = v
        resp = self._timed(into, "CreateVolume", self.d.controller.CreateVolume, self._create_request(v))
        v.volume_id = resp.volume.volume_id

    def controller_publish(self, v: Volume, into=None) -> None:
        self._timed(into, "ControllerPublishVolume", self.d.controller.ControllerPublishVolume,
                    csi_pb2.ControllerPublishVolumeRequest(volume_id=v.volume_id, node_id=self.node_id,
                                                           volume_capability=mount_cap(v.fs_type)))

    def stage(self, v: Volume, into=None) -> None:
        self._timed(into, "NodeStageVolume", self.d.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
            volume_id=v.volume_id, staging_target_path=v.staging, volume_capability=mount_cap(v.fs_type),
            publish_context={"node": self.node_id}))

    def publish(self, v: Volume, into=None) -> None:
        self._timed(into, "NodePublishVolume", self.d.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
            volume_id=v.volume_id, staging_target_path=v.staging, target_path=v.target,
            volume_capability=mount_cap(v.fs_type), publish_context={"node": self.node_id}))

    def stats(self, v: Volume, into=None) -> None:
        resp = self._timed(into, "NodeGetVolumeStats", self.d.node.NodeGetVolumeStats,
                           csi_pb2.NodeGetVolumeStatsRequest(volume_id=v.volume_id, volume_path=v.target,
                                                             staging_target_path=v.staging))
        if resp.volume_condition.abnormal:
            raise RuntimeError(f"{v.name}: abnormal volume condition: {resp.volume_condition.message}")

    def expand(self, v: Volume, new_size: int, into=None) -> None:
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

    def unpublish(self, v: Volume, into=None) -> None:
        self._timed(into, "NodeUnpublishVolume", self.d.node.NodeUnpublishVolume,
                    csi_pb2.NodeUnpublishVolumeRequest(volume_id=v.volume_id, target_path=v.target))

    def unstage(self, v: Volume, into=None) -> None:
        self._timed(into, "NodeUnstageVolume", self.d.node.NodeUnstageVolume,
                    csi_pb2.NodeUnstageVolumeRequest(volume_id=v.volume_id, staging_target_path=v.staging))

    def controller_unpublish(self, v: Volume, into=None) -> None:
        self._timed(into, "ControllerUnpublishVolume", self.d.controller.ControllerUnpublishVolume,
                    csi_pb2.ControllerUnpublishVolumeRequest(volume_id=v.volume_id, node_id=self.node_id))

    def delete(self, v: Volume, into=None) -> None:
        # The driver refuses to delete a volume whose loop device it still
        # sees; right after NodeUnstageVolume the kernel may not have finished
        # the detach (see docs/performance.md), and a CO retries.
        self._timed(into, "DeleteVolume", self.d.controller.DeleteVolume,
                    csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id), retry_precondition=True)
        with self.lock:
            self.live.pop(v.name, None)

    def bring_up(self, v: Volume, into=None) -> None:
        self.create(v, into)
        self.controller_publish(v, into)
        self.stage(v, into)
        self.publish(v, into)

    def tear_down(self, v: Volume, into=None) -> None:
        self.unpublish(v, into)
        self.unstage(v, into)
        self.controller_unpublish(v, into)
        self.delete(v, into)

    def tear_down_quietly(self, v: Volume) -> str | None:
        """Cleanup: every step is idempotent, so run them all and keep going."""
        if not v.volume_id:
            try:  # CreateVolume may have gone through before an interrupt
                v.volume_id = self.d.controller.CreateVolume(self._create_request(v),
                                                             timeout=RPC_TIMEOUT).volume.volume_id
            except grpc.RpcError as exc:
                return f"{v.name}: {exc.code().name}"
        errors = []
        for step in (self.unpublish, self.unstage, self.controller_unpublish, self.delete):
            try:
                step(v)
            except grpc.RpcError as exc:
                errors.append(f"{step.__name__}: {exc.code().name} {exc.details()}")
        return f"{v.name}: {'; '.join(errors)}" if errors else None


def snapshot_env(root: Path, driver: Driver) -> dict:
    """What the driver's per-RPC scans walk over at this scale, and what one
    such scan costs (the same crust.sys functions, called here against the
    driver's mount namespace)."""
    text = Path(driver.mountinfo).read_text()
    mounts = sysmount.parse_mountinfo(text)
    prefix = str(root) + "/"
    records = driver.data_dir / "node" / driver.node_id / "volumes"
    probe_file = driver.data_dir / "pools" / driver.node_id / "volumes" / "vol-0000000000000000deadbeef.img"
    env = {
        "mountinfo_lines": len(mounts),
        "mountinfo_bytes": len(text),
        "mounts_under_root": sum(1 for m in mounts if (m.mount_point + "/").startswith(prefix)),
        "loop_nodes_in_sys_block": len(loop_names()),
        "loop_devices_attached": len(sysloop.attached()),
        "node_records": len(list(records.glob("*.json"))) if records.exists() else 0,
        "loadavg_before": file_text("/proc/loadavg").split(" ")[0],
        "ms_read_mountinfo": median_ms(lambda: Path(driver.mountinfo).read_bytes(), 30),
        "ms_loop_devices_for": median_ms(lambda: sysloop.devices_for(probe_file), 30),
    }
    # crust.sys.mount timed against the driver's namespace, whose mount table it is given.
    nowhere = str(root / "nowhere")
    env["ms_mount_mounts"] = median_ms(lambda: sysmount.mounts(driver.mountinfo), 30)
    env["ms_mount_at"] = median_ms(lambda: sysmount.at(nowhere, driver.mountinfo), 30)
    return env


def tear_down(driver: Driver, co: CO, root: Path, jobs: int, loop_nodes: LoopNodes, keep_loop_nodes: bool,
              ) -> tuple[dict, bool]:
    """Take down every volume through the driver, stop it (its mount
    namespace, and any mount still in it, goes with it), then unmount and
    detach by force what is left below root and remove the loop device
    nodes the run made the kernel create (unless keep_loop_nodes); the root
    is removed if nothing is left. Prints what it did; returns that, and
    whether the cleanup is complete."""
    try:
        loop_nodes.note()
    except Exception:  # noqa: BLE001, S110 - the cleanup goes on
        pass
    loop_nodes.note_logged(driver.log_path)
    t0 = time.monotonic()
    problems = []
    if driver.running and driver.controller is not None:
        leftovers = list(co.live.values())
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as cleaners:
            problems = [p for p in cleaners.map(co.tear_down_quietly, leftovers) if p]
    ns_mounts = 0
    try:
        if driver.running:
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
        while loops_below(root) and time.monotonic() < deadline and ns_mounts:
            time.sleep(0.1)  # file systems of the ended namespace let go of their devices
        unmounted, detached = force_cleanup(root)
        if not keep_loop_nodes:
            removed_nodes = loop_nodes.remove()
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
    return ({"teardown_errors": problems, "mounts_left_in_driver_namespace": ns_mounts, "forced_unmounts": unmounted,
             "forced_detaches": detached, "loop_nodes_removed": removed_nodes},
            not left_mounts and not left_loops)
