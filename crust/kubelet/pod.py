"""What kubelet knows of a pod and its volumes, for the replay: the fields
of the Kubernetes objects (v1.Pod, v1.Container, v1.PersistentVolume) that
kubelet's CSI and CRI sides read, with the API server's defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from crust.api import csi_pb2

AccessMode = csi_pb2.VolumeCapability.AccessMode


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
class VolumeMount:
    """v1.VolumeMount: a pod volume (by name) at a path in the container."""

    name: str
    mount_path: str
    read_only: bool = False
    # None (private), "None", "HostToContainer" or "Bidirectional".
    mount_propagation: str | None = None
    sub_path: str = ""


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


@dataclass
class Pod:
    uid: str
    name: str
    namespace: str = "default"
    fs_group: int | None = None
    service_account: str = "default"
    # The CRI side's fields (v1.PodSpec); the CSI side reads none of them.
    containers: list[Container] = field(default_factory=list)
    # Pod volume name -> the PV bound to its claim.
    volumes: dict[str, PersistentVolume] = field(default_factory=dict)
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
