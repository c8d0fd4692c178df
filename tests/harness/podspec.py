"""A pod's container spec as kubelet and containerd's CRI plugin turn it into
an OCI runtime spec, for the parts crust's DaemonSet uses: command and args
(with $(VAR) expanded from env), env values and fieldRefs, the securityContext
(privileged, runAsUser), hostPath volumes (type checked or created), configMap
volumes (kubelet's atomic-writer layout: ..data and a timestamped directory,
the keys as symlinks through ..data), readOnly, and mountPropagation (None:
rprivate, HostToContainer: rslave, Bidirectional: rshared, allowed only for a
privileged container and only over a host mount that is shared, as
containerd checks). Anything else in the container spec that would change
how it runs is refused, so nothing is silently left out.

The base is containerd's default spec (`ctr oci spec`); privileged does what
the CRI plugin does: every capability this process holds, no masked or read-only paths, /sys and
cgroups read-write, every device allowed.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from crust.kubelet.atomic_writer import AtomicWriter, FileProjection
from crust.kubelet.payloads import DEFAULT_MODE
from crust.sys import mount as sysmount

PROPAGATION = {None: "rprivate", "None": "rprivate", "HostToContainer": "rslave", "Bidirectional": "rshared"}
# Keys of a container spec that change nothing in how the container runs
# here (ports need no CNI for a pod IP the test does not use; the probe is
# served by a sidecar; requests only weigh in scheduling and cgroup shares).
IGNORED_KEYS = {"name", "image", "ports", "livenessProbe", "readinessProbe", "resources"}
SUPPORTED_KEYS = IGNORED_KEYS | {"command", "args", "env", "securityContext", "volumeMounts"}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class Refused(Exception):
    """What kubelet or containerd would refuse, with their reason."""


@dataclass
class PodContext:
    """What kubelet knows when it starts the container."""

    pod_name: str
    namespace: str
    node_name: str
    workdir: Path                       # where kubelet keeps the pod's configMap volumes
    host_path: Callable[[str], Path]    # a hostPath's path -> where it is on this machine
    config_maps: dict[str, dict] = field(default_factory=dict)
    extra_env: dict[str, str] = field(default_factory=dict)      # service env vars kubelet adds
    extra_mounts: list[dict] = field(default_factory=list)       # service account token etc.


def default_spec(ctr: Callable[..., subprocess.CompletedProcess]) -> dict:
    return json.loads(ctr("oci", "spec").stdout)


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, others kept."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _field(path: str, ctx: PodContext) -> str:
    values = {"spec.nodeName": ctx.node_name, "metadata.name": ctx.pod_name,
              "metadata.namespace": ctx.namespace}
    if path not in values:
        raise Refused(f"fieldRef {path} is not one this renderer knows")
    return values[path]


def container_env(container: dict, ctx: PodContext) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = _field(item["valueFrom"]["fieldRef"]["fieldPath"], ctx)
        else:
            raise Refused(f"env {item['name']}: only value and fieldRef are supported here")
    return env


def _is_shared(path: Path) -> bool:
    """Is the mount holding path a shared one (a peer group), as containerd's
    CRI requires for Bidirectional?"""
    best, shared = "", False
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")[0].split(" ")
        mount_point = sysmount.parse_mountinfo(line)[0].mount_point
        if (str(path) + "/").startswith(mount_point.rstrip("/") + "/") and len(mount_point) >= len(best):
            best, shared = mount_point, any(f.startswith("shared:") for f in fields[6:])
    return shared


def config_map_volume(name: str, config_map: dict, ctx: PodContext) -> Path:
    """Kubelet's layout for a configMap volume, written by its atomic
    writer (crust.kubelet.atomic_writer): the files in a timestamped
    directory, ..data pointing to it, each key a symlink through ..data."""
    directory = ctx.workdir / "volumes" / "kubernetes.io~configmap" / name
    directory.mkdir(parents=True, exist_ok=True)
    AtomicWriter(directory).write({key: FileProjection(value.encode(), DEFAULT_MODE)
                                   for key, value in config_map.get("data", {}).items()})
    return directory


def volume_source(volume: dict, ctx: PodContext) -> Path:
    if "hostPath" in volume:
        host = volume["hostPath"]
        where = ctx.host_path(host["path"])
        kind = host.get("type", "")
        if kind == "DirectoryOrCreate":
            where.mkdir(mode=0o755, parents=True, exist_ok=True)
        elif kind == "Directory" and not where.is_dir():
            raise Refused(f"hostPath type check failed: {host['path']} is not a directory")
        elif kind not in ("", "Directory", "DirectoryOrCreate"):
            raise Refused(f"hostPath type {kind} is not supported here")
        return where
    if "configMap" in volume:
        name = volume["configMap"]["name"]
        if name not in ctx.config_maps:
            raise Refused(f"configmap {name} not found")
        return config_map_volume(volume["name"], ctx.config_maps[name], ctx)
    raise Refused(f"volume {volume['name']}: only hostPath and configMap are supported here")


def user_ids(uid: int, rootfs: Path) -> tuple[int, int]:
    """The group of uid in the image's /etc/passwd (0 when it has none), as
    containerd sets it when only runAsUser is given."""
    for line in (rootfs / "etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) > 3 and fields[2] == str(uid):
            return uid, int(fields[3])
    return uid, 0


def image_user(config: dict, rootfs: Path) -> tuple[int, int]:
    user = config.get("User", "") or "0"
    name, _, group = user.partition(":")
    uid = int(name) if name.isdigit() else next(
        int(line.split(":")[2]) for line in (rootfs / "etc/passwd").read_text().splitlines()
        if line.split(":")[0] == name)
    return (uid, int(group)) if group.isdigit() else user_ids(uid, rootfs)


def oci_spec(pod: dict, container_name: str, ctx: PodContext, *, image_config: dict, rootfs: Path,
             base: dict, netns: Path, cgroup: str) -> dict:
    """The OCI runtime spec of one container of the pod spec."""
    container = next(c for c in pod["containers"] if c["name"] == container_name)
    unknown = set(container) - SUPPORTED_KEYS
    if unknown:
        raise Refused(f"container {container_name}: keys this renderer does not handle: {sorted(unknown)}")
    spec = json.loads(json.dumps(base))
    env = container_env(container, ctx)

    # Kubernetes: command replaces the image's ENTRYPOINT, args its CMD.
    entrypoint = container.get("command") or image_config.get("Entrypoint") or []
    arguments = container.get("args") if "args" in container else (
        [] if "command" in container else image_config.get("Cmd") or [])
    spec["process"]["args"] = [expand(a, env) for a in entrypoint + arguments]
    image_env = dict(item.split("=", 1) for item in image_config.get("Env", []))
    spec["process"]["env"] = [f"{k}={v}" for k, v in {**image_env, **ctx.extra_env, **env}.items()]
    spec["process"]["cwd"] = image_config.get("WorkingDir") or "/"
    spec["hostname"] = ctx.pod_name

    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    unknown = set(security) - {"privileged", "runAsUser", "runAsGroup"}
    if unknown:
        raise Refused(f"securityContext keys this renderer does not handle: {sorted(unknown)}")
    if "runAsUser" in security:
        uid, gid = user_ids(security["runAsUser"], rootfs)
    else:
        uid, gid = image_user(image_config, rootfs)
    gid = security.get("runAsGroup", gid)
    spec["process"]["user"] = {"uid": uid, "gid": gid}
    privileged = bool(security.get("privileged"))
    if privileged:
        names = current_capabilities()
        spec["process"]["capabilities"] = {k: list(names) for k in ("bounding", "effective", "permitted")}
        spec["process"]["noNewPrivileges"] = False
        spec["linux"]["maskedPaths"] = []
        spec["linux"]["readonlyPaths"] = []
        spec["linux"].setdefault("resources", {})["devices"] = [{"allow": True, "access": "rwm"}]
        for m in spec["mounts"]:
            if m["type"] in ("sysfs", "cgroup"):
                m["options"] = [o for o in m["options"] if o != "ro"] + ["rw"]
        spec["linux"].pop("seccomp", None)

    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = []
    for vm in container.get("volumeMounts", []):
        source = volume_source(volumes[vm["name"]], ctx)
        propagation = vm.get("mountPropagation")
        if propagation not in PROPAGATION:
            raise Refused(f"mountPropagation {propagation} is not valid")
        if propagation == "Bidirectional":
            if not privileged:
                raise Refused(f"volumeMount {vm['name']}: Bidirectional mount propagation is available "
                              "only to privileged containers")
            if not _is_shared(source):
                raise Refused(f"path {source} is mounted on a mount that is not shared "
                              "(containerd refuses Bidirectional there)")
        mounts.append({"destination": vm["mountPath"], "type": "bind", "source": str(source),
                       "options": ["rbind", PROPAGATION[propagation], "ro" if vm.get("readOnly") else "rw"]})
    mounts += ctx.extra_mounts
    # containerd drops a default mount that a volume replaces, then mounts
    # the volumes parents first.
    destinations = {m["destination"].rstrip("/") for m in mounts}
    spec["mounts"] = [m for m in spec["mounts"] if m["destination"].rstrip("/") not in destinations]
    spec["mounts"] += sorted(mounts, key=lambda m: m["destination"].rstrip("/").count("/"))
    propagations = {m["options"][1] for m in mounts if m["type"] == "bind"}
    if "rshared" in propagations:
        spec["linux"]["rootfsPropagation"] = "rshared"
    elif "rslave" in propagations:
        spec["linux"]["rootfsPropagation"] = "rslave"

    spec["root"] = {"path": str(rootfs), "readonly": False}
    spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "network"] + [
        {"type": "network", "path": str(netns)}]
    spec["linux"]["cgroupsPath"] = cgroup
    return spec


def current_capabilities() -> list[str]:
    """The capabilities this process may hand on (its bounding set): what
    containerd's CRI gives a privileged container (WithAllCurrentCapabilities).
    Not every capability: where the host itself runs with a reduced set, a
    spec asking for more fails in runc ("unable to apply caps")."""
    status = Path("/proc/self/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("CapBnd:")), 16)
    return [name for bit, name in enumerate(capability_names()) if mask >> bit & 1]


def capability_names() -> list[str]:
    """Linux capabilities by number (include/uapi/linux/capability.h)."""
    return ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
            "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
            "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER",
            "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT",
            "CAP_SYS_ADMIN", "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME",
            "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE", "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL",
            "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM",
            "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE"]
