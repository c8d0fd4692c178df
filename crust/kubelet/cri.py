"""Kubelet's side of the CRI, replayed call for call (the demo and the tests).

No kubelet runs here, so this module does what kubelet's runtime manager
(pkg/kubelet/kuberuntime) does against a CRI runtime, taken from its public
source:

- at start: Version("v1") (the runtime must speak CRI v1), RuntimeConfig
  (the cgroup driver; a runtime that does not implement it leaves kubelet's
  own setting, cgroupfs here), Status (RuntimeReady must hold; without
  NetworkReady only host-network pods run, as kubelet's syncPod refuses the
  others with "network is not ready");
- SyncPod (kuberuntime_manager.go), for a pod whose volumes the volume
  managers have set up (crust.kubelet.csi for CSI volumes,
  crust.kubelet.volumes for the others): computePodActions
  (crust.kubelet.pod_actions) from the pod's status (ListPodSandbox and
  PodSandboxStatus, ListContainers and ContainerStatus, by the pod-uid
  label); kill the pod when its sandbox must
  be made again (its init containers removed, so they run again), or when
  an init container failed and the restart policy is Never (the pod has
  failed); RunPodSandbox with generatePodSandboxConfig's config and the
  RuntimeClass's handler, after making the pod's log directory;
  PodSandboxStatus; generatePodSandboxConfig again; then the init
  containers to start, then the containers, each through startContainer:
  EnsureImageExists (ImageStatus; PullImage only when the pull policy
  asks), the restart count, generateContainerConfig, then CreateContainer
  and StartContainer;
- init containers (computeInitContainerActions, with sidecars): a new
  sandbox starts only the first; later syncs (kubelet's PLEG sees a
  container change, here: the pod worker polls) start the next once the
  one before exited 0, or, for a sidecar (restartPolicy Always), once it
  runs; the containers start in the sync that finds every init container
  done (sidecars running). A failed init container runs again unless the
  restart policy is Never; an exited sidecar is restarted. The pod worker
  (run_pod) syncs until the containers have started;
- generatePodSandboxConfig (kuberuntime_sandbox.go, _linux.go): metadata
  with the attempt, the pod's labels plus kubelet's pod labels, its
  annotations, the DNS config (a host-network pod gets the node's
  resolv.conf), no hostname for a host-network pod, the log directory
  <logs>/<namespace>_<name>_<uid>, the pod's cgroup (cgroupfs naming:
  <cgroup root>/kubepods/besteffort/pod<uid> for a pod without resources),
  the sandbox security context (runtime/default seccomp, the namespace
  options of NamespacesForPod, run-as user and group, the fsGroup then the
  supplemental groups), the sandbox's resources (2 CPU shares, a 100 ms CFS
  period, no quota, and as memory limit the containers' limits summed, an
  init container's when larger: 0 for a pod without limits) and an empty
  overhead;
- generateContainerConfig (kuberuntime_container.go, _linux.go,
  security_context.go, kubelet_pods.go makeMounts): metadata with the
  restart count as attempt, the image's id and the image as written,
  command and args with $(VAR) expanded, the container's environment,
  kubelet's container labels and annotations (hash, restart count,
  termination message path and policy, grace period), the log path
  <name>/<restart count>.log, the mounts: each volume mount with the
  volume's path as host_path (a CSI volume: kubelet's target path),
  read-only when the mount or the PV says so, no SELinux relabel (not
  enabled here), its propagation; /etc/hosts from the pod's directory (a
  host-network pod's copy of the node's); the termination-message file; the
  Linux resources (BestEffort: OOM score adjustment 1000, a zero limit for
  every huge page size) and the security context (the run-as user from the
  image when the pod sets none, the namespace options, the pod's fsGroup as
  the first supplemental group, no_new_privs from allowPrivilegeEscalation,
  the capabilities to add and drop as written,
  the default masked and read-only /proc paths, seccomp unconfined without
  a profile);
- makeMounts for the other volumes: the volume's directory (a hostPath's
  own path), read-only for configMap, secret, projected and downwardAPI
  volumes whatever the mount says, a subPath as its bind under
  pods/<uid>/volume-subpaths (crust.kubelet.volumes); a subPath of a CSI
  volume is refused (kubelet binds it from the host's mount, which a
  deferred volume never has);
- killPod (killPodWithSyncResult): StopContainer for every running
  container, concurrently, with the pod's termination grace period (at
  least 2 s); sidecars last, in reverse order, each once the containers
  and the sidecars after it stopped, with what is left of the grace period
  (at least 2 s); then StopPodSandbox for every sandbox of the pod;
- garbage collection of a deleted pod: the container's log file, then
  RemoveContainer for each container, then RemovePodSandbox, then the pod's
  cgroup (the pod container manager's cleanup);
- exec probes: ExecSync with the probe's timeout;
- retries: no CRI call is retried in place; a failed SyncPod runs again
  after the pod worker's backoff (10 s), until it succeeds (here: until
  retry_seconds pass); an exited container the restart policy restarts
  waits out the crash-loop back-off (10 s after it finished, doubling up to
  5 min).

The configs of generatePodSandboxConfig and generateContainerConfig are
crust.kubelet.cri_config's.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from crust.api import cri_pb2 as cri
from crust.api import cri_pb2_grpc
from crust.common.channel import local_channel
from crust.kubelet.cri_config import (
    CONTAINER_RESTART_COUNT,
    POD_UID_LABEL,
    GeneratedConfigs,
    SyncError,
)
from crust.kubelet.csi import Kubelet
from crust.kubelet.pod import Container, Pod
from crust.kubelet.pod_actions import (
    PodStatus,
    compute_pod_actions,
    regular_container_created,
)
from crust.kubelet.volumes import VolumeManager

# Kubelet's --runtime-request-timeout (2 min) bounds every CRI call.
RUNTIME_REQUEST_TIMEOUT = 120.0
# The largest CRI answer kubelet takes (its CRI client's receive limit): an
# ExecSync's output beyond it fails the call rather than arrive cut.
CRI_MESSAGE_MAX = 16 * 1024 * 1024
# The pod worker retries a failed sync after 10 s (workerBackOffPeriod).
SYNC_BACKOFF = 10.0
# An exited container is restarted after 10 s, doubling to 5 min
# (the kubelet's crash-loop back-off).
CRASH_BACKOFF = 10.0
CRASH_BACKOFF_MAX = 300.0
# How often the pod worker looks at a pod whose init containers run
# (kubelet's PLEG relists every second; a test need not wait that long).
RELIST_PERIOD = 0.05
# killContainer never gives less than 2 s (minimumGracePeriodInSeconds).
MINIMUM_GRACE_PERIOD = 2
CGROUP_FS = Path("/sys/fs/cgroup")


class PodFailed(SyncError):
    """An init container failed and the pod's restart policy is Never: the
    pod is over (phase Failed); kubelet killed it and syncs it no more."""

    def __init__(self, container: str, exit_code: int):
        self.container, self.exit_code = container, exit_code
        super().__init__("InitContainer", f'init container "{container}" exited with {exit_code}: the pod failed '
                         "(restartPolicy Never)")


class KubeletRuntime(GeneratedConfigs):
    """Kubelet's runtime manager against one CRI endpoint.

    `kubelet` (crust.kubelet.csi.Kubelet) owns the node's root directory:
    pod directories and the CSI volumes' target paths come from it, the
    other volumes' paths from `volumes` (made on the same root unless given)."""

    def __init__(self, kubelet: Kubelet, endpoint: str, *, runtime_classes: dict[str, str] | None = None,
                 cgroup_root: str = "/", pod_logs_dir: Path | None = None,
                 resolv_conf: Path = Path("/etc/resolv.conf"), sync_backoff: float = SYNC_BACKOFF,
                 crash_backoff: float = CRASH_BACKOFF, retry_seconds: float = 60.0,
                 volumes: VolumeManager | None = None):
        self.kubelet = kubelet
        self.volumes = volumes or VolumeManager(kubelet.root)
        self.endpoint = endpoint
        # RuntimeClass name -> its handler, as kubelet's runtimeClassManager reads them.
        self.runtime_classes = dict(runtime_classes or {})
        self.cgroup_root = "/" + cgroup_root.strip("/") if cgroup_root.strip("/") else ""
        self.pod_logs_dir = pod_logs_dir or kubelet.root.parent / "pod-logs"
        self.resolv_conf = resolv_conf
        self.sync_backoff = sync_backoff
        self.crash_backoff = crash_backoff
        # (pod uid, container name) -> the back-off before its next restart.
        self.backoff: dict[tuple[str, str], float] = {}
        self.retry_seconds = retry_seconds
        self.channel = local_channel(endpoint, max_receive_bytes=CRI_MESSAGE_MAX)
        self.runtime = cri_pb2_grpc.RuntimeServiceStub(self.channel)
        self.images = cri_pb2_grpc.ImageServiceStub(self.channel)
        self.calls: list[str] = []
        # (method, milliseconds) of every call, in order.
        self.timings: list[tuple[str, float]] = []
        self.runtime_version: cri.VersionResponse | None = None
        self.network_ready = False

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request, timeout: float = RUNTIME_REQUEST_TIMEOUT):
        self.calls.append(method)
        stub = self.images if method in ("ImageStatus", "PullImage") else self.runtime
        started = time.perf_counter()
        try:
            return getattr(stub, method)(request, timeout=timeout)
        finally:
            self.timings.append((method, (time.perf_counter() - started) * 1e3))

    # -- kubelet's start ------------------------------------------------------------------

    def connect(self) -> cri.VersionResponse:
        version = self._call("Version", cri.VersionRequest(version="v1"))
        if version.runtime_api_version != "v1":
            raise SyncError("Version", f"the runtime speaks CRI {version.runtime_api_version!r}, kubelet needs v1")
        try:
            self._call("RuntimeConfig", cri.RuntimeConfigRequest())
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
        self.runtime_status()
        self.runtime_version = version
        return version

    def runtime_status(self) -> cri.StatusResponse:
        status = self._call("Status", cri.StatusRequest())
        conditions = {c.type: c for c in status.status.conditions}
        ready = conditions.get("RuntimeReady")
        if ready is None or not ready.status:
            raise SyncError("Status", f"container runtime is down: {ready.message if ready else 'no RuntimeReady'}")
        network = conditions.get("NetworkReady")
        self.network_ready = bool(network and network.status)
        return status

    # -- paths and names ---------------------------------------------------------------------

    def pod_dir(self, pod: Pod) -> Path:
        return self.kubelet.root / "pods" / pod.uid

    def pod_log_dir(self, pod: Pod) -> Path:
        return self.pod_logs_dir / f"{pod.namespace}_{pod.name}_{pod.uid}"

    def pod_cgroup(self, pod: Pod) -> str:
        """The pod's cgroup with the cgroupfs driver; BestEffort (no resources)."""
        return f"{self.cgroup_root}/kubepods/besteffort/pod{pod.uid}"

    def handler_of(self, pod: Pod) -> str:
        if pod.runtime_class_name is None:
            return ""
        if pod.runtime_class_name not in self.runtime_classes:
            raise SyncError("RunPodSandbox", f'RuntimeClass "{pod.runtime_class_name}" not found')
        return self.runtime_classes[pod.runtime_class_name]

    # -- images ---------------------------------------------------------------------------------

    def ensure_image(self, pod: Pod, container: Container, sandbox_config: cri.PodSandboxConfig) -> str:
        """EnsureImageExists: the image's id (pulled only if the policy asks)."""
        image = container.image if ":" in container.image.rsplit("/", 1)[-1] or "@" in container.image \
            else container.image + ":latest"
        present = self._call("ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=image))).image
        if present.id and container.image_pull_policy != "Always":
            return present.id
        if container.image_pull_policy == "Never":
            raise SyncError("EnsureImageExists", f'Container image "{image}" is not present with pull policy of Never')
        try:
            return self._call("PullImage", cri.PullImageRequest(image=cri.ImageSpec(image=image),
                                                                sandbox_config=sandbox_config)).image_ref
        except grpc.RpcError as exc:
            raise SyncError("PullImage", exc.details() or "", exc.code()) from None

    def _image_user(self, image: str) -> tuple[int | None, str]:
        """getImageUser: the image's uid, or its user name; root when neither."""
        status = self._call("ImageStatus", cri.ImageStatusRequest(image=cri.ImageSpec(image=image))).image
        if status.HasField("uid"):
            return status.uid.value, ""
        if status.username:
            return None, status.username
        return 0, ""

    # -- status -----------------------------------------------------------------------------------

    def pod_status(self, pod: Pod) -> PodStatus:
        """GetPodStatus: the pod's sandboxes and containers, by its uid label."""
        selector = {POD_UID_LABEL: pod.uid}
        items = self._call("ListPodSandbox", cri.ListPodSandboxRequest(
            filter=cri.PodSandboxFilter(label_selector=selector))).items
        status = PodStatus()
        for item in sorted(items, key=lambda s: (s.created_at, s.id), reverse=True):
            status.sandboxes.append(self._call("PodSandboxStatus", cri.PodSandboxStatusRequest(
                pod_sandbox_id=item.id)).status)
        for item in self._call("ListContainers", cri.ListContainersRequest(
                filter=cri.ContainerFilter(label_selector=selector))).containers:
            try:
                status.containers.append(self._call("ContainerStatus", cri.ContainerStatusRequest(
                    container_id=item.id)).status)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # removed in between: normal
                    raise
        return status

    def container_status(self, container_id: str) -> cri.ContainerStatus:
        return self._call("ContainerStatus", cri.ContainerStatusRequest(container_id=container_id)).status

    # -- SyncPod ------------------------------------------------------------------------------------

    def sync_pod(self, pod: Pod) -> str:
        """One SyncPod; returns the pod's sandbox id. Raises SyncError on the
        first failed step, as kubelet ends a sync, and PodFailed when an init
        container failed under restart policy Never (the pod is over)."""
        if not pod.host_network and not self.network_ready:
            raise SyncError("SyncPod", "network is not ready: the runtime reports NetworkReady false")
        status = self.pod_status(pod)
        actions = compute_pod_actions(pod, status)
        if actions.kill_pod:
            self.kill_pod(pod, status)
            if actions.create_sandbox:
                self._purge_init_containers(pod, status)
        if actions.failed is not None:
            raise PodFailed(actions.failed.metadata.name, actions.failed.exit_code)
        grace = max(pod.termination_grace_period_seconds, MINIMUM_GRACE_PERIOD)
        for stale in actions.containers_to_kill:
            self._stop_container(stale.id, grace)
        if actions.create_sandbox:
            handler = self.handler_of(pod)
            config = self.sandbox_config(pod, actions.attempt)
            Path(config.log_directory).mkdir(parents=True, exist_ok=True, mode=0o755)
            try:
                sandbox_id = self._call("RunPodSandbox", cri.RunPodSandboxRequest(
                    config=config, runtime_handler=handler)).pod_sandbox_id
                self._call("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id))
            except grpc.RpcError as exc:
                raise SyncError("RunPodSandbox", exc.details() or "", exc.code()) from None
        elif actions.sandbox_id:
            sandbox_id = actions.sandbox_id
        else:
            return status.sandboxes[0].id if status.sandboxes else ""
        config = self.sandbox_config(pod, actions.attempt)
        failed_sidecar: SyncError | None = None
        for container in actions.init_to_start:
            try:
                self.start_container(sandbox_id, config, pod, container, status)
            except SyncError as exc:
                if not container.is_sidecar:
                    raise  # the pod cannot go on without it
                failed_sidecar = failed_sidecar or exc  # the others still start
        for container in actions.containers_to_start:
            self.start_container(sandbox_id, config, pod, container, status)
        if failed_sidecar is not None:
            raise failed_sidecar
        return sandbox_id

    def _purge_init_containers(self, pod: Pod, status: PodStatus) -> None:
        """purgeInitContainers: before a new sandbox, the pod's init
        containers are removed, so that they all run again."""
        names = {c.name for c in pod.init_containers}
        for container in status.containers:
            if container.metadata.name in names:
                if container.log_path:
                    Path(container.log_path).unlink(missing_ok=True)
                try:
                    self._call("RemoveContainer", cri.RemoveContainerRequest(container_id=container.id))
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise SyncError("RemoveContainer", exc.details() or "", exc.code()) from None

    def _back_off(self, pod: Pod, container: Container, previous: cri.ContainerStatus | None) -> None:
        """doBackOff: an exited container is started again only once its
        back-off (10 s, doubling) has passed since it finished."""
        if previous is None or previous.state != cri.CONTAINER_EXITED:
            return
        key = (pod.uid, container.name)
        delay = self.backoff.get(key, self.crash_backoff)
        if time.time() - previous.finished_at / 1e9 < delay:
            raise SyncError("StartContainer", f"back-off {delay:g}s restarting failed container={container.name} "
                            f"pod={pod.name}_{pod.namespace}({pod.uid})")
        self.backoff[key] = min(max(delay, self.crash_backoff) * 2, CRASH_BACKOFF_MAX)

    def start_container(self, sandbox_id: str, sandbox_config: cri.PodSandboxConfig, pod: Pod,
                        container: Container, status: PodStatus) -> str:
        previous = status.latest(container.name)
        self._back_off(pod, container, previous)
        image_ref = self.ensure_image(pod, container, sandbox_config)
        restart_count = int(previous.annotations.get(CONTAINER_RESTART_COUNT, "0")) + 1 if previous else \
            self._restart_count_from_logs(pod, container)
        uid, username = self._image_user(container.image)
        config = self.container_config(pod, container, restart_count, image_ref, uid, username)
        try:
            container_id = self._call("CreateContainer", cri.CreateContainerRequest(
                pod_sandbox_id=sandbox_id, config=config, sandbox_config=sandbox_config)).container_id
        except grpc.RpcError as exc:
            raise SyncError("CreateContainer", exc.details() or "", exc.code()) from None
        try:
            self._call("StartContainer", cri.StartContainerRequest(container_id=container_id))
        except grpc.RpcError as exc:
            raise SyncError("StartContainer", exc.details() or "", exc.code()) from None
        return container_id

    def _restart_count_from_logs(self, pod: Pod, container: Container) -> int:
        """calcRestartCountByLogDir: one more than the newest <n>.log left."""
        counts = [int(m.group(1)) + 1 for p in (self.pod_log_dir(pod) / container.name).glob("*.log*")
                  if (m := re.match(r"^(\d+)\.log", p.name))]
        return max(counts, default=0)

    def run_pod(self, pod: Pod, sleep: Callable[[float], None] = time.sleep, init_timeout: float = 300.0) -> str:
        """The pod worker: SyncPod until it succeeds, waiting the worker's
        backoff between tries, at most retry_seconds; the last error
        otherwise. While the pod's init containers run, it syncs again
        whenever the pod's containers change (kubelet's PLEG relists once a
        second; here every 50 ms), until its containers have started or
        init_timeout passes (SyncError "PodInitializing")."""
        deadline = time.monotonic() + self.retry_seconds
        init_deadline = time.monotonic() + init_timeout
        while True:
            try:
                sandbox_id = self.sync_pod(pod)
            except PodFailed:
                raise
            except SyncError:
                if time.monotonic() + self.sync_backoff > deadline:
                    raise
                sleep(self.sync_backoff)
                continue
            if not pod.init_containers:
                return sandbox_id
            while True:
                status = self.pod_status(pod)
                if regular_container_created(pod, status) or not sandbox_id:
                    return sandbox_id
                actions = compute_pod_actions(pod, status)
                if actions.kill_pod or actions.init_to_start or actions.containers_to_start \
                        or actions.create_sandbox:
                    break  # something changed: sync again
                if time.monotonic() > init_deadline:
                    raise SyncError("PodInitializing", f"pod {pod.name} not initialized within {init_timeout:g} s")
                sleep(RELIST_PERIOD)

    # -- stopping and removing ---------------------------------------------------------------------

    def kill_pod(self, pod: Pod, status: PodStatus | None = None) -> None:
        """killPodWithSyncResult: stop every running container (concurrently,
        each with the grace period), sidecars last in reverse order (the
        termination ordering: each waits for the containers and for the
        sidecars after it, and gets what is left of the grace period), then
        every sandbox of the pod."""
        status = status or self.pod_status(pod)
        running = [c for c in status.containers if c.state in (cri.CONTAINER_RUNNING, cri.CONTAINER_UNKNOWN)]
        sidecars = [c.name for c in pod.init_containers if c.is_sidecar]
        grace = max(pod.termination_grace_period_seconds, MINIMUM_GRACE_PERIOD)
        started = time.monotonic()
        errors = []
        first = [c for c in running if c.metadata.name not in sidecars]
        with ThreadPoolExecutor(max_workers=max(1, len(first))) as pool:
            for future in [pool.submit(self._stop_container, c.id, grace) for c in first]:
                error = future.result()
                if error:
                    errors.append(error)
        for name in reversed(sidecars):
            for container in [c for c in running if c.metadata.name == name]:
                # The grace period counts in whole seconds, what was waited cut down.
                left = max(grace - int(time.monotonic() - started), MINIMUM_GRACE_PERIOD)
                error = self._stop_container(container.id, left)
                if error:
                    errors.append(error)
        for sandbox in status.sandboxes:
            try:
                self._call("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=sandbox.id))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    errors.append(f"StopPodSandbox: {exc.details()}")
        if errors:
            raise SyncError("KillPod", "; ".join(errors))

    def _stop_container(self, container_id: str, grace: int) -> str:
        try:
            self._call("StopContainer", cri.StopContainerRequest(container_id=container_id, timeout=grace),
                       timeout=RUNTIME_REQUEST_TIMEOUT + grace)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                return f"StopContainer {container_id[:13]}: {exc.details()}"
        return ""

    def collect_dead_containers(self, pod: Pod, keep: int = 1) -> list[str]:
        """Kubelet's container garbage collection for a live pod: of each
        container name's exited containers, all but the newest `keep` are
        removed with their logs (kubelet's MaxPerPodContainer, 1 by
        default), so a crash-looping container leaves one dead copy, not
        one per restart. Returns the removed ids."""
        removed = []
        exited: dict[str, list[cri.ContainerStatus]] = {}
        for container in self.pod_status(pod).containers:
            if container.state == cri.CONTAINER_EXITED:
                exited.setdefault(container.metadata.name, []).append(container)
        for dead in exited.values():
            for container in sorted(dead, key=lambda c: c.created_at, reverse=True)[keep:]:
                if container.log_path:
                    Path(container.log_path).unlink(missing_ok=True)
                self._call("RemoveContainer", cri.RemoveContainerRequest(container_id=container.id))
                removed.append(container.id)
        return removed

    def remove_pod(self, pod: Pod) -> None:
        """Garbage collection of a deleted pod: each container's log, the
        container, then the sandboxes, then the pod's cgroup."""
        status = self.pod_status(pod)
        for container in status.containers:
            if container.log_path:
                Path(container.log_path).unlink(missing_ok=True)
            self._call("RemoveContainer", cri.RemoveContainerRequest(container_id=container.id))
        for sandbox in status.sandboxes:
            self._call("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox.id))
        self.remove_pod_cgroup(pod)
        shutil.rmtree(self.pod_log_dir(pod), ignore_errors=True)

    def remove_pod_cgroup(self, pod: Pod) -> None:
        relative = self.pod_cgroup(pod).strip("/")
        for hierarchy in sorted(CGROUP_FS.iterdir()) if CGROUP_FS.is_dir() else []:
            path = hierarchy / relative
            if path.is_dir():
                for dirpath, _, _ in sorted(os.walk(path), key=lambda entry: -len(entry[0])):
                    try:
                        os.rmdir(dirpath)
                    except OSError:
                        pass

    # -- probes -------------------------------------------------------------------------------------

    def exec_sync(self, container_id: str, cmd: list[str], timeout: int = 10) -> cri.ExecSyncResponse:
        return self._call("ExecSync", cri.ExecSyncRequest(container_id=container_id, cmd=cmd, timeout=timeout),
                          timeout=RUNTIME_REQUEST_TIMEOUT + timeout)

    def wait_container(self, container_id: str, state: int = cri.CONTAINER_EXITED,
                       timeout: float = 30.0) -> cri.ContainerStatus:
        """Poll ContainerStatus (kubelet's PLEG relists every second; here
        every 50 ms) until the container reaches state."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.container_status(container_id)
            if status.state == state or time.monotonic() > deadline:
                return status
            time.sleep(0.05)
