"""`crust demo`: one volume's whole life on the embedded defaults.

Starts `crust driver` (loop backend) in a temporary root and plays the CO
over the driver's real unix socket, printing each step with its time. Every
step checks what it claims (bytes on disk, mounts in /proc/self/mountinfo,
sizes seen by statvfs). Whatever happens, including Ctrl-C, the temporary
root is cleaned: the volume is released, the driver stopped, every mount
and loop device under the root removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common.units import format_size
from crust.sys import mount as sysmount
from crust.sys.sweep import release_under

MIB = 1024**2
AccessMode = csi_pb2.VolumeCapability.AccessMode


class StepFailed(Exception):
    pass


@dataclass
class Step:
    name: str
    ms: float
    ok: bool
    detail: str = ""


@dataclass
class Timeline:
    as_json: bool
    steps: list[Step] = field(default_factory=list)

    def run(self, name: str, action):
        started = time.perf_counter()
        try:
            detail = action() or ""
        except grpc.RpcError as exc:
            self._record(name, started, False, f"{exc.code().name}: {exc.details()}")
            raise StepFailed(name) from None
        except StepFailed as exc:
            self._record(name, started, False, str(exc))
            raise StepFailed(name) from None
        except OSError as exc:
            self._record(name, started, False, str(exc))
            raise StepFailed(name) from None
        self._record(name, started, True, detail)
        return detail

    def _record(self, name: str, started: float, ok: bool, detail: str) -> None:
        step = Step(name, round((time.perf_counter() - started) * 1e3, 2), ok, detail)
        self.steps.append(step)
        if not self.as_json:
            mark = "ok  " if ok else "FAIL"
            print(f"{step.ms:9.1f} ms  {mark} {name:<34} {detail}", flush=True)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise StepFailed(message)


def _contains(path: Path, needle: bytes) -> bool:
    """Search a sparse file for needle, reading only its data extents."""
    fd = os.open(path, os.O_RDONLY)
    try:
        end = os.fstat(fd).st_size
        offset = 0
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # no data after offset
                return False
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            if needle in os.pread(fd, stop - start, start):
                return True
            offset = stop
        return False
    finally:
        os.close(fd)


class Demo:
    def __init__(self, root: Path, fs_type: str, timeline: Timeline):
        self.root = root
        self.fs_type = fs_type
        self.t = timeline
        self.socket = root / "csi.sock"
        self.staging = root / "kubelet" / "staging" / "pv-demo"
        self.target = root / "kubelet" / "pods" / "pod-1" / "volumes" / "pv-demo" / "mount"
        self.restore_staging = root / "kubelet" / "staging" / "pv-restore"
        self.restore_target = root / "kubelet" / "pods" / "pod-2" / "volumes" / "pv-restore" / "mount"
        self.proc: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None
        self.node_id = "demo-node"
        self.volume_id = ""
        self.snapshot_id = ""
        self.restore_id = ""
        self.payload = os.urandom(1 * MIB)
        self.size_before = 0
        self.size_after = 0
        self.data_verified = False

    # -- plumbing -----------------------------------------------------------------

    def cap(self) -> csi_pb2.VolumeCapability:
        return csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(fs_type=self.fs_type),
            access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))

    def start_driver(self) -> str:
        log = open(self.root / "driver.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "crust", "driver", "--endpoint", f"unix://{self.socket}",
             "--node-id", self.node_id, "--data-dir", str(self.root / "data"), "--capacity", "20Gi"],
            stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            _check(self.proc.poll() is None, f"driver exited with {self.proc.returncode}; see driver.log")
            if self.socket.exists():
                self.channel = grpc.insecure_channel(f"unix://{self.socket}")
                try:
                    if csi_pb2_grpc.IdentityStub(self.channel).Probe(csi_pb2.ProbeRequest(), timeout=2).ready.value:
                        info = csi_pb2_grpc.IdentityStub(self.channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest())
                        return f"{info.name} {info.vendor_version} on {self.socket.name}, pid {self.proc.pid}"
                except grpc.RpcError:
                    pass
                self.channel.close()
                self.channel = None
            time.sleep(0.05)
        raise StepFailed("driver did not become ready within 20 s")

    def stop_driver(self) -> str:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None or self.proc.poll() is not None:
            return "not running"
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(20)
        _check(code == 0, f"driver exited with {code}")
        _check(not self.socket.exists(), "driver left its socket behind")
        return "SIGTERM, exit 0, socket removed"

    @property
    def ctl(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    def backing_file(self, volume_id: str) -> Path:
        return self.root / "data" / "pools" / self.node_id / "volumes" / f"{volume_id}.img"

    def stats_bytes(self, path: Path) -> int:
        rsp = self.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=self.volume_id, volume_path=str(path)), timeout=30)
        by_unit = {u.unit: u for u in rsp.usage}
        total = by_unit[csi_pb2.VolumeUsage.BYTES].total
        _check(not rsp.volume_condition.abnormal, f"condition abnormal: {rsp.volume_condition.message}")
        _check(abs(total - os.statvfs(path).f_blocks * os.statvfs(path).f_frsize) == 0,
               "stats disagree with statvfs of the target")
        return total

    def stage_and_publish(self, volume_id: str, staging: Path, target: Path) -> None:
        self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), volume_capability=self.cap()), timeout=120)
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=self.cap()), timeout=60)

    def unpublish_and_unstage(self, volume_id: str, staging: Path, target: Path) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=str(target)), timeout=60)
        self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging)), timeout=60)

    # -- the story --------------------------------------------------------------------

    def play(self) -> None:
        t = self.t
        size = 320 * MIB if self.fs_type == "xfs" else 128 * MIB
        grown = size + 256 * MIB
        t.run("start crust driver", self.start_driver)

        def create():
            vol = self.ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
                name="pvc-demo", capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                volume_capabilities=[self.cap()]), timeout=60).volume
            self.volume_id = vol.volume_id
            _check(self.backing_file(vol.volume_id).stat().st_size == size, "backing file has the wrong size")
            return f"{vol.volume_id}, {format_size(vol.capacity_bytes)}, sparse backing file"
        t.run("CreateVolume", create)

        t.run("ControllerPublishVolume", lambda: self.ctl.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(volume_id=self.volume_id, node_id=self.node_id,
                                                   volume_capability=self.cap()), timeout=30) and f"to {self.node_id}")

        def stage():
            self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging), volume_capability=self.cap()),
                timeout=120)
            entry = sysmount.at(str(self.staging))
            _check(entry is not None and entry.fs_type == self.fs_type, "staging path is not mounted")
            return f"{entry.source} formatted {self.fs_type}, mounted at staging path"
        t.run("NodeStageVolume", stage)

        def publish():
            self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging), target_path=str(self.target),
                volume_capability=self.cap()), timeout=60)
            _check(sysmount.at(str(self.target)) is not None, "target is not mounted")
            return "bind mount at the pod's target path"
        t.run("NodePublishVolume", publish)

        def write():
            path = self.target / "payload.bin"
            with open(path, "wb") as f:
                f.write(self.payload)
                f.flush()
                os.fsync(f.fileno())
            return f"1 MiB written, sha256 {hashlib.sha256(self.payload).hexdigest()[:12]}"
        t.run("pod writes data", write)

        def stats_before():
            self.size_before = self.stats_bytes(self.target)
            return f"file system size {format_size(self.size_before)} ({self.size_before} bytes)"
        t.run("NodeGetVolumeStats", stats_before)

        t.run("ControllerExpandVolume", lambda: "backing file grown to " + format_size(self.ctl.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(volume_id=self.volume_id,
                                                  capacity_range=csi_pb2.CapacityRange(required_bytes=grown)),
            timeout=60).capacity_bytes))

        if self.fs_type == "xfs":
            t.run("NodeExpandVolume (online)", lambda: "xfs grown while mounted, to " + format_size(
                self.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
                    volume_id=self.volume_id, volume_path=str(self.target),
                    capacity_range=csi_pb2.CapacityRange(required_bytes=grown)), timeout=120).capacity_bytes))
        else:
            def refused():
                try:
                    self.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
                        volume_id=self.volume_id, volume_path=str(self.target),
                        capacity_range=csi_pb2.CapacityRange(required_bytes=grown)), timeout=120)
                except grpc.RpcError as exc:
                    _check(exc.code() == grpc.StatusCode.FAILED_PRECONDITION, f"unexpected {exc.code().name}")
                    return "refused online by this kernel (FAILED_PRECONDITION); grows offline at next stage"
                return "grown online"
            t.run("NodeExpandVolume (online)", refused)
            t.run("unpublish + unstage + stage + publish", lambda: (
                self.unpublish_and_unstage(self.volume_id, self.staging, self.target),
                self.stage_and_publish(self.volume_id, self.staging, self.target)) and "ext4 grown offline at stage")

        def stats_after():
            self.size_after = self.stats_bytes(self.target)
            _check(self.size_after > self.size_before, "the file system did not grow")
            return f"file system size {format_size(self.size_after)} ({self.size_after} bytes)"
        t.run("NodeGetVolumeStats (after expand)", stats_after)

        def snapshot():
            snap = self.ctl.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
                name="snap-demo", source_volume_id=self.volume_id), timeout=120).snapshot
            self.snapshot_id = snap.snapshot_id
            return f"{snap.snapshot_id}, ready={snap.ready_to_use}"
        t.run("CreateSnapshot", snapshot)

        def restore():
            vol = self.ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
                name="pvc-restore", volume_capabilities=[self.cap()],
                volume_content_source=csi_pb2.VolumeContentSource(
                    snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=self.snapshot_id))),
                timeout=120).volume
            self.restore_id = vol.volume_id
            self.stage_and_publish(vol.volume_id, self.restore_staging, self.restore_target)
            data = (self.restore_target / "payload.bin").read_bytes()
            _check(data == self.payload, "restored volume does not hold the written data")
            self.unpublish_and_unstage(vol.volume_id, self.restore_staging, self.restore_target)
            self.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id), timeout=60)
            self.restore_id = ""
            return "new volume from the snapshot holds the same 1 MiB; then deleted"
        t.run("restore snapshot and read back", restore)

        def unpublish():
            self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=self.volume_id, target_path=str(self.target)), timeout=60)
            _check(not self.target.exists(), "target path left behind")
            return "target unmounted and removed"
        t.run("NodeUnpublishVolume", unpublish)

        def unstage():
            self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging)), timeout=60)
            _check(sysmount.at(str(self.staging)) is None, "staging path still mounted")
            from crust.sys import loop
            _check(not loop.devices_for(self.backing_file(self.volume_id)), "loop device still attached")
            return "unmounted, loop device detached"
        t.run("NodeUnstageVolume", unstage)

        def verify_on_disk():
            # The bytes the pod wrote are in the backing file, read with no mount at all.
            self.data_verified = _contains(self.backing_file(self.volume_id), self.payload[:4096])
            _check(self.data_verified, "payload not found in the backing file")
            return "payload found in the backing file"
        t.run("data is on disk", verify_on_disk)

        t.run("ControllerUnpublishVolume", lambda: self.ctl.ControllerUnpublishVolume(
            csi_pb2.ControllerUnpublishVolumeRequest(volume_id=self.volume_id, node_id=self.node_id),
            timeout=30) and "detached from the node")
        t.run("DeleteSnapshot", lambda: self.ctl.DeleteSnapshot(
            csi_pb2.DeleteSnapshotRequest(snapshot_id=self.snapshot_id), timeout=30) and self.snapshot_id)

        def delete():
            self.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=self.volume_id), timeout=60)
            _check(not self.backing_file(self.volume_id).exists(), "backing file left behind")
            self.volume_id = ""
            return "backing file removed"
        t.run("DeleteVolume", delete)
        t.run("stop crust driver", self.stop_driver)


def run_demo(fs_type: str = "xfs", as_json: bool = False, keep: bool = False) -> int:
    if os.geteuid() != 0:
        print("crust demo: needs root (loop devices and mounts)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="crust-demo-"))
    timeline = Timeline(as_json)
    demo = Demo(root, fs_type, timeline)
    ok = False
    if not as_json:
        print(f"crust demo: one {fs_type} volume through its whole life, in {root}\n")
    try:
        demo.play()
        ok = all(s.ok for s in timeline.steps)
    except StepFailed:
        ok = False
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        ok = False
    finally:
        try:
            demo.stop_driver()
        except (StepFailed, subprocess.TimeoutExpired, OSError):
            if demo.proc and demo.proc.poll() is None:
                demo.proc.kill()
        leftovers = release_under(root)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps({
            "steps": [{"name": s.name, "ms": s.ms, "ok": s.ok, "detail": s.detail} for s in timeline.steps],
            "fs_type": fs_type,
            "data_verified": demo.data_verified,
            "size_before": demo.size_before,
            "size_after": demo.size_after,
            "leftovers_cleaned": leftovers,
            "ok": ok,
        }, indent=1))
    else:
        total = sum(s.ms for s in timeline.steps)
        print(f"\n{'every step held' if ok else 'FAILED'}: {len(timeline.steps)} steps in {total / 1e3:.2f} s"
              + (f"; cleaned up after a failure: {', '.join(leftovers)}" if leftovers else ""))
    return 0 if ok else 1
