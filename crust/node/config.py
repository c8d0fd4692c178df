"""The one configuration file of `crust node` (YAML or JSON).

Every key is documented here and in docs/install-node.md; an unknown key is
refused with its path (`driver.capcity: Extra inputs are not permitted`), so
a typo never silently falls back to a default. Keys are camelCase, like
Kubernetes objects; the whole file may be as short as `nodeId: node-a`.

Sockets and directories follow from three roots:
- kubeletRoot: where kubelet keeps pods and plugins (the CSI socket kubelet
  dials lives under it, and so do the target and staging paths);
- runDir: sockets between crust's own daemons and the watched directory
  (tmpfs, gone at reboot like the mounts they describe);
- stateDir: what must survive a reboot (volume pools, records).
"""

from __future__ import annotations

import os
import stat
from enum import Enum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from crust.common.errors import InvalidArgument
from crust.common.units import parse_size
from crust.driver.config import DRIVER_NAME
from crust.proxy.config import PolicyFile
from crust.proxy.kubelet_registration import registration_socket
from crust.proxy.state import check_handler_name


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


def _size(value: int | str) -> int:
    return parse_size(value) if isinstance(value, str) else value


class DriverSection(_Section):
    # all: controller and node services in one process (a node that
    # provisions its own local volumes); node: node services only.
    mode: str = Field("all", pattern="^(all|node)$")
    # The loop backend's pool; default <stateDir>/driver.
    data_dir: Path | None = Field(None, alias="dataDir")
    # Size of this node's pool ("100Gi"); 0: the size of the data dir's file system.
    capacity: int = 0
    max_volumes_per_node: int = Field(64, alias="maxVolumesPerNode", ge=1, le=4096)
    default_fs_type: str = Field("ext4", alias="defaultFsType", pattern="^(ext4|xfs)$")
    # Distributed provisioning (mode all): this node provisions its own
    # volumes (a node-deployed external-provisioner next to it); no attach
    # step, volumes grow at the node. See docs/install.md.
    distributed: bool = False
    # Prometheus metrics of the driver (pool capacity and free bytes); 0: off.
    metrics_port: int = Field(0, alias="metricsPort", ge=0, le=65535)

    _capacity = field_validator("capacity", mode="before")(_size)


class ShimSection(_Section):
    default_fs_type: str = Field("ext4", alias="defaultFsType", pattern="^(ext4|xfs)$")
    # false: hide DEFER_FS_OPS* (for conformance tools that reject them).
    advertise_deferral: bool = Field(True, alias="advertiseDeferral")
    # A snapshot's freeze of a deferred volume ends by itself in its sandbox
    # this long after it began, should the shim's thaw never come.
    freeze_timeout_seconds: int = Field(60, alias="freezeTimeoutSeconds", ge=1, le=600)
    metrics_port: int = Field(0, alias="metricsPort", ge=0, le=65535)


class KubeletRegistrationSection(_Section):
    # Serve kubelet's plugin registration (<dir>/<driver>-reg.sock). Turn it
    # off when a node-driver-registrar sidecar registers the driver instead.
    enabled: bool = True
    dir: Path | None = None  # default <kubeletRoot>/plugins_registry
    # The CSI socket's path as kubelet sees it; default: the csiSocket key.
    path: str = ""


class ProxySection(_Section):
    # Also mirror deferred volumes in Kata's direct-volume layout here
    # (e.g. /run/kata-containers/shared/direct-volumes); default: off.
    kata_dir: Path | None = Field(None, alias="kataDir")
    # The deferral policy, inline (the format of `crust proxy --policy`).
    policy: PolicyFile = Field(default_factory=PolicyFile)
    # Numeric group allowed on the runtime socket (0660) instead of root only.
    runtime_socket_group: int | None = Field(None, alias="runtimeSocketGroup")
    # Uids allowed to call the registry and the Runtime API (the kernel names
    # each caller); callers whose effective gid is runtimeSocketGroup too.
    runtime_allowed_uids: list[int] = Field(default_factory=lambda: [0], alias="runtimeAllowedUids")
    lease_seconds: int = Field(15, alias="leaseSeconds", ge=2, le=3600)
    claim_grace_seconds: float = Field(300, alias="claimGraceSeconds", ge=0)
    sweep_interval_seconds: float = Field(60, alias="sweepIntervalSeconds", gt=0)
    # Prometheus metrics on 127.0.0.1:PORT; 0: off.
    metrics_port: int = Field(0, alias="metricsPort", ge=0, le=65535)


class Runtime(str, Enum):
    NONE = "none"
    MOUNTNS = "mountns"
    KATA = "kata"


class KataSection(_Section):
    accel: str = Field("auto", pattern="^(auto|kvm|tcg)$")
    # The guest memory of a pod without memory limits, and of every VM
    # before its pod (booted, pooled, the template): the floor.
    memory_mib: int = Field(256, alias="memoryMiB", ge=64, le=65536)
    # The most a pod's guest gets: its containers' limits (and overhead)
    # above the floor are hot-plugged up to this (crust.kata.pod.guest_memory).
    max_memory_mib: int = Field(2048, alias="maxMemoryMiB", ge=64, le=65536)
    # The guest's vCPUs (QEMU's -smp).
    cpus: int = Field(1, ge=1, le=64)
    # VMs kept booted for the next pods (crust.kata.supply.pool); 0: each pod boots its own.
    vm_pool: int = Field(0, alias="vmPool", ge=0, le=64)
    # Restore each pod's VM from one saved VM instead of booting (crust.kata.supply.template);
    # the pods that come while it is being made boot theirs.
    vm_template: bool = Field(True, alias="vmTemplate")
    # How a pod's volumes reach its VM: a virtio-blk PCI device each, or LUNs
    # of one virtio-scsi controller (Kata's default; no PCI hot-plug per volume).
    disk_bus: str = Field("virtio-blk", alias="diskBus", pattern="^(virtio-blk|virtio-scsi)$")
    # TCG's translation buffer per VM in MiB, used only under software
    # emulation (the handler's default, crust.kata.vmm.config.TCG_TB_MIB;
    # docs/microvm.md says how it was measured).
    tcg_tb_mib: int = Field(32, alias="tcgTbMiB", ge=1, le=1024)
    cache: Path = Path("/var/cache/crust/kata")
    # Kata's direct-volume directory the handler also serves.
    kata_dir: Path = Field(Path("/run/kata-containers/shared/direct-volumes"), alias="kataDir")

    @model_validator(mode="after")
    def _ceiling_above_floor(self) -> "KataSection":
        if self.max_memory_mib < self.memory_mib:
            raise ValueError(f"maxMemoryMiB {self.max_memory_mib} is below memoryMiB {self.memory_mib}")
        return self


class HandlerSection(_Section):
    # none: runtime handlers run elsewhere (a Kata shim of its own, another
    # service); mountns: the light mount-namespace handler; kata: the
    # microVM handler.
    runtime: Runtime = Runtime.NONE
    # The name it registers under; default: the runtime's name.
    name: str = ""
    kata: KataSection = Field(default_factory=KataSection)

    @field_validator("name")
    @classmethod
    def _registrable(cls, value: str) -> str:
        # The proxy's registry refuses any other name: the handler would
        # never register, and no volume would ever reach a sandbox.
        if value:
            try:
                check_handler_name(value)
            except InvalidArgument as exc:
                raise ValueError(exc.message) from None
        return value


class SupervisorSection(_Section):
    # A child that dies is started again after this, doubling on every
    # death within a minute of its start, up to restartBackoffMaxSeconds.
    restart_backoff_seconds: float = Field(0.2, alias="restartBackoffSeconds", gt=0, le=60)
    restart_backoff_max_seconds: float = Field(30, alias="restartBackoffMaxSeconds", gt=0, le=3600)
    # How long a child gets to stop after SIGTERM before SIGKILL.
    stop_timeout_seconds: float = Field(30, alias="stopTimeoutSeconds", gt=0, le=600)
    # How long a child may take to serve its socket after a start.
    ready_timeout_seconds: float = Field(60, alias="readyTimeoutSeconds", gt=0, le=600)


class NodeConfig(_Section):
    # This node's name as the cluster knows it (kubelet's node name; also the
    # driver's topology segment).
    node_id: str = Field(alias="nodeId", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    kubelet_root: Path = Field(Path("/var/lib/kubelet"), alias="kubeletRoot")
    # The CSI socket kubelet dials (the proxy serves it); default
    # <kubeletRoot>/plugins/<driver>/csi.sock.
    csi_socket: Path | None = Field(None, alias="csiSocket")
    run_dir: Path = Field(Path("/run/crust"), alias="runDir")
    state_dir: Path = Field(Path("/var/lib/crust"), alias="stateDir")
    log_level: str = Field("info", alias="logLevel", pattern="^(debug|info|warning|error)$")
    log_format: str = Field("json", alias="logFormat", pattern="^(json|text)$")
    # Where every daemon's metrics port listens (127.0.0.1; 0.0.0.0 in a pod).
    metrics_address: str = Field("127.0.0.1", alias="metricsAddress", min_length=1)
    kubelet_registration: KubeletRegistrationSection = Field(default_factory=KubeletRegistrationSection,
                                                             alias="kubeletRegistration")
    driver: DriverSection = Field(default_factory=DriverSection)
    shim: ShimSection = Field(default_factory=ShimSection)
    proxy: ProxySection = Field(default_factory=ProxySection)
    handler: HandlerSection = Field(default_factory=HandlerSection)
    supervisor: SupervisorSection = Field(default_factory=SupervisorSection)

    @field_validator("kubelet_root", "run_dir", "state_dir", "csi_socket")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_absolute():
            raise ValueError(f"{value} must be an absolute path")
        return value

    # -- where everything is ------------------------------------------------------

    @property
    def kubelet_csi_socket(self) -> Path:
        return self.csi_socket or self.kubelet_root / "plugins" / DRIVER_NAME / "csi.sock"

    @property
    def registration_dir(self) -> Path | None:
        if not self.kubelet_registration.enabled:
            return None
        return self.kubelet_registration.dir or self.kubelet_root / "plugins_registry"

    @property
    def driver_socket(self) -> Path:
        return self.run_dir / "driver.sock"

    @property
    def shim_socket(self) -> Path:
        return self.run_dir / "shim.sock"

    @property
    def runtime_socket(self) -> Path:
        # In a directory of its own: the proxy insists on 0700 (or 0750).
        return self.run_dir / "runtime" / "proxy.sock"

    @property
    def handler_socket(self) -> Path:
        return self.run_dir / "handler.sock"

    @property
    def volumes_dir(self) -> Path:
        return self.run_dir / "volumes"

    @property
    def supervisor_dir(self) -> Path:
        return self.run_dir / "node"

    @property
    def status_file(self) -> Path:
        return self.supervisor_dir / "status.json"

    @property
    def handler_name(self) -> str:
        return self.handler.name or self.handler.runtime.value

    # -- what one key alone cannot tell ---------------------------------------------

    def sockets_by_key(self) -> dict[str, Path]:
        """Every unix socket the node's daemons bind, by the key it follows from."""
        found = {"csiSocket": self.kubelet_csi_socket, "runDir (driver.sock)": self.driver_socket,
                 "runDir (shim.sock)": self.shim_socket, "runDir (runtime/proxy.sock)": self.runtime_socket}
        if self.registration_dir is not None:
            found["kubeletRegistration.dir"] = registration_socket(self.registration_dir, DRIVER_NAME)
        if self.handler.runtime is not Runtime.NONE:
            found["runDir (handler.sock)"] = self.handler_socket
        return found

    def problems(self) -> list[tuple[str, str]]:
        """(key, why) for what no single key shows: a socket path or a
        metrics port used twice (the second daemon could not bind it, and a
        readiness check could take the first for it), and roots that are
        not real directories (a regular file, a symlink), so a daemon would
        fail on its first write or write elsewhere than configured."""
        found: list[tuple[str, str]] = []
        seen: dict[str, str] = {}
        for key, path in self.sockets_by_key().items():
            where = os.path.normpath(str(path))
            if where in seen:
                found.append((key.split(" ")[0], f"{where} is also the socket of {seen[where]}; "
                                                 "each daemon needs a socket of its own"))
            else:
                seen[where] = key
        ports: dict[int, str] = {}
        for key, port in (("driver.metricsPort", self.driver.metrics_port),
                          ("shim.metricsPort", self.shim.metrics_port),
                          ("proxy.metricsPort", self.proxy.metrics_port)):
            if port and port in ports:
                found.append((key, f"port {port} is also {ports[port]}; each daemon needs a port of its own"))
            elif port:
                ports[port] = key
        roots = [("stateDir", self.state_dir, False), ("runDir", self.run_dir, False),
                 ("kubeletRoot", self.kubelet_root, True)]
        if self.driver.data_dir is not None:
            roots.append(("driver.dataDir", self.driver.data_dir, False))
        for key, path, whole_path in roots:
            why = not_a_real_directory(path, whole_path)
            if why:
                found.append((key, why))
        return found

    @classmethod
    def load(cls, path: Path, node_id: str = "") -> "NodeConfig":
        """Read and validate; ValueError names the file and each bad key's path.
        node_id, when given, replaces the file's nodeId (one file for every node)."""
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of keys (at least nodeId), got {type(raw).__name__}")
        if node_id:
            raw["nodeId"] = node_id
        try:
            config = cls.model_validate(raw)
        except ValidationError as exc:
            lines = [f"{path}: {exc.error_count()} invalid key(s)"]
            for err in exc.errors():
                where = ".".join(str(p) for p in err["loc"]) or "(top)"
                lines.append(f"  {where}: {err['msg']}")
            raise ValueError("\n".join(lines)) from None
        problems = config.problems()
        if problems:
            raise ValueError("\n".join([f"{path}: {len(problems)} invalid key(s)"]
                                       + [f"  {key}: {why}" for key, why in problems]))
        return config


def not_a_real_directory(path: Path, whole_path: bool) -> str:
    """Why path cannot serve as a root directory ("" when it can): it, or
    the nearest part of it that exists, must be a directory and no symlink
    (whole_path: no part of it may be a symlink, as for kubelet's root,
    which the daemons walk without following links). A missing directory
    is fine: the daemons create it."""
    parts = Path(os.path.normpath(path)).parts
    for depth in range(len(parts), 0, -1):
        current = Path(*parts[:depth])
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"{current}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            if depth == len(parts) or whole_path:
                return (f"{current} is a symlink; give the real path"
                        + (" (the daemons reach it without following links)" if whole_path else ""))
            try:
                st = os.stat(current)  # a link above the root (/var/run -> /run) is fine if it leads to a directory
            except OSError as exc:
                return f"{current}: {exc.strerror}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{current} exists and is not a directory"
        if not whole_path:
            return ""
    return ""
