"""The configs kubelet generates for a pod and its containers
(generatePodSandboxConfig, generateContainerConfig with makeMounts), as
crust.kubelet.cri replays them: namespaces, security contexts, resources
and OOM scores by QoS, labels and annotations, /etc/hosts, the
termination log, DNS, port mappings. A mixin of KubeletRuntime: its pod
directories, cgroups, kubelet and volume managers."""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import asdict
from pathlib import Path

import grpc

from crust.api import cri_pb2 as cri
from crust.kubelet.pod import Container, PersistentVolume, Pod
from crust.kubelet.volumes import VolumeError

# qos: a BestEffort container's OOM score adjustment, and a Guaranteed one's.
BESTEFFORT_OOM_SCORE_ADJ = 1000
GUARANTEED_OOM_SCORE_ADJ = -997
# cm: MilliCPUToShares(0) and the default CFS period (100 ms, in us).
MIN_SHARES = 2
QUOTA_PERIOD = 100_000
HUGEPAGES = Path("/sys/kernel/mm/hugepages")

POD_NAME_LABEL = "io.kubernetes.pod.name"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_UID_LABEL = "io.kubernetes.pod.uid"
CONTAINER_NAME_LABEL = "io.kubernetes.container.name"
CONTAINER_HASH = "io.kubernetes.container.hash"
CONTAINER_RESTART_COUNT = "io.kubernetes.container.restartCount"
TERMINATION_MESSAGE_PATH = "io.kubernetes.container.terminationMessagePath"
TERMINATION_MESSAGE_POLICY = "io.kubernetes.container.terminationMessagePolicy"
POD_TERMINATION_GRACE_PERIOD = "io.kubernetes.pod.terminationGracePeriod"
# securitycontext: what a container's /proc hides by default (ProcMount Default).
DEFAULT_MASKED_PATHS = ["/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys",
                        "/proc/latency_stats", "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                        "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap"]
DEFAULT_READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
HOST_NETWORK_HOSTS_HEADER = "# Kubernetes-managed hosts file (host network).\n"
PROPAGATION = {None: cri.PROPAGATION_PRIVATE, "None": cri.PROPAGATION_PRIVATE,
               "HostToContainer": cri.PROPAGATION_HOST_TO_CONTAINER,
               "Bidirectional": cri.PROPAGATION_BIDIRECTIONAL}



class SyncError(Exception):
    """A SyncPod step failed: kubelet's step name, and the runtime's message."""

    def __init__(self, step: str, message: str, code: grpc.StatusCode | None = None):
        self.step, self.message, self.code = step, message, code
        super().__init__(f"{step}: {message}")


def expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) references as kubelet expands them; $$ is a literal $, an
    unknown reference stays as written."""
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, text)


def container_hash(container: Container) -> str:
    """Kubelet hashes the container's JSON with FNV-1a (32 bit), in hex."""
    value = 0x811C9DC5
    for byte in json.dumps(asdict(container), sort_keys=True).encode():
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return format(value, "x")


def read_resolv_conf(path: Path) -> cri.DNSConfig:
    servers, searches, options = [], [], []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if fields[0] == "nameserver":
            servers += fields[1:2]
        elif fields[0] in ("search", "domain"):
            searches = fields[1:]
        elif fields[0] == "options":
            options += fields[1:]
    return cri.DNSConfig(servers=servers, searches=searches, options=options)


def burstable_oom_score_adj(memory_request: int, meminfo: Path = Path("/proc/meminfo")) -> int:
    """qos.GetContainerOOMScoreAdjust for a Burstable container: 1000 less
    its memory request's share of the node's memory in thousandths, kept
    above a Guaranteed container's and below a BestEffort one's."""
    capacity = next(int(line.split()[1]) * 1024 for line in meminfo.read_text().splitlines()
                    if line.startswith("MemTotal:"))
    adjust = 1000 - (1000 * memory_request) // capacity
    if adjust < 1000 + GUARANTEED_OOM_SCORE_ADJ:
        return 1000 + GUARANTEED_OOM_SCORE_ADJ
    if adjust == BESTEFFORT_OOM_SCORE_ADJ:
        return adjust - 1
    return adjust


def hugepage_sizes() -> list[str]:
    """Every huge page size of this machine, as kubelet names them ("2MB")."""
    sizes = []
    for entry in sorted(HUGEPAGES.glob("hugepages-*kB")) if HUGEPAGES.is_dir() else []:
        kib = int(entry.name.removeprefix("hugepages-").removesuffix("kB"))
        for unit, factor in (("GB", 1024 * 1024), ("MB", 1024), ("KB", 1)):
            if kib % factor == 0:
                sizes.append(f"{kib // factor}{unit}")
                break
    return sizes


class GeneratedConfigs:
    """generatePodSandboxConfig and generateContainerConfig, for KubeletRuntime."""

    # -- generated configs ---------------------------------------------------------------------

    def namespace_options(self, pod: Pod) -> cri.NamespaceOption:
        """runtimeutil.NamespacesForPod (no user namespace: the node's)."""
        pid = cri.NODE if pod.host_pid else (cri.POD if pod.share_process_namespace else cri.CONTAINER)
        return cri.NamespaceOption(network=cri.NODE if pod.host_network else cri.POD, pid=pid,
                                   ipc=cri.NODE if pod.host_ipc else cri.POD,
                                   userns_options=cri.UserNamespace(mode=cri.NODE))

    def supplemental_groups(self, pod: Pod) -> list[int]:
        """The pod's fsGroup first, then its supplementalGroups."""
        return ([pod.fs_group] if pod.fs_group is not None else []) + list(pod.supplemental_groups)

    @staticmethod
    def _best_effort_resources() -> cri.LinuxContainerResources:
        """calculateLinuxResources for no requests and no limits."""
        return cri.LinuxContainerResources(cpu_shares=MIN_SHARES, cpu_period=QUOTA_PERIOD, cpu_quota=0)

    def _sandbox_resources(self, pod: Pod) -> cri.LinuxContainerResources:
        """calculateSandboxResources: the pod's limits without its overhead
        (PodLimits: the containers' memory limits summed, or an init
        container's when larger: they run one at a time)."""
        resources = self._best_effort_resources()
        apps = sum(c.memory_limit or 0 for c in pod.containers)
        sidecars = sum(c.memory_limit or 0 for c in pod.init_containers if c.is_sidecar)
        inits = max((c.memory_limit or 0 for c in pod.init_containers if not c.is_sidecar), default=0)
        resources.memory_limit_in_bytes = max(apps + sidecars, inits)
        return resources

    def sandbox_config(self, pod: Pod, attempt: int) -> cri.PodSandboxConfig:
        labels = dict(pod.labels)
        labels.update({POD_NAME_LABEL: pod.name, POD_NAMESPACE_LABEL: pod.namespace, POD_UID_LABEL: pod.uid})
        security = cri.LinuxSandboxSecurityContext(
            privileged=any(c.privileged for c in pod.containers),
            seccomp=cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault),
            namespace_options=self.namespace_options(pod),
            supplemental_groups=self.supplemental_groups(pod))
        if pod.run_as_user is not None:
            security.run_as_user.value = pod.run_as_user
        if pod.run_as_group is not None:
            security.run_as_group.value = pod.run_as_group
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=pod.name, namespace=pod.namespace, uid=pod.uid, attempt=attempt),
            labels=labels, annotations=dict(pod.annotations), log_directory=str(self.pod_log_dir(pod)),
            linux=cri.LinuxPodSandboxConfig(cgroup_parent=self.pod_cgroup(pod), security_context=security,
                                            resources=self._sandbox_resources(pod),
                                            overhead=cri.LinuxContainerResources()))
        config.port_mappings.extend(self.port_mappings(pod))
        # ClusterFirst on a host-network pod falls back to the node's resolv.conf.
        config.dns_config.CopyFrom(read_resolv_conf(self.resolv_conf) if pod.host_network else cri.DNSConfig())
        if not pod.host_network:
            config.hostname = pod.name
        return config

    @staticmethod
    def port_mappings(pod: Pod) -> list[cri.PortMapping]:
        """generatePodSandboxConfig's: every port of the (non-init)
        containers, once per port, protocol and host port (MakePortMappings)."""
        protocols = {"TCP": cri.TCP, "UDP": cri.UDP, "SCTP": cri.SCTP}
        seen, mappings = set(), []
        for container in pod.containers:
            for port in container.ports:
                key = (port.container_port, port.protocol, port.host_port)
                if key in seen:
                    continue
                seen.add(key)
                mappings.append(cri.PortMapping(protocol=protocols[port.protocol], container_port=port.container_port,
                                                host_port=port.host_port, host_ip=port.host_ip))
        return mappings

    def make_mounts(self, pod: Pod, container: Container) -> list[cri.Mount]:
        mounts = []
        for index, volume_mount in enumerate(container.volume_mounts):
            source = pod.volumes.get(volume_mount.name)
            if source is None:
                raise SyncError("GenerateContainerConfig", f'cannot find volume "{volume_mount.name}" to mount '
                                f'into container "{container.name}"')
            if isinstance(source, PersistentVolume) and volume_mount.sub_path:
                raise SyncError("GenerateContainerConfig", "subPath of a CSI volume is not replayed (kubelet "
                                "binds it from the volume on the host, which a deferred volume never is)")
            if volume_mount.mount_propagation not in PROPAGATION:
                raise SyncError("GenerateContainerConfig",
                                f"invalid MountPropagation mode: {volume_mount.mount_propagation!r}")
            if isinstance(source, PersistentVolume):
                host_path, must_be_read_only = self.kubelet.target_path(pod, source), source.read_only
            else:
                try:
                    host_path = self.volumes.mount_source(pod, container, index, volume_mount)
                except VolumeError as exc:
                    raise SyncError("GenerateContainerConfig", str(exc)) from exc
                must_be_read_only = self.volumes.read_only(source)
            mounts.append(cri.Mount(
                container_path=volume_mount.mount_path, host_path=str(host_path),
                readonly=volume_mount.read_only or must_be_read_only, selinux_relabel=False,
                propagation=PROPAGATION[volume_mount.mount_propagation]))
        if not any(m.mount_path == "/etc/hosts" for m in container.volume_mounts):
            mounts.append(cri.Mount(container_path="/etc/hosts", host_path=str(self._hosts_file(pod))))
        if container.termination_message_path:
            mounts.append(cri.Mount(container_path=container.termination_message_path,
                                    host_path=str(self._termination_log(pod, container))))
        return mounts

    def _hosts_file(self, pod: Pod) -> Path:
        path = self.pod_dir(pod) / "etc-hosts"
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        if pod.host_network:
            content = HOST_NETWORK_HOSTS_HEADER + Path("/etc/hosts").read_text()
        else:
            content = "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        path.write_text(content)
        os.chmod(path, 0o644)
        return path

    def _termination_log(self, pod: Pod, container: Container) -> Path:
        directory = self.pod_dir(pod) / "containers" / container.name
        directory.mkdir(parents=True, exist_ok=True, mode=0o750)
        path = directory / secrets.token_hex(4)
        path.touch()
        os.chmod(path, 0o666)
        return path

    def container_config(self, pod: Pod, container: Container, restart_count: int, image_ref: str,
                         image_uid: int | None, image_username: str) -> cri.ContainerConfig:
        env = dict(container.env)
        log_dir = self.pod_log_dir(pod) / container.name
        log_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        annotations = {CONTAINER_HASH: container_hash(container), CONTAINER_RESTART_COUNT: str(restart_count),
                       TERMINATION_MESSAGE_PATH: container.termination_message_path,
                       TERMINATION_MESSAGE_POLICY: container.termination_message_policy,
                       POD_TERMINATION_GRACE_PERIOD: str(pod.termination_grace_period_seconds)}
        labels = {POD_NAME_LABEL: pod.name, POD_NAMESPACE_LABEL: pod.namespace, POD_UID_LABEL: pod.uid,
                  CONTAINER_NAME_LABEL: container.name}
        security = cri.LinuxContainerSecurityContext(
            privileged=container.privileged, readonly_rootfs=container.read_only_root_filesystem,
            namespace_options=self.namespace_options(pod), supplemental_groups=self.supplemental_groups(pod),
            # AddNoNewPrivileges: only an explicit allowPrivilegeEscalation: false.
            no_new_privs=container.allow_privilege_escalation is False,
            capabilities=cri.Capability(add_capabilities=list(container.capabilities_add),
                                        drop_capabilities=list(container.capabilities_drop)),
            masked_paths=[] if container.privileged else DEFAULT_MASKED_PATHS,
            readonly_paths=[] if container.privileged else DEFAULT_READONLY_PATHS,
            seccomp=cri.SecurityProfile(profile_type=cri.SecurityProfile.Unconfined))
        run_as_user = container.run_as_user if container.run_as_user is not None else pod.run_as_user
        run_as_group = container.run_as_group if container.run_as_group is not None else pod.run_as_group
        if run_as_user is not None:
            security.run_as_user.value = run_as_user
        elif image_uid is not None:
            security.run_as_user.value = image_uid
        else:
            security.run_as_username = image_username
        if run_as_group is not None:
            security.run_as_group.value = run_as_group
        resources = self._best_effort_resources()
        resources.oom_score_adj = BESTEFFORT_OOM_SCORE_ADJ
        if container.memory_limit is not None:
            resources.memory_limit_in_bytes = container.memory_limit
            resources.oom_score_adj = burstable_oom_score_adj(container.memory_limit)
        resources.hugepage_limits.extend(cri.HugepageLimit(page_size=size, limit=0) for size in hugepage_sizes())
        return cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=container.name, attempt=restart_count),
            image=cri.ImageSpec(image=image_ref, user_specified_image=container.image),
            command=[expand(a, env) for a in container.command], args=[expand(a, env) for a in container.args],
            working_dir=container.working_dir, labels=labels, annotations=annotations,
            envs=[cri.KeyValue(key=k, value=v.encode()) for k, v in env.items()],
            mounts=self.make_mounts(pod, container), log_path=f"{container.name}/{restart_count}.log",
            stdin=container.stdin, stdin_once=container.stdin_once, tty=container.tty,
            linux=cri.LinuxContainerConfig(resources=resources, security_context=security))
