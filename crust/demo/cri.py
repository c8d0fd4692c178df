"""`crust demo --cri`: the pod is a real pod, started through CRI by a
private containerd (`--cri`, `--cri containerd`) or CRI-O (`--cri crio`,
crust.demo.crio) with kubelet's CRI side (crust.kubelet.cri), under the
RuntimeClass crust-runc (crust's OCI runtime in runc's place) or, with
--runtime kata, crust-microvm (crust's shim v2, a microVM per pod; see
crust.demo.microvm). The story is the same (crust.demo.csi): its pod steps
are these."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from crust.common.channel import local_channel
from crust.demo import microvm
from crust.demo.pod import DF_SCRIPT, FS_GROUP, WRITE_SCRIPT
from crust.demo.steps import StepFailed, check

# Under CRI the container stays up (stats and expansion while it runs)
# until kubelet stops it: SIGTERM, and it exits 0.
CRI_SCRIPT = WRITE_SCRIPT + " && echo written && trap 'echo stopping; exit 0' TERM; sleep infinity & wait"


# What `--cri` names -> how the CRI daemon calls itself in the steps.
CRI_DAEMONS = {"containerd": "containerd", "crio": "CRI-O"}
SHIM_BINARY = "containerd-shim-crust-v2"


class CriPod:
    """The pod steps under CRI, mixed into crust.demo.csi.Demo (whose
    kubelet, volume and handler they use); `cri` "" (no CRI), only
    stop_cri() is called, and finds nothing to stop."""

    def __init__(self, cri: str):
        self.cri = cri
        self.cri_name = CRI_DAEMONS.get(cri, "")
        self.cri_daemon = None
        self.cri_runtime = None
        self.cri_image = None
        self.pod_sandbox_id = ""
        self.container_id = ""
        self.container_exit_code: int | None = None
        self.cri_version = ""

    def container_output(self) -> str:
        """What the container printed: its log."""
        if not self.container_id:
            return ""
        log_path = self.cri_runtime.container_status(self.container_id).log_path
        return Path(log_path).read_text(errors="replace") if log_path and Path(log_path).exists() else ""

    def df_through_exec(self) -> str:
        """df of /data run in the container now, through ExecSync: what it printed."""
        out = self.cri_runtime.exec_sync(self.container_id, ["/bin/sh", "-c", DF_SCRIPT])
        check(out.exit_code == 0, f"df through ExecSync exited with {out.exit_code}: {out.stderr!r}")
        return out.stdout.decode(errors="replace")

    def start_cri(self) -> str:
        """A private containerd or CRI-O whose runtime is crust's against this
        node's handler (crust-runc: crust's OCI runtime in runc's place;
        crust: crust's shim v2, a microVM per pod), and kubelet's CRI side
        connected to it."""
        from crust.kubelet import image as images
        from crust.kubelet.cri import KubeletRuntime

        self.cri_image = images.build(self.root / "images")
        if self.runtime == "kata":
            env = {"CRUST_KATA_HANDLER_ENDPOINT": f"unix://{self.handler_socket}"}
        else:
            from crust.oci_runtime import frontend

            # crust-runc, the front end the CRI daemon runs: runc for every
            # call but those that need crust, which it hands to the Python runtime.
            runtime = self.root / "crust-runc"
            frontend.build(runtime)
            env = {"CRUST_HANDLER_ENDPOINT": f"unix://{self.handler_socket}",
                   "CRUST_OCI_RUNTIME_STATE": str(self.root / "oci-runtime")}
        if self.cri == "crio":
            from crust.demo.crio import DemoCrio

            vm_settings = {}
            if self.runtime == "kata":
                shim = shutil.which(SHIM_BINARY) or str(Path(sys.executable).parent / SHIM_BINARY)
                runtimes, vm_runtimes = {"runc": ""}, {self.runtime_handler: shim}
                shim_settings = self.root / "containerd-shim-crust.toml"
                shim_settings.write_text(f'handler_endpoint = "unix://{self.handler_socket}"\n')
                vm_settings = {self.runtime_handler: {"runtime_config_path": str(shim_settings)}}
                how = f"runtime_type vm, {SHIM_BINARY} in front of the microVM handler"
            else:
                runtimes, vm_runtimes = {"runc": "", self.runtime_handler: str(runtime)}, {}
                how = f"runtime_type oci, conmon running {runtime.name} (then crust's Python runtime where crust has work)"
            # Kept before it starts, so that a start that fails half-way is closed too.
            self.cri_daemon = DemoCrio(self.root / "cri-o", self.cri_image, runtimes, vm_runtimes, env, vm_settings)
            self.cri_daemon.start()
            pulled = "pulled from a local registry"
        else:
            from crust.kubelet.containerd import Containerd

            if self.runtime == "kata":
                self.cri_daemon, how = microvm.shim_containerd(self.root / "containerd", self.cri_image.name,
                                                               self.runtime_handler, env)
            else:
                how = f"runc shim with BinaryName {runtime.name} (then crust's Python runtime where crust has work)"
                self.cri_daemon = Containerd(self.root / "containerd", sandbox_image=self.cri_image.name,
                                             runtimes={"runc": "", self.runtime_handler: str(runtime)}, env=env)
            self.cri_daemon.start()
            self.cri_daemon.import_image(self.cri_image)
            pulled = "imported"
        self.cri_runtime = KubeletRuntime(self.kubelet, self.cri_daemon.endpoint,
                                          runtime_classes={self.runtime_class: self.runtime_handler},
                                          cgroup_root=self.cri_daemon.cgroup_root,
                                          pod_logs_dir=self.root / "pod-logs", retry_seconds=0)
        version = self.cri_runtime.connect()
        self.cri_version = f"{version.runtime_name} {version.runtime_version}"
        return (f"{self.cri_version} (CRI {version.runtime_api_version}), RuntimeClass {self.runtime_class} -> "
                f"handler {self.runtime_handler}: {how}; image {self.cri_image.name} from busybox-static, {pulled}")

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
            check(status.state != cri.CONTAINER_EXITED, f"the container exited with {status.exit_code}: "
                  f"{self.process_output()[-500:]}")
            if "written" in self.process_output():
                group = self.group_in_sandbox()
                check(group == str(FS_GROUP), f"the pod's file has group {group!r}, not the fsGroup {FS_GROUP}")
                where = ("by the microVM's guest kernel only" if self.runtime == "kata"
                         else "by runc in the container only")
                return (f"{', '.join(calls)}; sandbox {self.pod_sandbox_id[:13]}, container {self.container_id[:13]} wrote "
                        f"1 MiB + its sha256 to /data (mounted {where}); group {group}")
            time.sleep(0.05)
        raise StepFailed(f"the container did not write within {wait} s")

    def restart_cri(self) -> str:
        from crust.api import cri_pb2 as cri

        self.watch_host()
        self.cri_daemon.restart()
        status = self.cri_runtime.container_status(self.container_id)
        check(status.state == cri.CONTAINER_RUNNING, f"the container does not run after {self.cri_name}'s restart")
        df = self.df_in_sandbox()
        check(df == self.stats(), f"after the restart, df {df} differs from NodeGetVolumeStats")
        return f"{self.cri_name} stopped and started again; the container runs on, df through ExecSync = stats"

    def stop_pod_cri(self) -> str:
        from crust.api import cri_pb2 as cri
        from crust.api import registry_pb2, registry_pb2_grpc

        self.watch_host()
        self.cri_runtime.kill_pod(self.pod)
        status = self.cri_runtime.container_status(self.container_id)
        check(status.state == cri.CONTAINER_EXITED, "the container did not exit")
        self.container_exit_code = status.exit_code
        check(status.exit_code == 0, f"the container exited with {status.exit_code}")
        self.cri_runtime.remove_pod(self.pod)
        self.sandbox_started = False
        with local_channel(f"unix://{self.run_dir / 'runtime' / 'proxy.sock'}") as channel:
            claims = registry_pb2_grpc.RegistryStub(channel).ListClaims(registry_pb2.ListClaimsRequest(), timeout=10)
        check(not claims.claims, f"the claim was not released: {claims.claims}")
        return (f"StopContainer (SIGTERM): exit code {status.exit_code} in ContainerStatus; StopPodSandbox; "
                "RemoveContainer, RemovePodSandbox; the pod's claim released")

    def close_cri(self) -> list[str]:
        """Kubelet's CRI side and the daemon closed; what the daemon's close
        had to clean up by force."""
        forced = []
        if self.cri_runtime is not None:
            self.cri_runtime.close()
            self.cri_runtime = None
        if self.cri_daemon is not None:
            forced = self.cri_daemon.close()
            self.cri_daemon = None
        return forced
