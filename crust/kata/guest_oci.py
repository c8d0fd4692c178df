"""A container's OCI spec, rewritten for the guest's OCI runtime (crun).

containerd wrote the spec for the host: its root, its binds and the
namespaces it joins are host paths and host processes. In the pod's VM the
handler makes each bind's source ready in the guest first (crust.kata.pod_containers:
a share's bind, the pod's tmpfs, a deferred volume mounted by the guest),
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
                huge pages, the device allow list, block I/O: the guest's
                cgroup v2), personality;
rewritten       root -> the container's root file system where the guest
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
                handler made ready (place_mounts), read-only as the handler
                decides, with the host's nosuid, nodev, noexec; other types
                are dropped;
                namespaces: a new one is kept (mount, pid, cgroup, uts, ipc,
                time); one that names a path (the pod's sandbox on the host)
                becomes the guest's own, because the VM is the pod: its
                network, IPC and UTS; a shared PID namespace (the pod's, or
                the node's for hostPID) is the pod's in the guest, whose
                init (catatonit -P) reaps what the containers leave;
                process.terminal kept where the guest's agent makes the
                container (crun makes the terminal in the container's devpts
                and hands its master to the agent); otherwise false for
                crun: a process that asks for a terminal runs on one that
                util-linux's script makes in the guest (crun's own needs a program that takes the terminal
                over a socket, which the guest does not have): standard
                input, output and error are a terminal, of consoleSize where
                the spec gives one, resized by ResizeTerminal; it is a
                terminal of the guest's /dev/pts, not of the container's
                devpts, so ttyname(3) finds no name for it;
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

A process's standard input, when it has one, is a fifo that the guest's
feed.sh fills from the file the host appends it to (crust.kata.pods,
WriteInput); without one it reads /dev/null.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from crust.common.errors import InvalidArgument

GUEST_CGROUP_PARENT = "/crust"
RUNTIME = "/sbin/crun"
RUNTIME_ROOT = "/run/crust/crun"       # crun's state, in guest memory
GUEST_COMMANDS = "/run/crust/cmd"      # <name>.json: a process's spec (the container's, or an exec's process)
GUEST_INPUTS = "/run/crust/in"         # <name>: the fifo a process reads its standard input from
FEED = "/usr/lib/crust/feed.sh"
SCRIPT = "/sbin/script"                # util-linux's: a terminal for a process that asks for one
EXITS = "/run/crust/exec"              # <pid>.exit: the agent's record of a spawned process's end
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


def guest_spec(host: dict[str, Any], root: str, container_id: str, pod_pid_namespace: str = "",
               pid_by_agent: bool = False, terminal_by_runtime: bool = False
               ) -> tuple[dict[str, Any], dict[str, str], str]:
    """(the spec for crun, the sysctls to apply in the guest, the hostname
    to give the guest or ""). pod_pid_namespace: the path of the pod's PID
    namespace in the guest, for a container that shares one
    (needs_pod_pid_namespace); pid_by_agent: the guest's agent adds it
    (CreateContainerRequest.pod_pid_namespace); terminal_by_runtime: crun
    makes the process's terminal (the agent's CreateContainer), else the
    guest's script does. InvalidArgument for what the guest cannot honour."""
    process = dict(host.get("process") or {})
    process["terminal"] = bool(process.get("terminal")) and terminal_by_runtime
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
    if not any(ns["type"] == "pid" for ns in namespaces):
        # The pod's (shareProcessNamespace, CRI's default) or the node's
        # (hostPID): in a VM both are the pod's shared namespace, whose
        # init reaps the orphans. Never the guest's own: crun waits for
        # every child it has, and in the guest's namespace a container's
        # orphans would be crun's, so a container would outlive its first
        # process; and the agent's processes are no container's to see.
        if pod_pid_namespace:
            namespaces.append({"type": "pid", "path": pod_pid_namespace})
        elif not pid_by_agent:
            raise InvalidArgument("linux.namespaces: the container shares a PID namespace, and the pod has none")

    sysctls, hostname = pod_settings(host)
    own_uts = any(ns["type"] == "uts" for ns in namespaces)

    # In the host's order (a later mount may land inside an earlier one):
    # the kernel's file systems and tmpfs made fresh, the binds with their
    # guest sources once the handler has them ready (place_mounts).
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
        "ociVersion": host.get("ociVersion", "1.0.2"),
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


def place_mounts(spec: dict[str, Any], root: str, sources: list[tuple[str, bool]]) -> None:
    """The container's root and its binds' guest sources into its spec:
    sources holds, for each bind in the spec's order, the guest path bound
    there (a share's bind, the pod's tmpfs, a deferred volume's mount) and
    whether the bind is read-only. crun then mounts them all in the
    container's own namespace (each destination resolved inside the root,
    its mount point made as runc makes one), and /proc, /dev and the rest."""
    binds = [m for m in spec.get("mounts") or [] if m.get("type") == "bind"]
    if len(binds) != len(sources):
        raise ValueError(f"{len(binds)} binds in the spec, {len(sources)} sources given")
    for m, (source, readonly) in zip(binds, sources):
        m["source"] = source
        m["options"] = [o for o in m["options"] if o not in ("ro", "rw")] + ["ro" if readonly else "rw"]
    spec["root"]["path"] = root


def leave_binds_to_agent(spec: dict[str, Any]) -> None:
    """The spec for a guest whose agent binds the container's root, binds,
    /dev and /proc itself (one older than agent 11): crun mounts only the
    kernel's file systems, over what the agent made."""
    spec["mounts"] = [m for m in spec.get("mounts") or [] if m.get("type") in FRESH_MOUNT_TYPES]


def unplaced(spec: dict[str, Any]) -> list[str]:
    """The destinations of binds whose guest source is not placed yet."""
    return [m.get("destination", "") for m in spec.get("mounts") or [] if m.get("type") == "bind" and not m["source"]]


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


def _write_json(path: str, document: dict[str, Any]) -> str:
    """A line that writes document to path in the guest: printf is the
    shell's own, no process (each is tens of milliseconds of the guest's
    one CPU under emulation); any size, as no program's arguments carry it."""
    text = json.dumps(document, separators=(",", ":"))
    return f"printf '%s\\n' {shlex.quote(text)} > {shlex.quote(path)} || exit 126\n"


def sysctl_lines(sysctls: dict[str, str], hostname: str) -> str:
    lines = ""
    for name, value in sorted(sysctls.items()):
        path = "/proc/sys/" + name.replace(".", "/") if "/" not in name else "/proc/sys/" + name
        lines += (f"printf '%s' {shlex.quote(value)} > {shlex.quote(path)} || "
                  f"{{ echo 'crust: sysctl {name} could not be set' >&2; exit 126; }}\n")
    if hostname:
        lines += f"hostname {shlex.quote(hostname)} || exit 126\n"
    return lines


@dataclass(frozen=True)
class Stdio:
    """How a process's standard streams are given to it in the guest: name
    (its output files' name) also names its input fifo; input is the guest
    path of the file the host appends its standard input to ("" when it has
    none); terminal: it runs on a terminal of size (columns, rows), 0 for
    the terminal's default."""
    name: str
    input: str = ""
    terminal: bool = False
    size: tuple[int, int] = (0, 0)


def terminal_size(process: dict[str, Any]) -> tuple[int, int]:
    """(columns, rows) of an OCI process's consoleSize, (0, 0) without one."""
    size = process.get("consoleSize") or {}
    try:
        return int(size.get("width") or 0), int(size.get("height") or 0)
    except (TypeError, ValueError):
        raise InvalidArgument("process.consoleSize: width and height are numbers") from None


def _start(command: str, stdio: Stdio) -> str:
    """The script's last lines: its input fifo fed (feed.sh, detached, so
    that it never is crun's child: crun waits for all its children), then
    command exec'd, on a terminal when asked (script -e: the exit code is
    the command's; the terminal's size set inside it, before the command)."""
    lines = ""
    redirect = ""
    if stdio.input:
        fifo = f"{GUEST_INPUTS}/{stdio.name}"
        # $PPID is the agent's wrapper, which records this process's end.
        lines += (f"mkdir -p {GUEST_INPUTS} && mkfifo -m 0600 {shlex.quote(fifo)} || exit 126\n"
                  f"( sh {FEED} {shlex.quote(stdio.input)} {EXITS}/$PPID.exit > {shlex.quote(fifo)} & )\n")
        redirect = f" < {shlex.quote(fifo)}"
    if stdio.terminal:
        columns, rows = stdio.size
        inner = f"stty cols {columns} rows {rows} 2>/dev/null; " if columns and rows else ""
        command = f"{SCRIPT} -q -e -c {shlex.quote(inner + 'exec ' + command)} /dev/null"
    return lines + f"exec {command}{redirect}\n"


def run_script(container_id: str, spec: dict[str, Any], sysctls: dict[str, str], hostname: str,
               stdio: Stdio) -> str:
    """The guest's script for the container's own process: the pod's
    settings, the bundle, then crun in the foreground (its exit code is the
    container's; it forwards the signals it gets to the container)."""
    if unplaced(spec):
        raise ValueError(f"binds without a guest source: {', '.join(unplaced(spec))}")
    # The spec beside the process's script (the agent's `forget` removes
    # both): crun reads it once, and keeps its own copy in its state.
    config = f"{GUEST_COMMANDS}/{stdio.name}.json"
    return (sysctl_lines(sysctls, hostname)
            + _write_json(config, spec)
            + _start(f"{RUNTIME} --root {RUNTIME_ROOT} run --bundle {GUEST_COMMANDS} --config {shlex.quote(config)} "
                     f"{shlex.quote(container_id)}", stdio))


def exec_script(container_id: str, process: dict[str, Any], stdio: Stdio) -> str:
    """The guest's script for an exec in a running container."""
    path = f"{GUEST_COMMANDS}/{stdio.name}.json"
    return (_write_json(path, process)
            + _start(f"{RUNTIME} --root {RUNTIME_ROOT} exec --process {shlex.quote(path)} "
                     f"{shlex.quote(container_id)}", stdio))
