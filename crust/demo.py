"""`crust demo`: a deferred volume, end to end, on the embedded defaults.

Starts driver, shim, proxy and a runtime handler in a temporary root and
plays kubelet over the proxy's CSI socket: create, stage, publish with
deferral (decided by the proxy's policy from a StorageClass parameter),
run a pod sandbox whose process writes data into the volume, stats and
expansion answered from inside the sandbox, stop the sandbox, unpublish,
publish again WITHOUT deferral and read the data back on the host. Every
step checks what it claims (mounts in /proc/self/mountinfo, files on disk,
sizes); the host's mount table is watched during the sandbox's life.
Whatever happens, including Ctrl-C, everything under the root is released.
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
from crust.common.channel import local_channel
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


class Daemon:
    """One crust daemon of the demo, as a child process with its own log."""

    def __init__(self, name: str, argv: list[str], socket: Path, root: Path, ready_seconds: float = 20):
        self.name, self.argv, self.socket, self.root = name, argv, socket, root
        self.ready_seconds = ready_seconds
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    def start(self) -> str:
        self.proc = subprocess.Popen([sys.executable, "-m", "crust", *self.argv], stdout=subprocess.DEVNULL,
                                     stderr=open(self.log_path, "ab"))
        deadline = time.monotonic() + self.ready_seconds
        while time.monotonic() < deadline:
            _check(self.proc.poll() is None, f"{self.name} exited with {self.proc.returncode}; see {self.name}.log")
            if self.socket.exists():
                return f"pid {self.proc.pid}, {self.socket.name}" + self._accelerator()
            time.sleep(0.02)
        raise StepFailed(f"{self.name} did not come up within {self.ready_seconds:g} s")

    def _accelerator(self) -> str:
        """The microVM handler logs the accelerator it chose, and why."""
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("msg") == "accelerator":
                return f"; microVMs run with {entry.get('accel')} ({entry.get('reason')})"
        return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Demo:
    """Plays kubelet against driver -> shim -> proxy, with a runtime handler."""

    def __init__(self, root: Path, fs_type: str, runtime: str, timeline: Timeline):
        self.root = root
        self.fs_type = fs_type
        self.runtime = runtime
        self.t = timeline
        self.kubelet = root / "kubelet"
        self.staging = self.kubelet / "plugins" / "kubernetes.io" / "csi" / "pv-demo" / "globalmount"
        self.target = self.kubelet / "pods" / "pod-1" / "volumes" / "kubernetes.io~csi" / "pv-demo" / "mount"
        self.run_dir = root / "run"
        self.node_id = "demo-node"
        sock = {n: root / f"{n}.sock" for n in ("driver", "shim", "kubelet-csi", "handler")}
        proxy_sock = self.run_dir / "proxy.sock"
        policy = root / "policy.yaml"
        self.daemons = [
            Daemon("driver", ["driver", "--endpoint", f"unix://{sock['driver']}", "--node-id", self.node_id,
                              "--data-dir", str(root / "data"), "--capacity", "20Gi"], sock["driver"], root),
            Daemon("shim", ["shim", "--endpoint", f"unix://{sock['shim']}",
                            "--backend-endpoint", f"unix://{sock['driver']}", "--proxy-endpoint", f"unix://{proxy_sock}",
                            "--state-dir", str(root / "shim")], sock["shim"], root),
            Daemon("proxy", ["proxy", "--csi-endpoint", f"unix://{sock['kubelet-csi']}",
                             "--plugin-endpoint", f"unix://{sock['shim']}", "--runtime-endpoint", f"unix://{proxy_sock}",
                             "--volumes-dir", str(self.run_dir / "volumes"), "--state-dir", str(root / "proxy"),
                             "--kubelet-root", str(self.kubelet), "--policy", str(policy)],
                   sock["kubelet-csi"], root),
            Daemon("handler", (["kata", "handler"] if runtime == "kata" else ["handler"]) + [
                "--endpoint", f"unix://{sock['handler']}", "--proxy-endpoint", f"unix://{proxy_sock}",
                "--volumes-dir", str(self.run_dir / "volumes"), "--state-dir", str(root / "handler")]
                + (["--kata-dir", str(self.run_dir / "kata-direct-volumes")] if runtime == "kata" else []),
                # The microVM handler may first probe KVM (up to 10 s, once per node).
                sock["handler"], root, ready_seconds=60 if runtime == "kata" else 20),
        ]
        self.kubelet_socket = sock["kubelet-csi"]
        self.handler_socket = sock["handler"]
        self.policy = policy
        self.channel: grpc.Channel | None = None
        self.volume_id = ""
        self.device = ""
        self.device_majmin = (0, 0)
        self.sandbox_started = False
        self.published = self.staged = self.host_published = False
        self.size_before = 0
        self.size_after = 0
        self.data_verified = False
        self.host_mounted_during_sandbox = False
        self.guest_df: dict[str, int] = {}
        self.stats_seen: dict[str, int] = {}
        self.stats_match_df = False

    # -- plumbing -----------------------------------------------------------------

    def cap(self) -> csi_pb2.VolumeCapability:
        return csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(fs_type=self.fs_type),
            access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))

    @property
    def ctl(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    def sandbox(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "crust", "sandbox", "--handler-endpoint",
                               f"unix://{self.handler_socket}", *args], capture_output=True, text=True, timeout=120)

    def host_mounts_of_device(self) -> list[str]:
        return [m.mount_point for m in sysmount.of_device(*self.device_majmin)] if self.device_majmin[0] else []

    def watch_host(self) -> None:
        """Called during the sandbox's life: the host must never mount the file system."""
        if self.host_mounts_of_device():
            self.host_mounted_during_sandbox = True

    def stats(self) -> dict[str, int]:
        rsp = self.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=self.volume_id, volume_path=str(self.target)), timeout=30)
        _check(not rsp.volume_condition.abnormal, f"condition abnormal: {rsp.volume_condition.message}")
        by_unit = {u.unit: u for u in rsp.usage}
        _check(csi_pb2.VolumeUsage.BYTES in by_unit and csi_pb2.VolumeUsage.INODES in by_unit,
               "no byte or inode usage in the answer")
        b, i = by_unit[csi_pb2.VolumeUsage.BYTES], by_unit[csi_pb2.VolumeUsage.INODES]
        return {"bytes_total": b.total, "bytes_used": b.used, "bytes_available": b.available,
                "inodes_total": i.total, "inodes_used": i.used, "inodes_available": i.available}

    def stats_total(self) -> int:
        return self.stats()["bytes_total"]

    def process_output(self) -> str:
        """What the pod's process printed: the guest console of a microVM,
        the process log of a mount-namespace sandbox."""
        workdir = self.root / "handler" / "run" / "pod-1"
        path = workdir / ("console.log" if self.runtime == "kata" else "process.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def df_in_sandbox(self) -> dict[str, int]:
        """The last `df` lines the pod's process printed about /data."""
        found: dict[str, int] = {}
        for line in self.process_output().splitlines():
            for tag, keys in (("df-bytes:", ("bytes_total", "bytes_used", "bytes_available")),
                              ("df-inodes:", ("inodes_total", "inodes_used", "inodes_available"))):
                if tag in line:
                    fields = line.split(tag, 1)[1].split()
                    if len(fields) >= 4 and all(f.isdigit() for f in fields[1:4]):
                        found.update(zip(keys, map(int, fields[1:4])))
        return found

    def write_bundle(self) -> Path:
        bundle = self.root / "bundle"
        (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
        # The last lines are df's view from inside the sandbox, printed after
        # the last write, for the comparison with NodeGetVolumeStats.
        script = ("head -c 1048576 /dev/urandom > /data/payload.bin && "
                  "sha256sum /data/payload.bin | cut -d' ' -f1 > /data/payload.sha256 && sync && "
                  "echo \"df-bytes: $(df -P -B1 /data | tail -n 1)\" && "
                  "echo \"df-inodes: $(df -P -i /data | tail -n 1)\"")
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["/bin/sh", "-c", script], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
            "mounts": [{"destination": "/data", "source": str(self.target), "type": "bind", "options": ["rbind"]}],
        }, indent=1))
        return bundle

    # -- the story ---------------------------------------------------------------------

    def play(self) -> None:
        t = self.t
        size = 320 * MIB if self.fs_type == "xfs" else 128 * MIB
        grown = size + 256 * MIB
        self.kubelet.mkdir(parents=True)
        self.run_dir.mkdir(mode=0o700)
        # The StorageClass parameter crust.dev/defer reaches volume_context;
        # the proxy's policy defers on it, as it would for today's kubelet.
        self.policy.write_text('deferral:\n  storageClassParameters:\n    crust.dev/defer: "true"\n')
        for daemon in self.daemons:
            t.run(f"start crust {daemon.name}", daemon.start)
        self.channel = local_channel(str(self.kubelet_socket))
        time.sleep(0.3)  # the handler registers with the proxy

        def create():
            vol = self.ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
                name="pvc-demo", capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                volume_capabilities=[self.cap()], parameters={"crust.dev/defer": "true"}), timeout=60).volume
            self.volume_id = vol.volume_id
            self.volume_context = dict(vol.volume_context)
            return f"{vol.volume_id}, {format_size(vol.capacity_bytes)}, StorageClass parameter crust.dev/defer=true"
        t.run("CreateVolume", create)

        t.run("ControllerPublishVolume", lambda: self.ctl.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(volume_id=self.volume_id, node_id=self.node_id,
                                                   volume_capability=self.cap()), timeout=30) and f"to {self.node_id}")

        def stage():
            self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging), volume_capability=self.cap(),
                volume_context=self.volume_context), timeout=120)
            self.staged = True
            _check(sysmount.at(str(self.staging)) is None, "the staging path was mounted")
            return f"block device staged and formatted {self.fs_type}; nothing mounted on the host"
        t.run("NodeStageVolume", stage)

        def publish_deferred():
            rsp = self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging), target_path=str(self.target),
                volume_capability=self.cap(), volume_context=self.volume_context), timeout=60)
            self.published = True
            _check(rsp.HasField("deferred_mount"), "the proxy did not defer")
            d = rsp.deferred_mount
            self.device, self.device_majmin = d.device, (d.device_major, d.device_minor)
            entry = sysmount.at(str(self.target))
            _check(entry is not None and entry.fs_type == "tmpfs" and entry.readonly,
                   "the target is not the read-only placeholder")
            _check(not self.host_mounts_of_device(), "the file system is mounted on the host")
            return f"deferred: {d.device} ({d.device_major}:{d.device_minor}) described in mountInfo.json"
        t.run("NodePublishVolume (deferred)", publish_deferred)

        def run_sandbox():
            out = self.sandbox("run", "--bundle", str(self.write_bundle()), "--id", "pod-1", "--json")
            _check(out.returncode == 0, out.stderr.strip())
            self.sandbox_started = True
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.watch_host()
                info = json.loads(self.sandbox("list", "--json").stdout)[0]
                if info.get("exited"):
                    _check(info.get("exit_code", 0) == 0, f"the pod process exited with {info.get('exit_code')}")
                    return f"pod process wrote 1 MiB + its sha256 to /data inside {self.runtime} sandbox pid {info['pid']}"
                time.sleep(0.05)
            raise StepFailed("the pod process did not finish within 30 s")
        t.run("run pod sandbox (writes data)", run_sandbox)

        def stats_before():
            self.watch_host()
            self.stats_seen = self.stats()
            self.size_before = self.stats_seen["bytes_total"]
            self.guest_df = self.df_in_sandbox()
            _check(len(self.guest_df) == 6, f"the pod's process printed no df of /data: {self.guest_df}")
            # Nothing writes between the process's df and this call: the
            # numbers must be the same, field by field.
            self.stats_match_df = self.stats_seen == self.guest_df
            _check(self.stats_match_df, f"stats {self.stats_seen} differ from df in the sandbox {self.guest_df}")
            return (f"{format_size(self.size_before)} ({self.size_before} bytes), measured inside the sandbox; "
                    "bytes and inodes equal df's there")
        t.run("NodeGetVolumeStats", stats_before)

        t.run("ControllerExpandVolume", lambda: "device grown to " + format_size(self.ctl.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(volume_id=self.volume_id,
                                                  capacity_range=csi_pb2.CapacityRange(required_bytes=grown)),
            timeout=60).capacity_bytes))

        def expand():
            self.watch_host()
            try:
                rsp = self.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
                    volume_id=self.volume_id, volume_path=str(self.target),
                    capacity_range=csi_pb2.CapacityRange(required_bytes=grown)), timeout=120)
            except grpc.RpcError as exc:
                # The host's kernel here refuses ext4 online growth; a guest's does not.
                if self.fs_type == "ext4" and self.runtime == "mountns" \
                        and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    return "ext4 online growth refused on this host (grows when next mounted)"
                raise
            return f"grown online inside the sandbox to {format_size(rsp.capacity_bytes)}"
        t.run("NodeExpandVolume", expand)

        def stats_after():
            self.watch_host()
            self.size_after = self.stats_total()
            if self.fs_type == "xfs" or self.runtime == "kata":
                _check(self.size_after > self.size_before, "the file system did not grow in the sandbox")
            return f"{format_size(self.size_after)} ({self.size_after} bytes)"
        t.run("NodeGetVolumeStats (after expand)", stats_after)

        def stop_sandbox():
            self.watch_host()
            out = self.sandbox("delete", "pod-1")
            _check(out.returncode == 0, out.stderr.strip())
            self.sandbox_started = False
            return "process stopped, volume unmounted in the sandbox, claim released"
        t.run("stop pod sandbox", stop_sandbox)

        def unpublish():
            self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=self.volume_id, target_path=str(self.target)), timeout=60)
            self.published = False
            _check(not any((self.run_dir / "volumes").iterdir()), "the watched directory still has an entry")
            return "placeholder and mountInfo.json removed"
        t.run("NodeUnpublishVolume", unpublish)

        def publish_host():
            self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging), target_path=str(self.target),
                volume_capability=self.cap()), timeout=60)
            self.published = self.host_published = True
            data = (self.target / "payload.bin").read_bytes()
            want = (self.target / "payload.sha256").read_text().strip()
            self.data_verified = hashlib.sha256(data).hexdigest() == want and len(data) == MIB
            _check(self.data_verified, "the data written in the sandbox does not read back on the host")
            if self.fs_type == "ext4" and self.runtime == "mountns":
                self.size_after = os.statvfs(self.target).f_blocks * os.statvfs(self.target).f_frsize
                _check(self.size_after > self.size_before, "the ext4 file system did not grow offline")
            return f"host mount (no deferral) reads the 1 MiB back, sha256 {want[:12]} matches"
        t.run("NodePublishVolume (on the host)", publish_host)

        def cleanup():
            self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=self.volume_id, target_path=str(self.target)), timeout=60)
            self.published = False
            self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(self.staging)), timeout=60)
            self.staged = False
            self.ctl.ControllerUnpublishVolume(csi_pb2.ControllerUnpublishVolumeRequest(
                volume_id=self.volume_id, node_id=self.node_id), timeout=30)
            self.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=self.volume_id), timeout=60)
            self.volume_id = ""
            return "unpublished, unstaged, detached, deleted"
        t.run("NodeUnpublish + NodeUnstage + DeleteVolume", cleanup)

        def stop_all():
            if self.channel is not None:
                self.channel.close()
                self.channel = None
            for daemon in reversed(self.daemons):
                daemon.stop()
                _check(daemon.proc.returncode == 0, f"{daemon.name} exited with {daemon.proc.returncode}")
            return "SIGTERM to handler, proxy, shim, driver: all exited 0"
        t.run("stop daemons", stop_all)

    def abort(self) -> None:
        """Best-effort release after a failure or Ctrl-C, through the daemons."""
        try:
            if self.sandbox_started:
                self.sandbox("delete", "pod-1")
            if self.channel is not None and self.volume_id:
                if self.published:
                    self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
                        volume_id=self.volume_id, target_path=str(self.target)), timeout=30)
                if self.staged:
                    self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
                        volume_id=self.volume_id, staging_target_path=str(self.staging)), timeout=30)
        except (grpc.RpcError, subprocess.TimeoutExpired, OSError):
            pass
        if self.channel is not None:
            self.channel.close()
        for daemon in reversed(self.daemons):
            daemon.stop()


def run_demo(fs_type: str = "xfs", runtime: str = "mountns", as_json: bool = False, keep: bool = False) -> int:
    if os.geteuid() != 0:
        print("crust demo: needs root (loop devices, mounts, namespaces)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="crust-demo-"))
    timeline = Timeline(as_json)
    demo = Demo(root, fs_type, runtime, timeline)
    ok = False
    if not as_json:
        print(f"crust demo: a deferred {fs_type} volume, mounted only inside a {runtime} sandbox, in {root}\n")
    try:
        demo.play()
        ok = all(s.ok for s in timeline.steps) and demo.data_verified and demo.stats_match_df \
            and not demo.host_mounted_during_sandbox
    except StepFailed:
        ok = False
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
    finally:
        if not ok:
            demo.abort()
        _kill_sandboxes(root)
        leftovers = release_under(root)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps({
            "steps": [{"name": s.name, "ms": s.ms, "ok": s.ok, "detail": s.detail} for s in timeline.steps],
            "runtime": runtime,
            "fs_type": fs_type,
            "host_mounted_during_sandbox": demo.host_mounted_during_sandbox,
            "data_verified": demo.data_verified,
            "size_before": demo.size_before,
            "size_after": demo.size_after,
            "guest_df": demo.guest_df,
            "stats": demo.stats_seen,
            "stats_match_df": demo.stats_match_df,
            "leftovers_cleaned": leftovers,
            "ok": ok,
        }, indent=1))
    else:
        total = sum(s.ms for s in timeline.steps)
        print(f"\n{'every step held' if ok else 'FAILED'}: {len(timeline.steps)} steps in {total / 1e3:.2f} s; "
              f"host mounted the file system during the sandbox: {'YES' if demo.host_mounted_during_sandbox else 'no'}; "
              f"data verified: {'yes' if demo.data_verified else 'NO'}"
              + (f"; cleaned up after a failure: {', '.join(leftovers)}" if leftovers else ""))
    return 0 if ok else 1


def _kill_sandboxes(root: Path) -> None:
    """Sandboxes of this demo that outlived their handler: mount-namespace
    holders with mounts under the demo's handler state, and QEMU processes
    whose sockets live under the root."""
    own = str(root) + "/handler/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[:2] == [b"sleep", b"infinity"]:
                mine = any(line.split(" ")[4].startswith(own) for line in (entry / "mountinfo").read_text().splitlines()
                           if len(line.split(" ")) > 4)
            else:
                mine = argv[0].endswith(b"qemu-system-x86_64") and own.encode() in b" ".join(argv)
            if mine:
                os.kill(int(entry.name), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
