"""A container's OCI spec, rewritten for the guest's OCI runtime (crun).

containerd wrote the spec for the host: its root, its binds and the
namespaces it joins are host paths and host processes. In the pod's VM the
handler makes each bind's source ready in the guest first (crust.kata.pod.mount_plan
says what each is, crust.kata.pod.containers makes it: a share's bind, the pod's tmpfs, a deferred volume mounted by the guest),
then crun mounts the root and all of them in the container's own mount
namespace, as runc does on a host (each destination resolved inside the
root); each process the guest's agent would fork for a mount costs the
guest's one CPU tens of milliseconds under emulation, crun's mounts are
system calls. So the guest's spec keeps what the host's says about the
process and its confinement, and only what the guest can mean of the rest:

kept as it is   process (args, env, cwd, user and additional gids, umask,
                capabilities, no_new_privileges, rlimits, oom_score_adj),
                linux.maskedPaths, readonlyPaths, seccomp (compiled by crun
                with the guest's libseccomp), resources (memory, CPU, pids,
                huge pages (the agent drops a limit of a size the guest's
                kernel has not), the device allow list, block I/O: the
                guest's cgroup v2), personality;
rewritten       ociVersion -> the version of the spec written here (a 1.x
                host spec's fields are read as 1.0's; another major
                version is refused);
                root -> the container's root file system where the guest
                finds it (the pod's share; read-only by crun when the spec
                says so);
                linux.cgroupsPath -> /crust/<container id>/ctr in the guest's
                cgroup tree: crun makes and removes ctr, the agent keeps its
                parent until the container is deleted, so that the
                parent's memory.events (hierarchical) still tells after the
                exit whether the OOM killer struck; the agent signals, counts
                and measures a container's processes there;
                mounts -> in the host's order: the kernel's own file
                systems and tmpfs (/dev, where crun makes the default
                devices) made fresh; each bind's source the guest path the
                guest's agent made ready (named beside the spec in
                CreateContainer), read-only as the handler decides, with the
                host's nosuid, nodev, noexec; other types are dropped;
                namespaces: a new one is kept (mount, pid, cgroup, uts, ipc,
                time); one that names a path (the pod's sandbox on the host)
                becomes the guest's own, because the VM is the pod: its
                network, IPC and UTS; a shared PID namespace (the pod's, or
                the node's for hostPID) is the pod's in the guest (the
                agent adds its path), whose init (catatonit -P) reaps what
                the containers leave;
                process.terminal kept: crun makes the terminal in the
                container's devpts and hands its master to the guest's agent;
moved to the guest (pod-level, applied before the runtime starts): linux.sysctl
                (the pod's network and IPC namespaces are the guest's), the
                hostname when the UTS namespace is the pod's;
dropped         apparmorProfile, selinuxLabel, linux.mountLabel: labels of
                the host's LSM policy, which the guest kernel does not load
                (the VM boundary takes their place, as in Kata);
                linux.devices: host device nodes (a privileged container's,
                a device plugin's) name other devices in the guest, whose
                disks and consoles are its own (Kata's
                privileged_without_host_devices); linux.intelRdt;
refused         (INVALID_ARGUMENT naming the field) a user namespace and its
                mappings, hooks (host programs).
"""

from __future__ import annotations

import json
import re
from typing import Any

from crust.common.errors import InvalidArgument

GUEST_CGROUP_PARENT = "/crust"
# The guest's spec is this module's, made of the fields it knows, whatever
# minor version the host's spec states (CRI-O writes 1.3.0): the guest's
# crun (Debian 12's) takes only 1.0 specs.
GUEST_OCI_VERSION = "1.0.2"
FRESH_MOUNT_TYPES = {"proc", "sysfs", "devpts", "mqueue", "cgroup", "cgroup2"}
BIND_FLAGS = {"nosuid", "nodev", "noexec"}   # of a host bind's options, kept for its guest bind
NAMESPACES = {"mount", "pid", "cgroup", "uts", "ipc", "time", "network"}
SYSCTL_NAME = re.compile(r"^[a-z0-9_][a-z0-9_.\-/]*$")
HOSTNAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-]{0,62}$")


def pod_settings(host: dict[str, Any]) -> tuple[dict[str, str], str]:
    """(linux.sysctl, hostname) of a spec, checked: what the guest, which
    is the pod, applies for the pod's sandbox and its containers."""
    sysctls = {}
    for name, value in ((host.get("linux") or {}).get("sysctl") or {}).items():
        if not SYSCTL_NAME.match(name) or ".." in name or "\n" in str(value):
            raise InvalidArgument(f"linux.sysctl: {name!r} is no sysctl name")
        sysctls[name] = str(value)
    hostname = host.get("hostname") or ""
    if hostname and not HOSTNAME.match(hostname):
        raise InvalidArgument(f"hostname: {hostname!r} is no host name")
    return sysctls, hostname


def needs_pod_pid_namespace(host: dict[str, Any]) -> bool:
    """Whether the container shares a PID namespace (the pod's, with
    shareProcessNamespace or CRI's default; the node's, with hostPID or
    when the spec names none) rather than having one of its own."""
    own = [ns for ns in (host.get("linux") or {}).get("namespaces") or []
           if ns.get("type") == "pid" and not ns.get("path")]
    return not own


def guest_spec(host: dict[str, Any], root: str, container_id: str) -> tuple[dict[str, Any], dict[str, str], str]:
    """(the spec for crun, the sysctls to apply in the guest, the hostname
    to give the guest or ""). A container that shares a PID namespace
    (needs_pod_pid_namespace) gets the pod's from the guest's agent
    (CreateContainerRequest.pod_pid_namespace). InvalidArgument for what
    the guest cannot honour."""
    version = host.get("ociVersion", GUEST_OCI_VERSION)
    if not isinstance(version, str) or not version.startswith("1."):
        raise InvalidArgument(f"ociVersion: {version!r} is no version 1 of the OCI runtime spec")
    process = dict(host.get("process") or {})
    process["terminal"] = bool(process.get("terminal"))
    for label in ("apparmorProfile", "selinuxLabel"):
        process.pop(label, None)
    if host.get("hooks"):
        raise InvalidArgument("hooks: they run host programs, which the microVM's guest does not have")
    linux = dict(host.get("linux") or {})
    if linux.get("uidMappings") or linux.get("gidMappings"):
        raise InvalidArgument("linux.uidMappings/gidMappings: user namespaces are not supported in the microVM")

    namespaces, joined = [], set()
    for ns in linux.get("namespaces") or []:
        kind = ns.get("type", "")
        if kind == "user":
            raise InvalidArgument("linux.namespaces: a user namespace is not supported in the microVM")
        if kind not in NAMESPACES:
            raise InvalidArgument(f"linux.namespaces: {kind!r} is no namespace the microVM knows")
        if ns.get("path"):
            joined.add(kind)        # the pod's: the guest's own
        elif kind != "network":     # the pod's network is the VM's; a new empty one would cut it off
            namespaces.append({"type": kind})
    if not any(ns["type"] == "mount" for ns in namespaces):
        namespaces.append({"type": "mount"})   # crun jails the root with pivot_root in one
    # A container without a PID namespace of its own shares the pod's (CRI's
    # default, shareProcessNamespace) or the node's (hostPID): in a VM both
    # are the pod's shared namespace, whose init reaps the orphans, and the
    # guest's agent adds its path. Never the guest's own: crun waits for
    # every child it has, and in the guest's namespace a container's orphans
    # would be crun's, so a container would outlive its first process; and
    # the agent's processes are no container's to see.

    sysctls, hostname = pod_settings(host)
    own_uts = any(ns["type"] == "uts" for ns in namespaces)

    # In the host's order (a later mount may land inside an earlier one):
    # the kernel's file systems and tmpfs made fresh, the binds with the
    # sources the guest's agent places.
    mounts = []
    for m in host.get("mounts") or []:
        if _is_bind(m):
            flags = [o for o in m.get("options") or [] if o in BIND_FLAGS]
            mounts.append({"destination": m.get("destination", ""), "type": "bind", "source": "",
                           "options": ["bind", *flags]})
        elif m.get("type") in FRESH_MOUNT_TYPES or m.get("type") == "tmpfs":
            mounts.append(m)
    _add_defaults(mounts)
    resources = dict(linux.get("resources") or {})
    out_linux: dict[str, Any] = {
        "namespaces": namespaces,
        "cgroupsPath": f"{GUEST_CGROUP_PARENT}/{container_id}/ctr",
        "resources": resources,
    }
    for key in ("maskedPaths", "readonlyPaths", "seccomp", "personality", "rootfsPropagation"):
        if linux.get(key):
            out_linux[key] = linux[key]
    spec: dict[str, Any] = {
        "ociVersion": GUEST_OCI_VERSION,
        "process": process,
        # Read-only again by crun in its mount namespace (its bind of the
        # root would carry the agent's read-only mount, its remount not).
        "root": {"path": root, "readonly": bool((host.get("root") or {}).get("readonly"))},
        "mounts": mounts,
        "linux": out_linux,
        "annotations": {},
    }
    if hostname and own_uts:
        spec["hostname"] = hostname
    return spec, sysctls, hostname if hostname and not own_uts else ""


# What every container gets, as containerd's default spec gives it, where
# a spec lacks it (a spec containerd did not write): its own /proc, a /dev
# where crun makes the default devices, its terminals and a /dev/shm.
DEFAULT_MOUNTS = (
    {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
     "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
     "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
     "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
)


def _add_defaults(mounts: list[dict[str, Any]]) -> None:
    """Each default mount the list lacks, right after the mount it lies in
    (the mounts below /dev after /dev), else first."""
    for default in DEFAULT_MOUNTS:
        where = default["destination"]
        if any(m.get("destination", "").rstrip("/") == where for m in mounts):
            continue
        parent = where.rsplit("/", 1)[0]
        at = next((i + 1 for i, m in enumerate(mounts) if parent and m.get("destination") == parent), 0)
        mounts.insert(at, json.loads(json.dumps(default)))


def exec_process(container_process: dict[str, Any], args: list[str], env: list[str], cwd: str, uid: int,
                 gid: int, additional_gids: list[int] | None = None, terminal: bool = False) -> dict[str, Any]:
    """An exec's process: the container's (its capabilities, no_new_privs,
    rlimits, seccomp are the container's, as containerd builds an exec's
    spec) with the command, environment, directory and user asked for."""
    process = json.loads(json.dumps(container_process))
    process.update({"terminal": terminal, "args": list(args), "env": list(env), "cwd": cwd or "/"})
    process.pop("consoleSize", None)   # the container's; an exec's terminal is sized by its resizes
    user = dict(process.get("user") or {})
    user.update({"uid": uid, "gid": gid})
    if additional_gids is not None:
        user["additionalGids"] = list(additional_gids)
    process["user"] = user
    return process


def _is_bind(m: dict[str, Any]) -> bool:
    options = m.get("options") or []
    return m.get("type") == "bind" or "bind" in options or "rbind" in options
