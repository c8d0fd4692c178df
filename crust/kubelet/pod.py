"""What kubelet knows of a pod and its volumes, for the replay: the fields
of the Kubernetes objects (v1.Pod, v1.Container, v1.Volume and the volume
sources, v1.PersistentVolume) that kubelet's CSI and CRI sides and its
volume manager read, with the API server's defaults.

No API server runs here: a configMap, secret or service-account token
volume carries the object's data itself (what kubelet would have fetched),
and an update is handed to the volume manager (crust.kubelet.volumes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from crust.api import csi_pb2

AccessMode = csi_pb2.VolumeCapability.AccessMode

# Where the ServiceAccount admission plugin mounts a pod's API credentials.
SERVICE_ACCOUNT_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
# The token it asks for lives a little over an hour (3600 s plus a margin
# that lets the API server tell kubelet-refreshed tokens from others).
SERVICE_ACCOUNT_TOKEN_SECONDS = 3607


@dataclass
class PersistentVolume:
    """What kubelet knows of a PV: its name, the CSI source and its mode."""

    name: str
    volume_handle: str
    attributes: dict[str, str] = field(default_factory=dict)
    fs_type: str = "ext4"
    access_mode: int = AccessMode.SINGLE_NODE_WRITER
    read_only: bool = False
    publish_context: dict[str, str] = field(default_factory=dict)


@dataclass
class EmptyDir:
    """v1.EmptyDirVolumeSource: medium "" (the node's disk) or "Memory"
    (a tmpfs); size_limit in bytes (a Memory volume's tmpfs size)."""

    medium: str = ""
    size_limit: int | None = None


@dataclass
class KeyToPath:
    """v1.KeyToPath: one key of a configMap or secret at a relative path."""

    key: str
    path: str
    mode: int | None = None


@dataclass
class ConfigMap:
    """A configMap volume (v1.ConfigMapVolumeSource) with the object's data.
    default_mode None is the API's default (0644); inside a Projected volume
    the projected volume's default mode applies instead."""

    data: dict[str, str] = field(default_factory=dict)
    items: list[KeyToPath] = field(default_factory=list)
    default_mode: int | None = None
    binary_data: dict[str, bytes] = field(default_factory=dict)
    optional: bool = False
    name: str = ""


@dataclass
class Secret:
    """A secret volume (v1.SecretVolumeSource) with the object's data."""

    data: dict[str, bytes] = field(default_factory=dict)
    items: list[KeyToPath] = field(default_factory=list)
    default_mode: int | None = None
    optional: bool = False
    name: str = ""


@dataclass
class DownwardAPIFile:
    """v1.DownwardAPIVolumeFile with a fieldRef: metadata.name, .namespace,
    .uid, .labels, .annotations, or one label or annotation
    (metadata.labels['key'])."""

    path: str
    field_path: str
    mode: int | None = None


@dataclass
class DownwardAPI:
    """v1.DownwardAPIVolumeSource."""

    items: list[DownwardAPIFile] = field(default_factory=list)
    default_mode: int | None = None


@dataclass
class ServiceAccountToken:
    """v1.ServiceAccountTokenProjection with the token the API server's
    TokenRequest returned (kubelet's token manager asks for it)."""

    token: str
    path: str = "token"
    expiration_seconds: int = SERVICE_ACCOUNT_TOKEN_SECONDS
    audience: str = ""


@dataclass
class Projected:
    """v1.ProjectedVolumeSource: configMaps, secrets, downward API items and
    service-account tokens in one directory."""

    sources: list[ConfigMap | Secret | DownwardAPI | ServiceAccountToken] = field(default_factory=list)
    default_mode: int | None = None


@dataclass
class HostPath:
    """v1.HostPathVolumeSource; type "" checks nothing, else Directory,
    DirectoryOrCreate, File, FileOrCreate, Socket, CharDevice, BlockDevice."""

    path: str
    type: str = ""


VolumeSource = PersistentVolume | EmptyDir | ConfigMap | Secret | DownwardAPI | Projected | HostPath


def service_account_volume(token: str, ca_crt: str) -> Projected:
    """The kube-api-access-* volume the ServiceAccount admission plugin adds
    to a pod: the token, the cluster's CA (configMap kube-root-ca.crt) and
    the pod's namespace, mounted read-only at SERVICE_ACCOUNT_MOUNT_PATH."""
    return Projected(default_mode=0o644, sources=[
        ServiceAccountToken(token=token),
        ConfigMap(name="kube-root-ca.crt", data={"ca.crt": ca_crt}, items=[KeyToPath("ca.crt", "ca.crt")]),
        DownwardAPI(items=[DownwardAPIFile("namespace", "metadata.namespace")])])


@dataclass
class VolumeMount:
    """v1.VolumeMount: a pod volume (by name) at a path in the container."""

    name: str
    mount_path: str
    read_only: bool = False
    # None (private), "None", "HostToContainer" or "Bidirectional".
    mount_propagation: str | None = None
    sub_path: str = ""


@dataclass(frozen=True)
class ContainerPort:
    """v1.ContainerPort: what the sandbox's port mappings are made of."""
    container_port: int
    host_port: int = 0
    protocol: str = "TCP"
    host_ip: str = ""


@dataclass
class Container:
    """v1.Container, the fields kubelet turns into a CRI ContainerConfig."""

    name: str
    image: str
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    working_dir: str = ""
    volume_mounts: list[VolumeMount] = field(default_factory=list)
    image_pull_policy: str = "IfNotPresent"
    termination_message_path: str = "/dev/termination-log"
    termination_message_policy: str = "File"
    run_as_user: int | None = None
    run_as_group: int | None = None
    privileged: bool = False
    read_only_root_filesystem: bool = False
    # securityContext.allowPrivilegeEscalation (None: not set) and
    # .capabilities.add / .drop, names as written ("NET_ADMIN", "ALL").
    allow_privilege_escalation: bool | None = None
    capabilities_add: list[str] = field(default_factory=list)
    capabilities_drop: list[str] = field(default_factory=list)
    # Only for an init container: "Always" makes it a sidecar (a restartable
    # init container that starts in order and keeps running beside the app).
    restart_policy: str | None = None
    ports: list[ContainerPort] = field(default_factory=list)
    # resources.limits.memory in bytes (its request defaults to it: a
    # Burstable pod unless every resource has a limit); None: none.
    memory_limit: int | None = None
    # stdin, stdinOnce, tty: what `kubectl run -i -t` and attach rely on.
    stdin: bool = False
    stdin_once: bool = False
    tty: bool = False

    @property
    def is_sidecar(self) -> bool:
        return self.restart_policy == "Always"


@dataclass
class Pod:
    uid: str
    name: str
    namespace: str = "default"
    fs_group: int | None = None
    service_account: str = "default"
    # The CRI side's fields (v1.PodSpec); the CSI side reads none of them.
    containers: list[Container] = field(default_factory=list)
    # Run one at a time, in order, before the containers (sidecars excepted).
    init_containers: list[Container] = field(default_factory=list)
    # Pod volume name -> its source (for a PVC: the PV bound to the claim).
    volumes: dict[str, VolumeSource] = field(default_factory=dict)
    runtime_class_name: str | None = None
    host_network: bool = False
    host_pid: bool = False
    host_ipc: bool = False
    share_process_namespace: bool = False
    run_as_user: int | None = None
    run_as_group: int | None = None
    supplemental_groups: list[int] = field(default_factory=list)
    restart_policy: str = "Always"
    termination_grace_period_seconds: int = 30
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    def all_containers(self) -> list[Container]:
        """Init containers first, then the containers (podutil.VisitContainers' order)."""
        return list(self.init_containers) + list(self.containers)
