"""Configuration of `crust proxy` and its deferral policy file."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class KubernetesAccess(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # Empty: in-cluster configuration when running in a pod, else kubeconfig.
    api_server: str = Field("", alias="apiServer")
    kubeconfig: str = ""
    token_file: str = Field("", alias="tokenFile")
    ca_file: str = Field("", alias="caFile")
    timeout_seconds: float = Field(5.0, alias="timeoutSeconds", gt=0, le=60)


class DeferralPolicy(BaseModel):
    """When to defer a filesystem volume for an unmodified kubelet."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # volume_context entries (StorageClass parameters reach it through the
    # provisioner's volume context); any one matching defers the volume.
    storage_class_parameters: dict[str, str] = Field(default_factory=dict, alias="storageClassParameters")
    # Pods whose spec.runtimeClassName is one of these get their volumes
    # deferred (needs podInfoOnMount on the CSIDriver object).
    runtime_classes: list[str] = Field(default_factory=list, alias="runtimeClasses")
    # Pass the pod's securityContext.fsGroup and fsGroupChangePolicy on.
    fs_group_from_pod: bool = Field(True, alias="fsGroupFromPod")


class PolicyFile(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    deferral: DeferralPolicy = Field(default_factory=DeferralPolicy)
    kubernetes: KubernetesAccess = Field(default_factory=KubernetesAccess)

    @classmethod
    def load(cls, path: Path) -> "PolicyFile":
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"policy file {path}: {exc}") from None
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"policy file {path}: {exc}") from None


class ProxyConfig(BaseModel):
    csi_endpoint: str
    plugin_endpoint: str
    runtime_endpoint: str
    volumes_dir: Path
    state_dir: Path
    kata_dir: Path | None = None
    kubelet_root: Path = Path("/var/lib/kubelet")
    policy: PolicyFile = Field(default_factory=PolicyFile)
    # Group allowed on the runtime socket (socket 0660, directory 0750); none: 0600/0700.
    runtime_socket_group: int | None = None
    # Who may call the registry and the Runtime API, as the kernel names the
    # caller (SO_PEERCRED): these uids, and callers whose effective gid is
    # runtime_socket_group.
    runtime_allowed_uids: list[int] = Field(default_factory=lambda: [0])
    lease_seconds: int = Field(15, ge=2, le=3600)
    # A deferred volume nobody claimed within this time is reported as such;
    # before that its sandbox is "starting", not abnormal.
    claim_grace_seconds: float = Field(300, ge=0)
    sweep_interval_seconds: float = Field(60, gt=0)
    runtime_cli_timeout_seconds: float = Field(10, gt=0, le=300)
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_address: str = "127.0.0.1"
    # Kubelet's plugins_registry directory: serve kubelet's plugin
    # registration there (<dir>/<driver>-reg.sock). None: do not register
    # (a node-driver-registrar sidecar does, or nobody).
    kubelet_registration_dir: Path | None = None
    # The CSI socket's path as kubelet sees it (differs when the proxy runs
    # in a container with the host's directory mounted elsewhere); default:
    # the path of csi_endpoint.
    kubelet_registration_path: str = ""
