"""Kubelet's side of CSI, replayed call for call (the demo and the tests).

No kubelet runs here, so this module does what kubelet does, taken from its
public source (pkg/kubelet/pluginmanager, pkg/volume/csi, volume_linux.go):

- plugin discovery: every socket in plugins_registry whose name does not
  start with "." is dialled; GetInfo (1 s); the type must be CSIPlugin and
  one supported version must have major version 1 ("1.0.0"); NodeGetInfo on
  the endpoint GetInfo named; then NotifyRegistrationStatus with the
  verdict and kubelet's wording of the error;
- every CSI call on a connection of its own (kubelet dials per call);
- MountDevice: NodeGetCapabilities, globalmount (0750) made by kubelet with
  vol_data.json beside it, NodeGetCapabilities for VOLUME_MOUNT_GROUP,
  NodeStageVolume with the PV's attributes as volume_context and the pod's
  fsGroup as volume_mount_group when the driver takes it;
- SetUp: NodeGetCapabilities, the target's parent made (0750) but not the
  target itself (the driver makes it), the pod's info in volume_context
  (podInfoOnMount), vol_data.json beside the target, NodePublishVolume; and
  kubelet's own ownership walk only when the driver did not take the group;
- stats: NodeGetVolumeStats with volume_id and volume_path only;
- expansion: NodeExpandVolume with the target as volume_path and the
  globalmount as staging_target_path;
- TearDown: NodeUnpublishVolume, then the target dir, vol_data.json and the
  parent are removed only if the target is no longer a mount point;
- UnmountDevice: vol_data.json beside globalmount is read (missing: nothing
  is called), NodeUnstageVolume, then globalmount, the file and its dir go;
- operations that fail are retried with kubelet's backoff (500 ms doubling);
- a restart: kubelet reconstructs its volumes from the pods directory
  (vol_data.json) and, since it cannot be sure of their state, stages and
  publishes every one of them again.

What kubelet knows of a PV and a pod is in crust.kubelet.pod; its CRI side
is crust.kubelet.cri.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import csi_pb2, csi_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from crust.kubelet.pod import PersistentVolume, Pod
from crust.sys import ownership

NodeRPC = csi_pb2.NodeServiceCapability.RPC
AccessMode = csi_pb2.VolumeCapability.AccessMode
CSI_DIR = "kubernetes.io~csi"
VOL_DATA = "vol_data.json"
POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
POD_UID = "csi.storage.k8s.io/pod.uid"
SERVICE_ACCOUNT = "csi.storage.k8s.io/serviceAccount.name"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"
# Kubelet's operation backoff starts at 500 ms and doubles (cap 2 min).
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 120.0
# Status codes after which kubelet cannot know what the driver did.
UNCERTAIN = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED}
_VERSION = re.compile(r"^v?(\d+)\.(\d+)")


class RegistrationRefused(Exception):
    pass


def write_vol_data(path: Path, data: dict[str, str]) -> None:
    """As Go's json.Encoder writes a map: compact, sorted keys, a newline."""
    path.write_text(json.dumps(data, sort_keys=True, separators=(",", ":")) + "\n")


def is_mount_point(path: Path) -> bool:
    """Kubelet's IsLikelyNotMountPoint, inverted: another device than the parent's."""
    try:
        return os.lstat(path).st_dev != os.lstat(path.parent).st_dev
    except FileNotFoundError:
        return False


def highest_supported_version(versions: list[str]) -> str:
    """Kubelet accepts a plugin when one version has major 1 (at least
    major.minor, an optional v); majors above 1 are skipped."""
    best: tuple[int, int] | None = None
    chosen = ""
    for text in versions:
        m = _VERSION.match(text)
        if m is None:
            continue
        key = (int(m.group(1)), int(m.group(2)))
        if key[0] == 1 and (best is None or key > best):
            best, chosen = key, text
    if not versions:
        raise RegistrationRefused("Plugin returned an empty list for supported versions")
    if best is None:
        raise RegistrationRefused(f"None of the versions specified {versions} are supported")
    return chosen


@dataclass
class CallLog:
    """Every CSI method kubelet called, in order (the tests read it)."""

    calls: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return list(self.calls)


class Kubelet:
    """One node's kubelet: its root directory and the driver it registered."""

    def __init__(self, root: Path, node_name: str, *, pod_info_on_mount: bool = True,
                 retry_seconds: float = 60.0):
        self.root = root
        self.node_name = node_name
        self.pod_info_on_mount = pod_info_on_mount
        self.retry_seconds = retry_seconds
        self.driver_name = ""
        self.endpoint = ""
        self.log = CallLog()
        # Set whenever kubelet itself walked and chowned a volume (it must
        # not, once the driver takes the fsGroup).
        self.chowned: list[str] = []

    # -- paths, as kubelet lays them out ---------------------------------------

    @property
    def registration_dir(self) -> Path:
        return self.root / "plugins_registry"

    def staging_path(self, pv: PersistentVolume) -> Path:
        digest = hashlib.sha256(pv.volume_handle.encode()).hexdigest()
        return self.root / "plugins" / "kubernetes.io" / "csi" / self.driver_name / digest / "globalmount"

    def pod_volume_dir(self, pod: Pod, pv: PersistentVolume) -> Path:
        return self.root / "pods" / pod.uid / "volumes" / CSI_DIR / pv.name

    def target_path(self, pod: Pod, pv: PersistentVolume) -> Path:
        return self.pod_volume_dir(pod, pv) / "mount"

    # -- plugin registration ---------------------------------------------------------

    def register(self, socket_name: str = "") -> str:
        """Discover the driver as kubelet's plugin watcher does; returns its name."""
        sockets = sorted(p for p in self.registration_dir.iterdir()
                         if not p.name.startswith(".") and p.is_socket()
                         and (not socket_name or p.name == socket_name))
        if not sockets:
            raise RegistrationRefused(f"no plugin socket in {self.registration_dir}")
        with grpc.insecure_channel(f"unix://{sockets[0]}") as channel:
            reg = pluginregistration_pb2_grpc.RegistrationStub(channel)
            info = reg.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=1)
            error = ""
            try:
                if info.type != "CSIPlugin":
                    raise RegistrationRefused(f"no handler registered for plugin type: {info.type}")
                highest_supported_version(list(info.supported_versions))
                endpoint = info.endpoint or str(sockets[0])
                node_info = self._call(endpoint, "NodeGetInfo", csi_pb2.NodeGetInfoRequest(), timeout=120)
                if not node_info.node_id:
                    raise RegistrationRefused("error updating CSINode: the driver reported an empty node id")
            except RegistrationRefused as exc:
                error = f"RegisterPlugin error -- plugin validation failed with err: {exc}"
            except grpc.RpcError as exc:
                error = f"RegisterPlugin error -- plugin registration failed with err: {exc.details()}"
            reg.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(
                plugin_registered=not error, error=error), timeout=5)
        if error:
            raise RegistrationRefused(error)
        self.driver_name, self.endpoint = info.name, endpoint
        return info.name

    # -- CSI calls ------------------------------------------------------------------------

    def _call(self, endpoint: str, method: str, request, timeout: float = 120):
        """One call on a connection of its own, as kubelet's CSI client makes them."""
        self.log.calls.append(method)
        with grpc.insecure_channel(f"unix://{endpoint}") as channel:
            return getattr(csi_pb2_grpc.NodeStub(channel), method)(request, timeout=timeout)

    def node(self, method: str, request, timeout: float = 120):
        if not self.endpoint:
            raise RuntimeError("kubelet has not registered a driver")
        return self._call(self.endpoint, method, request, timeout)

    def capabilities(self) -> set[int]:
        rsp = self.node("NodeGetCapabilities", csi_pb2.NodeGetCapabilitiesRequest())
        return {c.rpc.type for c in rsp.capabilities if c.HasField("rpc")}

    def _capability(self, pv: PersistentVolume, mount_group: str) -> csi_pb2.VolumeCapability:
        return csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(fs_type=pv.fs_type, volume_mount_group=mount_group),
            access_mode=AccessMode(mode=pv.access_mode))

    def retried(self, operation, *args):
        """Kubelet's reconciler: a failed operation runs again after 500 ms,
        doubling, until it succeeds (here: until retry_seconds pass)."""
        deadline = time.monotonic() + self.retry_seconds
        backoff = BACKOFF_FIRST
        while True:
            try:
                return operation(*args)
            except grpc.RpcError:
                if time.monotonic() + backoff > deadline:
                    raise
                time.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    # -- the volume manager's operations ---------------------------------------------------

    def mount_device(self, pv: PersistentVolume, pod: Pod) -> None:
        """MountDevice: NodeStageVolume at the PV's globalmount."""
        staging = self.staging_path(pv)
        stages = NodeRPC.STAGE_UNSTAGE_VOLUME in self.capabilities()
        staging.mkdir(parents=True, exist_ok=True, mode=0o750)
        write_vol_data(staging.parent / VOL_DATA, {"driverName": self.driver_name, "volumeHandle": pv.volume_handle})
        if not stages:
            return
        group = self._mount_group(pod)
        self.capabilities()  # the client's SINGLE_NODE_MULTI_WRITER check
        self.node("NodeStageVolume", csi_pb2.NodeStageVolumeRequest(
            volume_id=pv.volume_handle, publish_context=pv.publish_context, staging_target_path=str(staging),
            volume_capability=self._capability(pv, group), volume_context=pv.attributes))

    def _mount_group(self, pod: Pod) -> str:
        """The fsGroup as volume_mount_group, when the driver advertises
        VOLUME_MOUNT_GROUP (kubelet then never changes ownership itself)."""
        if pod.fs_group is None:
            return ""
        return str(pod.fs_group) if NodeRPC.VOLUME_MOUNT_GROUP in self.capabilities() else ""

    def set_up(self, pv: PersistentVolume, pod: Pod) -> None:
        """SetUp: NodePublishVolume at the pod's target path."""
        stages = NodeRPC.STAGE_UNSTAGE_VOLUME in self.capabilities()
        target = self.target_path(pod, pv)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        context = dict(pv.attributes)
        if self.pod_info_on_mount:
            context.update({POD_NAME: pod.name, POD_NAMESPACE: pod.namespace, POD_UID: pod.uid,
                            SERVICE_ACCOUNT: pod.service_account, EPHEMERAL: "false"})
        group = self._mount_group(pod)
        attachment = hashlib.sha256((pv.volume_handle + self.driver_name + self.node_name).encode()).hexdigest()
        write_vol_data(target.parent / VOL_DATA, {
            "specVolID": pv.name, "volumeHandle": pv.volume_handle, "driverName": self.driver_name,
            "nodeName": self.node_name, "volumeLifecycleMode": "Persistent", "attachmentID": f"csi-{attachment}"})
        self.capabilities()  # the client's SINGLE_NODE_MULTI_WRITER check
        self.node("NodePublishVolume", csi_pb2.NodePublishVolumeRequest(
            volume_id=pv.volume_handle, publish_context=pv.publish_context,
            staging_target_path=str(self.staging_path(pv)) if stages else "", target_path=str(target),
            volume_capability=self._capability(pv, group), readonly=pv.read_only, volume_context=context))
        if pod.fs_group is not None and not group and not pv.read_only:
            # The driver did not take the group: kubelet walks the volume itself.
            fd = os.open(target, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                ownership.apply_fs_group(fd, pod.fs_group)
            finally:
                os.close(fd)
            self.chowned.append(str(target))

    def start_pod(self, pv: PersistentVolume, pod: Pod) -> Path:
        """What the volume manager does before a pod's containers start."""
        self.retried(self.mount_device, pv, pod)
        self.retried(self.set_up, pv, pod)
        return self.target_path(pod, pv)

    def volume_stats(self, pv: PersistentVolume, pod: Pod) -> csi_pb2.NodeGetVolumeStatsResponse:
        self.capabilities()
        return self.node("NodeGetVolumeStats", csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=pv.volume_handle, volume_path=str(self.target_path(pod, pv))))

    def expand(self, pv: PersistentVolume, pod: Pod, required_bytes: int) -> int:
        """Online expansion after the controller grew the volume."""
        self.capabilities()
        return self.node("NodeExpandVolume", csi_pb2.NodeExpandVolumeRequest(
            volume_id=pv.volume_handle, volume_path=str(self.target_path(pod, pv)),
            staging_target_path=str(self.staging_path(pv)),
            capacity_range=csi_pb2.CapacityRange(required_bytes=required_bytes),
            volume_capability=self._capability(pv, ""))).capacity_bytes

    def tear_down(self, pv: PersistentVolume, pod: Pod) -> None:
        """TearDown: NodeUnpublishVolume, then kubelet's directories, but
        only once the target is no longer a mount point."""
        target = self.target_path(pod, pv)
        self.node("NodeUnpublishVolume", csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=pv.volume_handle, target_path=str(target)))
        if is_mount_point(target):
            return
        if target.exists():
            target.rmdir()
        (target.parent / VOL_DATA).unlink(missing_ok=True)
        if target.parent.exists():
            target.parent.rmdir()

    def unmount_device(self, pv: PersistentVolume) -> None:
        """UnmountDevice: NodeUnstageVolume when vol_data.json says what to unstage."""
        staging = self.staging_path(pv)
        data_file = staging.parent / VOL_DATA
        if not data_file.exists():
            return
        data = json.loads(data_file.read_text())
        if NodeRPC.STAGE_UNSTAGE_VOLUME in self.capabilities():
            self.node("NodeUnstageVolume", csi_pb2.NodeUnstageVolumeRequest(
                volume_id=data["volumeHandle"], staging_target_path=str(staging)))
        if staging.exists():
            staging.rmdir()
        data_file.unlink()
        staging.parent.rmdir()

    def stop_pod(self, pv: PersistentVolume, pod: Pod) -> None:
        self.retried(self.tear_down, pv, pod)
        self.retried(self.unmount_device, pv)

    # -- a kubelet restart --------------------------------------------------------------------

    def reconstruct(self) -> list[tuple[str, dict[str, str], bool]]:
        """What a restarted kubelet finds on disk: (pod uid, vol_data.json,
        does the target look mounted) for every CSI volume of every pod."""
        found = []
        for data_file in sorted((self.root / "pods").glob(f"*/volumes/{CSI_DIR}/*/{VOL_DATA}")):
            pod_uid = data_file.parents[3].name
            found.append((pod_uid, json.loads(data_file.read_text()), is_mount_point(data_file.parent / "mount")))
        return found

    def restart(self, pods: dict[str, tuple[PersistentVolume, Pod]]) -> list[tuple[str, dict[str, str], bool]]:
        """Kubelet restarts: it forgets everything, registers the driver
        again, reconstructs its volumes and, being uncertain of them, stages
        and publishes each one whose pod still runs (pods: by pod uid)."""
        self.driver_name = self.endpoint = ""
        self.register()
        found = self.reconstruct()
        for pod_uid, _, _ in found:
            if pod_uid in pods:
                pv, pod = pods[pod_uid]
                self.start_pod(pv, pod)
        return found
