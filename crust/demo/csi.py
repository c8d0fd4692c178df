"""The story every variant of `crust demo` plays (told in crust.demo):
Demo plays kubelet (crust.kubelet) against `crust node`, step by step,
over CSI.

The pod here is the default variant's: a sandbox of the node's handler run
with `crust sandbox`, whose process's output is read from the handler's
state. Under --cri the pod's steps are crust.demo.cri's; under --runtime
kata the handler is the microVM handler (crust.demo.microvm).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common.channel import local_channel
from crust.common.units import format_size
from crust.demo import microvm
from crust.demo.cri import CriPod
from crust.demo.node import NodeProcess
from crust.demo.pod import DF_SCRIPT, FS_GROUP, WRITE_SCRIPT
from crust.demo.steps import StepFailed, Timeline, check
from crust.kubelet import Kubelet, PersistentVolume, Pod
from crust.sys import mount as sysmount

MIB = 1024**2
# RuntimeClass -> the CRI runtime handler it names, per handler runtime:
# mountns pods run with runc through crust's OCI runtime; kata pods run in a
# microVM through crust's containerd shim (io.containerd.crust.v2).
RUNTIME_CLASSES = {"mountns": ("crust-runc", "crust-runc"), "kata": ("crust-microvm", "crust")}
AccessMode = csi_pb2.VolumeCapability.AccessMode


class Demo(CriPod):
    """Plays kubelet (crust.kubelet) against `crust node`."""

    def __init__(self, root: Path, fs_type: str, runtime: str, timeline: Timeline, cri: str = ""):
        self.root = root
        self.fs_type = fs_type
        self.runtime = runtime
        # --cri: the pod is a real pod, started by containerd or CRI-O through CRI
        # with the RuntimeClass crust-runc (crust's OCI runtime) or, for
        # kata, crust-microvm (crust's shim, one microVM per pod).
        super().__init__(cri)
        self.runtime_class, self.runtime_handler = RUNTIME_CLASSES[runtime]
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
        handler = microvm.handler_config(self.run_dir) if self.runtime == "kata" else {"runtime": self.runtime}
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
        check(not rsp.volume_condition.abnormal, f"condition abnormal: {rsp.volume_condition.message}")
        by_unit = {u.unit: u for u in rsp.usage}
        check(csi_pb2.VolumeUsage.BYTES in by_unit and csi_pb2.VolumeUsage.INODES in by_unit,
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
            return self.container_output()
        workdir = self.handler_state / "run" / "pod-1"
        path = workdir / ("console.log" if self.runtime == "kata" else "process.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def df_in_sandbox(self) -> dict[str, int]:
        """The last `df` lines the pod's process printed about /data; under
        CRI, df run in the container now, through ExecSync."""
        found: dict[str, int] = {}
        output = self.process_output()
        if self.cri:
            output = self.df_through_exec()
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

    # -- the story ---------------------------------------------------------------------

    def play(self) -> None:
        t = self.t
        k = self.kubelet
        size = 320 * MIB if self.fs_type == "xfs" else 128 * MIB
        grown = size + 256 * MIB
        (self.root / "kubelet" / "plugins_registry").mkdir(parents=True)
        t.run("start crust node", self.node.start)
        if self.cri:
            t.run(f"start {self.cri_name} (CRI, runtime {self.runtime_handler})", self.start_cri)

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
            check(sysmount.at(str(staging)) is None, "the staging path was mounted")
            return (f"at {staging.relative_to(k.root)}: block device staged and formatted {self.fs_type}; "
                    "nothing mounted on the host")
        t.run("NodeStageVolume", stage)

        def publish_deferred():
            self.published = True
            k.retried(k.set_up, self.pv, self.pod)
            entry = self.run_dir / "volumes" / hashlib.sha256(str(self.target).encode()).hexdigest() / "mountInfo.json"
            check(entry.exists(), "the proxy did not defer (no mountInfo.json)")
            info = json.loads(entry.read_text())
            self.device = info["device"]
            st = os.stat(self.device)
            self.device_majmin = (os.major(st.st_rdev), os.minor(st.st_rdev))
            placeholder = sysmount.at(str(self.target))
            check(placeholder is not None and placeholder.fs_type == "tmpfs" and placeholder.readonly,
                  "the target is not the read-only placeholder")
            check(not self.host_mounts_of_device(), "the file system is mounted on the host")
            check(info.get("metadata", {}).get("fsGroup") == str(FS_GROUP), "the fsGroup is not in the description")
            check(not k.chowned, "kubelet had to change ownership itself")
            return (f"deferred: {self.device} ({self.device_majmin[0]}:{self.device_majmin[1]}) described in "
                    f"mountInfo.json with fsGroup {FS_GROUP} (volume_mount_group)")
        t.run("NodePublishVolume (deferred)", publish_deferred)

        def run_sandbox():
            out = self.sandbox("run", "--bundle", str(self.write_bundle()), "--id", "pod-1", "--json")
            check(out.returncode == 0, out.stderr.strip())
            self.sandbox_started = True
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                self.watch_host()
                info = json.loads(self.sandbox("list", "--json").stdout)[0]
                if info.get("exited"):
                    check(info.get("exit_code", 0) == 0, f"the pod process exited with {info.get('exit_code')}")
                    group = self.group_in_sandbox()
                    check(group == str(FS_GROUP), f"the pod's file has group {group!r}, not the fsGroup {FS_GROUP}")
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
            check(len(self.guest_df) == 6, f"the pod's process printed no df of /data: {self.guest_df}")
            # Nothing writes between the process's df and this call: the
            # numbers must be the same, field by field.
            self.stats_match_df = self.stats_seen == self.guest_df
            check(self.stats_match_df, f"stats {self.stats_seen} differ from df in the sandbox {self.guest_df}")
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
                check(self.size_after > self.size_before, "the file system did not grow in the sandbox")
            return f"{format_size(self.size_after)} ({self.size_after} bytes)"
        t.run("NodeGetVolumeStats (after expand)", stats_after)

        def kubelet_restart():
            self.watch_host()
            entry = self.run_dir / "volumes" / hashlib.sha256(str(self.target).encode()).hexdigest() / "mountInfo.json"
            before = (entry.read_bytes(), sorted(m.mount_point for m in sysmount.mounts()
                                                 if m.mount_point.startswith(str(k.root) + "/")))
            found = k.restart({self.pod.uid: (self.pv, self.pod)})
            check([(uid, mounted) for uid, _, mounted in found] == [(self.pod.uid, True)],
                  f"kubelet did not find its volume mounted: {found}")
            after = (entry.read_bytes(), sorted(m.mount_point for m in sysmount.mounts()
                                                if m.mount_point.startswith(str(k.root) + "/")))
            check(after[1] == before[1], f"the second stage and publish changed the mounts: {before[1]} -> {after[1]}")
            check(after[0] == before[0], "the second publish rewrote mountInfo.json: "
                  f"{before[0].decode(errors='replace')} -> {after[0].decode(errors='replace')}")
            return "volume found from vol_data.json, target still mounted (placeholder); stage + publish again: OK, nothing changed"
        t.run("kubelet restart", kubelet_restart)

        def stop_sandbox():
            self.watch_host()
            out = self.sandbox("delete", "pod-1")
            check(out.returncode == 0, out.stderr.strip())
            self.sandbox_started = False
            return "process stopped, volume unmounted in the sandbox, claim released"
        if self.cri:
            t.run(f"{self.cri_name} restarts under the pod", self.restart_cri)
            t.run("kubelet stops and removes the pod", self.stop_pod_cri)
        else:
            t.run("stop pod sandbox", stop_sandbox)

        def unpublish():
            k.retried(k.tear_down, self.pv, self.pod)
            self.published = False
            check(not any((self.run_dir / "volumes").iterdir()), "the watched directory still has an entry")
            check(not self.target.parent.exists(), "kubelet's pod volume directory is still there")
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
            check(self.data_verified, "the data written in the sandbox does not read back on the host")
            if self.fs_type == "ext4" and self.runtime == "mountns":
                self.size_after = os.statvfs(target).f_blocks * os.statvfs(target).f_frsize
                check(self.size_after > self.size_before, "the ext4 file system did not grow offline")
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
            def stop_cri():
                forced = self.close_cri()
                check(not forced, f"{self.cri_name}'s close had to clean up: {forced}")
                return f"{self.cri_name} stopped; its directory, shims, mounts and cgroups removed"
            t.run(f"stop {self.cri_name}", stop_cri)

        def stop_node():
            if self.channel is not None:
                self.channel.close()
                self.channel = None
            code = self.node.stop()
            check(code == 0, f"crust node exited with {code}")
            leftover = list((k.root / "plugins_registry").iterdir())
            check(not leftover, f"the registration socket is still there: {leftover}")
            return "SIGTERM to crust node: handler, proxy, shim, driver stopped; exit 0; registration socket removed"
        t.run("stop crust node", stop_node)

    def abort(self) -> None:
        """Best-effort release after a failure or Ctrl-C, through the daemons."""
        k = self.kubelet
        if self.cri:
            # Its pods go first: their delete releases the claims through the handler.
            self.close_cri()
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

