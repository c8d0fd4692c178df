"""`crust demo`: a deferred volume, end to end, on the embedded defaults.

Runs `crust node` (driver, shim, proxy and a runtime handler, from one
config file) in a temporary root and plays kubelet with crust.kubelet:
kubelet finds the driver through the proxy's registration socket, and uses
its paths, call order and retries. The story: create a volume, stage it,
publish it for a pod with an fsGroup (deferred by the proxy's policy from a
StorageClass parameter), run the pod sandbox whose process writes data into
the volume, stats and expansion answered from inside the sandbox, a kubelet
restart (its volumes reconstructed and published again, nothing changed),
stop the sandbox, unpublish, publish again WITHOUT deferral and read the
data back on the host. Every step checks what it claims (mounts in
/proc/self/mountinfo, files on disk, sizes, groups); the host's mount table
is watched during the sandbox's life. Whatever happens, including Ctrl-C,
everything under the root is released.
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
from crust.kubelet import Kubelet, PersistentVolume, Pod
from crust.kubelet.cri import SyncError
from crust.sys import mount as sysmount
from crust.sys import netns
from crust.sys.sweep import release_under

MIB = 1024**2
FS_GROUP = 2000
# RuntimeClass -> the CRI runtime handler it names, per handler runtime:
# mountns pods run with runc through crust's OCI runtime; kata pods run in a
# microVM through crust's containerd shim (io.containerd.crust.v2).
RUNTIME_CLASSES = {"mountns": ("crust-runc", "crust-runc"), "kata": ("crust-microvm", "crust")}
SHIM_RUNTIME_TYPE = "io.containerd.crust.v2"
# The pod's process writes 1 MiB and its sha256 into the volume and says
# which group the file got.
WRITE_SCRIPT = ("head -c 1048576 /dev/urandom > /data/payload.bin && "
                "sha256sum /data/payload.bin | cut -d' ' -f1 > /data/payload.sha256 && sync && "
                "echo \"file-group: $(ls -ln /data/payload.bin | awk '{print $4}')\"")
# df's view of the volume from inside the sandbox, for the comparison with
# NodeGetVolumeStats (the last lines a sandbox prints; run through ExecSync
# under CRI).
DF_SCRIPT = ("echo \"df-bytes: $(df -P -B1 /data | tail -n 1)\" && "
             "echo \"df-inodes: $(df -P -i /data | tail -n 1)\"")
# Under CRI the container stays up (stats and expansion while it runs)
# until kubelet stops it: SIGTERM, and it exits 0.
CRI_SCRIPT = WRITE_SCRIPT + " && echo written && trap 'echo stopping; exit 0' TERM; sleep infinity & wait"
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
        except SyncError as exc:
            # kubelet's CRI side gave up: a failed step too, not a traceback.
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


class NodeProcess:
    """`crust node` with the demo's config, as a child process with its own log."""

    def __init__(self, root: Path, config: Path, ready_seconds: float):
        self.root, self.config, self.ready_seconds = root, config, ready_seconds
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.proc = subprocess.Popen([sys.executable, "-m", "crust", "node", "--config", str(self.config)],
                                     stdout=open(self.root / "node.out", "wb"), stderr=open(self.root / "node.log", "ab"))
        deadline = time.monotonic() + self.ready_seconds
        while time.monotonic() < deadline:
            _check(self.proc.poll() is None, f"crust node exited with {self.proc.returncode}; see node.log")
            out = (self.root / "node.out").read_text(errors="replace")
            if "every component is serving" in out:
                status = json.loads((self.root / "run" / "node" / "status.json").read_text())
                children = ", ".join(f"{c['name']} {c['pid']}" for c in status["children"])
                return f"pid {self.proc.pid}; children: {children}" + self._accelerator()
            time.sleep(0.05)
        raise StepFailed(f"crust node did not come up within {self.ready_seconds:g} s")

    def _accelerator(self) -> str:
        """The microVM handler logs the accelerator it chose, and why."""
        for line in (self.root / "node.log").read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("msg") == "accelerator":
                return f"; microVMs run with {entry.get('accel')} ({entry.get('reason')})"
        return ""

    def stop(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode if self.proc is not None else None


class Demo:
    """Plays kubelet (crust.kubelet) against `crust node`."""

    def __init__(self, root: Path, fs_type: str, runtime: str, timeline: Timeline, cri: bool = False):
        self.root = root
        self.fs_type = fs_type
        self.runtime = runtime
        # --cri: the pod is a real pod, started by containerd through CRI
        # with the RuntimeClass crust-runc (crust's OCI runtime) or, for
        # kata, crust-microvm (crust's shim, one microVM per pod).
        self.cri = cri
        self.runtime_class, self.runtime_handler = RUNTIME_CLASSES[runtime]
        self.containerd = None
        self.cri_runtime = None
        self.cri_image = None
        self.pod_sandbox_id = ""
        self.container_id = ""
        self.container_exit_code: int | None = None
        self.containerd_version = ""
        self.t = timeline
        self.node_id = "demo-node"
        self.run_dir = root / "run"
        self.state_dir = root / "state"
        self.kubelet = Kubelet(root / "kubelet", self.node_id, retry_seconds=30)
        self.pod = Pod(uid="0d3c2b1a-demo-pod-1", name="pod-1", fs_group=FS_GROUP, host_network=True,
                       runtime_class_name=self.runtime_class, termination_grace_period_seconds=10)
        # After the sandbox stopped, a pod whose volume is mounted on the
        # host reads the data back.
        self.reader = Pod(uid="0d3c2b1a-demo-reader", name="reader")
        self.pv: PersistentVolume | None = None
        self.node = NodeProcess(root, self._write_config(), ready_seconds=120 if runtime == "kata" else 60)
        self.handler_socket = self.run_dir / "handler.sock"
        self.handler_state = self.state_dir / ("kata-handler" if runtime == "kata" else "handler")
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

    def _write_config(self) -> Path:
        """The node config: everything under the demo's root; the StorageClass
        parameter crust.dev/defer defers; kubelet passes the fsGroup itself."""
        handler = {"runtime": self.runtime}
        if self.runtime == "kata":
            handler["kata"] = {"kataDir": str(self.run_dir / "kata-direct-volumes")}
        config = {
            "nodeId": self.node_id, "kubeletRoot": str(self.root / "kubelet"), "runDir": str(self.run_dir),
            "stateDir": str(self.state_dir), "driver": {"capacity": "20Gi"},
            "proxy": {"policy": {"deferral": {"storageClassParameters": {"crust.dev/defer": "true"},
                                              "fsGroupFromPod": False}}},
            "handler": handler,
            # The microVM handler may first probe KVM (up to 10 s, once per node).
            "supervisor": {"readyTimeoutSeconds": 90 if self.runtime == "kata" else 30},
        }
        path = self.root / "node.yaml"
        path.write_text(json.dumps(config, indent=1))
        return path

    # -- plumbing -----------------------------------------------------------------

    def cap(self) -> csi_pb2.VolumeCapability:
        return csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(fs_type=self.fs_type),
            access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))

    @property
    def ctl(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def target(self) -> Path:
        return self.kubelet.target_path(self.pod, self.pv)

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
        rsp = self.kubelet.volume_stats(self.pv, self.pod)
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
        the process log of a mount-namespace sandbox, the container's log
        under CRI."""
        if self.cri:
            if not self.container_id:
                return ""
            log_path = self.cri_runtime.container_status(self.container_id).log_path
            return Path(log_path).read_text(errors="replace") if log_path and Path(log_path).exists() else ""
        workdir = self.handler_state / "run" / "pod-1"
        path = workdir / ("console.log" if self.runtime == "kata" else "process.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def df_in_sandbox(self) -> dict[str, int]:
        """The last `df` lines the pod's process printed about /data; under
        CRI, df run in the container now, through ExecSync."""
        found: dict[str, int] = {}
        output = self.process_output()
        if self.cri:
            out = self.cri_runtime.exec_sync(self.container_id, ["/bin/sh", "-c", DF_SCRIPT])
            _check(out.exit_code == 0, f"df through ExecSync exited with {out.exit_code}: {out.stderr!r}")
            output = out.stdout.decode(errors="replace")
        for line in output.splitlines():
            for tag, keys in (("df-bytes:", ("bytes_total", "bytes_used", "bytes_available")),
                              ("df-inodes:", ("inodes_total", "inodes_used", "inodes_available"))):
                if tag in line:
                    fields = line.split(tag, 1)[1].split()
                    if len(fields) >= 4 and all(f.isdigit() for f in fields[1:4]):
                        found.update(zip(keys, map(int, fields[1:4])))
        return found

    def group_in_sandbox(self) -> str:
        """The group of the pod's file, as the pod's process saw it."""
        for line in self.process_output().splitlines():
            if "file-group:" in line:
                return line.split("file-group:", 1)[1].strip()
        return ""

    def write_bundle(self) -> Path:
        bundle = self.root / "bundle"
        (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
        script = WRITE_SCRIPT + " && " + DF_SCRIPT
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["/bin/sh", "-c", script], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
            "mounts": [{"destination": "/data", "source": str(self.target), "type": "bind", "options": ["rbind"]}],
        }, indent=1))
        return bundle

    # -- a real pod through CRI (--cri) -------------------------------------------------

    def start_containerd(self) -> str:
        """A private containerd (crust.kubelet.containerd) whose runtime is
        crust's against this node's handler (crust-runc: runc's shim with
        crust's OCI runtime; crust: crust's shim v2, a microVM per pod), and
        kubelet's CRI side connected to it."""
        from crust.kubelet import image as images
        from crust.kubelet.containerd import Containerd
        from crust.kubelet.cri import KubeletRuntime

        self.cri_image = images.build(self.root / "images")
        if self.runtime == "kata":
            how = f"containerd-shim-crust-v2 ({SHIM_RUNTIME_TYPE}) in front of the microVM handler"
            self.containerd = Containerd(
                self.root / "containerd", sandbox_image=self.cri_image.name,
                shim_runtimes={self.runtime_handler: SHIM_RUNTIME_TYPE},
                env={"CRUST_KATA_HANDLER_ENDPOINT": f"unix://{self.handler_socket}"})
        else:
            runtime = Path(sys.executable).parent / "crust-oci-runtime"
            runtime = runtime if runtime.exists() else Path(shutil.which("crust-oci-runtime") or runtime)
            how = f"runc shim with BinaryName {runtime.name}"
            self.containerd = Containerd(
                self.root / "containerd", sandbox_image=self.cri_image.name,
                runtimes={"runc": "", self.runtime_handler: str(runtime)},
                env={"CRUST_HANDLER_ENDPOINT": f"unix://{self.handler_socket}",
                     "CRUST_OCI_RUNTIME_STATE": str(self.root / "oci-runtime")})
        self.containerd.start()
        self.containerd.import_image(self.cri_image)
        self.cri_runtime = KubeletRuntime(self.kubelet, self.containerd.endpoint,
                                          runtime_classes={self.runtime_class: self.runtime_handler},
                                          cgroup_root=self.containerd.cgroup_root,
                                          pod_logs_dir=self.root / "pod-logs", retry_seconds=0)
        version = self.cri_runtime.connect()
        self.containerd_version = version.runtime_version
        return (f"containerd {version.runtime_version} (CRI {version.runtime_api_version}), RuntimeClass "
                f"{self.runtime_class} -> handler {self.runtime_handler}: {how}; image {self.cri_image.name} "
                "from busybox-static")

    def start_pod_cri(self) -> str:
        from crust.api import cri_pb2 as cri
        from crust.kubelet import Container, VolumeMount
        from crust.kubelet.cri import SyncError

        self.pod.volumes = {"data": self.pv}
        self.pod.containers = [Container("app", self.cri_image.name, command=["/bin/sh", "-c", CRI_SCRIPT],
                                         volume_mounts=[VolumeMount("data", "/data")])]
        try:
            self.pod_sandbox_id = self.cri_runtime.run_pod(self.pod)
        except SyncError as exc:
            raise StepFailed(str(exc)) from None
        calls = [c for c in self.cri_runtime.calls if c in ("RunPodSandbox", "ImageStatus", "CreateContainer",
                                                            "StartContainer")]
        self.sandbox_started = True
        self.container_id = self.cri_runtime.pod_status(self.pod).latest("app").id
        # A microVM under software emulation boots and writes in seconds, not milliseconds.
        wait = 120 if self.runtime == "kata" else 30
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            self.watch_host()
            status = self.cri_runtime.container_status(self.container_id)
            _check(status.state != cri.CONTAINER_EXITED, f"the container exited with {status.exit_code}: "
                   f"{self.process_output()[-500:]}")
            if "written" in self.process_output():
                group = self.group_in_sandbox()
                _check(group == str(FS_GROUP), f"the pod's file has group {group!r}, not the fsGroup {FS_GROUP}")
                where = ("by the microVM's guest kernel only" if self.runtime == "kata"
                         else "by runc in the container only")
                return (f"{', '.join(calls)}; sandbox {self.pod_sandbox_id[:13]}, container {self.container_id[:13]} wrote "
                        f"1 MiB + its sha256 to /data (mounted {where}); group {group}")
            time.sleep(0.05)
        raise StepFailed(f"the container did not write within {wait} s")

    def restart_containerd(self) -> str:
        from crust.api import cri_pb2 as cri

        self.watch_host()
        self.containerd.restart()
        status = self.cri_runtime.container_status(self.container_id)
        _check(status.state == cri.CONTAINER_RUNNING, "the container does not run after containerd's restart")
        df = self.df_in_sandbox()
        _check(df == self.stats(), f"after the restart, df {df} differs from NodeGetVolumeStats")
        return "containerd stopped and started again; the container runs on, df through ExecSync = stats"

    def stop_pod_cri(self) -> str:
        from crust.api import cri_pb2 as cri
        from crust.api import registry_pb2, registry_pb2_grpc

        self.watch_host()
        self.cri_runtime.kill_pod(self.pod)
        status = self.cri_runtime.container_status(self.container_id)
        _check(status.state == cri.CONTAINER_EXITED, "the container did not exit")
        self.container_exit_code = status.exit_code
        _check(status.exit_code == 0, f"the container exited with {status.exit_code}")
        with local_channel(f"unix://{self.run_dir / 'runtime' / 'proxy.sock'}") as channel:
            claims = registry_pb2_grpc.RegistryStub(channel).ListClaims(registry_pb2.ListClaimsRequest(), timeout=10)
        _check(not claims.claims, f"the claim was not released: {claims.claims}")
        self.cri_runtime.remove_pod(self.pod)
        self.sandbox_started = False
        return (f"StopContainer (SIGTERM): exit code {status.exit_code} in ContainerStatus; StopPodSandbox; the "
                "runtime's delete released the claim; RemoveContainer, RemovePodSandbox")

    def stop_containerd(self) -> None:
        if self.cri_runtime is not None:
            self.cri_runtime.close()
            self.cri_runtime = None
        if self.containerd is not None:
            self.containerd.close()
            self.containerd = None

    # -- the story ---------------------------------------------------------------------

    def play(self) -> None:
        t = self.t
        k = self.kubelet
        size = 320 * MIB if self.fs_type == "xfs" else 128 * MIB
        grown = size + 256 * MIB
        (self.root / "kubelet" / "plugins_registry").mkdir(parents=True)
        t.run("start crust node", self.node.start)
        if self.cri:
            t.run(f"start containerd (CRI, runtime {self.runtime_handler})", self.start_containerd)

        def register():
            name = k.register()
            return f"GetInfo: {name} at {k.endpoint} (the proxy); NodeGetInfo; NotifyRegistrationStatus(registered)"
        t.run("kubelet registers the driver", register)
        self.channel = local_channel(k.endpoint)

        def create():
            vol = self.ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
                name="pvc-demo", capacity_range=csi_pb2.CapacityRange(required_bytes=size),
                volume_capabilities=[self.cap()], parameters={"crust.dev/defer": "true"}), timeout=60).volume
            self.volume_id = vol.volume_id
            self.pv = PersistentVolume(name="pv-demo", volume_handle=vol.volume_id,
                                       attributes=dict(vol.volume_context), fs_type=self.fs_type)
            return f"{vol.volume_id}, {format_size(vol.capacity_bytes)}, StorageClass parameter crust.dev/defer=true"
        t.run("CreateVolume", create)

        def attach():
            rsp = self.ctl.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(
                volume_id=self.volume_id, node_id=self.node_id, volume_capability=self.cap()), timeout=30)
            self.pv.publish_context = dict(rsp.publish_context)
            return f"to {self.node_id}"
        t.run("ControllerPublishVolume", attach)

        def stage():
            self.staged = True
            k.retried(k.mount_device, self.pv, self.pod)
            staging = k.staging_path(self.pv)
            _check(sysmount.at(str(staging)) is None, "the staging path was mounted")
            return (f"at {staging.relative_to(k.root)}: block device staged and formatted {self.fs_type}; "
                    "nothing mounted on the host")
        t.run("NodeStageVolume", stage)

        def publish_deferred():
            self.published = True
            k.retried(k.set_up, self.pv, self.pod)
            entry = self.run_dir / "volumes" / hashlib.sha256(str(self.target).encode()).hexdigest() / "mountInfo.json"
            _check(entry.exists(), "the proxy did not defer (no mountInfo.json)")
            info = json.loads(entry.read_text())
            self.device = info["device"]
            st = os.stat(self.device)
            self.device_majmin = (os.major(st.st_rdev), os.minor(st.st_rdev))
            placeholder = sysmount.at(str(self.target))
            _check(placeholder is not None and placeholder.fs_type == "tmpfs" and placeholder.readonly,
                   "the target is not the read-only placeholder")
            _check(not self.host_mounts_of_device(), "the file system is mounted on the host")
            _check(info.get("metadata", {}).get("fsGroup") == str(FS_GROUP), "the fsGroup is not in the description")
            _check(not k.chowned, "kubelet had to change ownership itself")
            return (f"deferred: {self.device} ({self.device_majmin[0]}:{self.device_majmin[1]}) described in "
                    f"mountInfo.json with fsGroup {FS_GROUP} (volume_mount_group)")
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
                    group = self.group_in_sandbox()
                    _check(group == str(FS_GROUP), f"the pod's file has group {group!r}, not the fsGroup {FS_GROUP}")
                    return (f"pod process wrote 1 MiB + its sha256 to /data inside {self.runtime} sandbox pid "
                            f"{info['pid']}; its file has the pod's fsGroup {group}")
                time.sleep(0.05)
            raise StepFailed("the pod process did not finish within 30 s")
        if self.cri:
            t.run("kubelet starts the pod through CRI (writes data)", self.start_pod_cri)
        else:
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
                capacity = k.expand(self.pv, self.pod, grown)
            except grpc.RpcError as exc:
                # The host's kernel here refuses ext4 online growth; a guest's does not.
                if self.fs_type == "ext4" and self.runtime == "mountns" \
                        and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    return ("ext4 online growth refused on this host (grows when next mounted): "
                            + (exc.details() or "").rsplit(": ", 1)[-1])
                raise
            return f"grown online inside the sandbox to {format_size(capacity)}"
        t.run("NodeExpandVolume", expand)

        def stats_after():
            self.watch_host()
            self.size_after = self.stats_total()
            if self.fs_type == "xfs" or self.runtime == "kata":
                _check(self.size_after > self.size_before, "the file system did not grow in the sandbox")
            return f"{format_size(self.size_after)} ({self.size_after} bytes)"
        t.run("NodeGetVolumeStats (after expand)", stats_after)

        def kubelet_restart():
            self.watch_host()
            entry = self.run_dir / "volumes" / hashlib.sha256(str(self.target).encode()).hexdigest() / "mountInfo.json"
            before = (entry.read_bytes(), sorted(m.mount_point for m in sysmount.mounts()
                                                 if m.mount_point.startswith(str(k.root) + "/")))
            found = k.restart({self.pod.uid: (self.pv, self.pod)})
            _check([(uid, mounted) for uid, _, mounted in found] == [(self.pod.uid, True)],
                   f"kubelet did not find its volume mounted: {found}")
            after = (entry.read_bytes(), sorted(m.mount_point for m in sysmount.mounts()
                                                if m.mount_point.startswith(str(k.root) + "/")))
            _check(after[1] == before[1], f"the second stage and publish changed the mounts: {before[1]} -> {after[1]}")
            _check(after[0] == before[0], "the second publish rewrote mountInfo.json: "
                   f"{before[0].decode(errors='replace')} -> {after[0].decode(errors='replace')}")
            return "volume found from vol_data.json, target still mounted (placeholder); stage + publish again: OK, nothing changed"
        t.run("kubelet restart", kubelet_restart)

        def stop_sandbox():
            self.watch_host()
            out = self.sandbox("delete", "pod-1")
            _check(out.returncode == 0, out.stderr.strip())
            self.sandbox_started = False
            return "process stopped, volume unmounted in the sandbox, claim released"
        if self.cri:
            t.run("containerd restarts under the pod", self.restart_containerd)
            t.run("kubelet stops and removes the pod", self.stop_pod_cri)
        else:
            t.run("stop pod sandbox", stop_sandbox)

        def unpublish():
            k.retried(k.tear_down, self.pv, self.pod)
            self.published = False
            _check(not any((self.run_dir / "volumes").iterdir()), "the watched directory still has an entry")
            _check(not self.target.parent.exists(), "kubelet's pod volume directory is still there")
            return "placeholder, mountInfo.json and kubelet's pod directory removed"
        t.run("NodeUnpublishVolume", unpublish)

        def publish_host():
            # Not a kubelet step: the same volume published without the
            # deferral parameter, so the host mounts it and reads the data.
            target = k.target_path(self.reader, self.pv)
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            context = {key: v for key, v in self.pv.attributes.items() if key != "crust.dev/defer"}
            k.node("NodePublishVolume", csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id, staging_target_path=str(k.staging_path(self.pv)), target_path=str(target),
                volume_capability=self.cap(), volume_context=context))
            self.published = self.host_published = True
            data = (target / "payload.bin").read_bytes()
            want = (target / "payload.sha256").read_text().strip()
            self.data_verified = hashlib.sha256(data).hexdigest() == want and len(data) == MIB
            _check(self.data_verified, "the data written in the sandbox does not read back on the host")
            if self.fs_type == "ext4" and self.runtime == "mountns":
                self.size_after = os.statvfs(target).f_blocks * os.statvfs(target).f_frsize
                _check(self.size_after > self.size_before, "the ext4 file system did not grow offline")
            return f"host mount (no deferral) reads the 1 MiB back, sha256 {want[:12]} matches"
        t.run("NodePublishVolume (on the host)", publish_host)

        def cleanup():
            k.retried(k.tear_down, self.pv, self.reader)
            self.published = False
            k.retried(k.unmount_device, self.pv)
            self.staged = False
            self.ctl.ControllerUnpublishVolume(csi_pb2.ControllerUnpublishVolumeRequest(
                volume_id=self.volume_id, node_id=self.node_id), timeout=30)
            self.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=self.volume_id), timeout=60)
            self.volume_id = ""
            return "unpublished, unstaged, detached, deleted"
        t.run("NodeUnpublish + NodeUnstage + DeleteVolume", cleanup)

        if self.cri:
            def stop_containerd():
                forced = self.containerd.close()
                self.containerd = None
                self.cri_runtime.close()
                self.cri_runtime = None
                _check(not forced, f"containerd's close had to clean up: {forced}")
                return "containerd stopped; its directory, shims, mounts and cgroups removed"
            t.run("stop containerd", stop_containerd)

        def stop_node():
            if self.channel is not None:
                self.channel.close()
                self.channel = None
            code = self.node.stop()
            _check(code == 0, f"crust node exited with {code}")
            leftover = list((k.root / "plugins_registry").iterdir())
            _check(not leftover, f"the registration socket is still there: {leftover}")
            return "SIGTERM to crust node: handler, proxy, shim, driver stopped; exit 0; registration socket removed"
        t.run("stop crust node", stop_node)

    def abort(self) -> None:
        """Best-effort release after a failure or Ctrl-C, through the daemons."""
        k = self.kubelet
        if self.cri:
            # Its pods go first: their delete releases the claims through the handler.
            self.stop_containerd()
            self.sandbox_started = False
        try:
            if self.sandbox_started:
                self.sandbox("delete", "pod-1")
            if k.endpoint and self.pv is not None:
                if self.published:
                    for pod in (self.pod, self.reader):
                        if k.target_path(pod, self.pv).exists():
                            k.tear_down(self.pv, pod)
                if self.staged:
                    k.unmount_device(self.pv)
        except (grpc.RpcError, subprocess.TimeoutExpired, OSError, ValueError):
            pass
        if self.channel is not None:
            self.channel.close()
        self.node.stop()


def run_demo(fs_type: str = "xfs", runtime: str = "mountns", as_json: bool = False, keep: bool = False,
             cri: bool = False) -> int:
    if os.geteuid() != 0:
        print("crust demo: needs root (loop devices, mounts, namespaces)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="crust-demo-"))
    timeline = Timeline(as_json)
    demo = Demo(root, fs_type, runtime, timeline, cri=cri)
    ok = False
    if not as_json:
        where = (f"a real pod started by containerd through CRI (RuntimeClass {demo.runtime_class})" if cri
                 else f"a {runtime} sandbox")
        print(f"crust demo: a deferred {fs_type} volume, mounted only inside {where}, in {root}\n")
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
        containerd_version = demo.containerd_version
        demo.stop_containerd()
        _kill_sandboxes(root)
        netns.sweep(demo.handler_state / "run", keep=set())
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
            **({"cri": {"containerd": containerd_version, "runtime_handler": demo.runtime_handler,
                        "runtime_class": demo.runtime_class,
                        "pod_sandbox_id": demo.pod_sandbox_id,
                        "container_exit_code": demo.container_exit_code}} if cri else {}),
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
    own = str(root) + "/state/"
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
