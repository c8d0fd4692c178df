"""A CRI-O of our own, for the tests: the other CRI runtime kubelet drives,
beside containerd (crust.kubelet.containerd), so that crust's runtimes
are tried under both.

CRI-O is not packaged in Debian 12: the binary (and its pinns helper) is a
build of one's own, named by the caller. It runs beside anything else on
the machine, everything it keeps below one directory this module owns: its
storage root and runroot (the vfs driver, through a storage.conf of ours
named by CONTAINERS_STORAGE_CONF, so the host's containers configuration is
never read), its socket, its config file and an empty --config-dir (no
drop-in of the host's), registries.conf and its drop-in directory, a
signature policy that accepts anything, its version and clean-shutdown
files, the exits, attach-socket, pinned-namespace, pod-log, hooks, CDI and
auth directories, and each runtime's state root. Pods' cgroups go below
`cgroup_root` (cgroupfs), the monitor (conmon) of each container in its
pod's cgroup. NRI is off.

Runtime handlers, as in a node's config: `runc` is the stock runc, each
extra OCI handler another runtime in runc's place (crust's crust-runc),
each VM handler a containerd shim v2 binary (runtime_type "vm", as Kata
runs under CRI-O), with more settings of its table where given. CRI-O
gives an OCI runtime no environment of its own but the handler's
monitor_env: `env` goes there, for every OCI handler. A VM handler's shim
gets no monitor_env: it inherits CRI-O's own environment, and its settings
reach it through runtime_config_path (in the sandbox's CreateTaskRequest).
Where this machine cannot give a container what CRI-O asks (an OOM score
below root's, huge page limits without a hugetlb cgroup hierarchy), each
OCI handler's runtime is called through crust.kubelet.runtime_wrapper, which
adjusts the bundle as containerd's settings for those cases do.

Images are pulled: `mirrors` maps a registry host (registry.k8s.io,
localhost, ...) to the URL of a registry standing in for it
(crust.kubelet.registry), insecure, in registries.conf. The pause image is
one whose /pause exits on SIGTERM (crust.kubelet.image.pause_image): CRI-O
stops an infra container gracefully. Pods not on the host's network get a
bridge of their own (crust.kubelet.cni, `pod_network`); CRI-O's own host
port mapping is off unless asked for (the CNI portmap plugin maps them),
since it keeps a table of the host's nftables.

close() leaves nothing behind, also when a test failed half-way or CRI-O
died: pods removed through CRI while it answers, CRI-O stopped, the
monitors (conmon) of our containers and the shims of our VM handlers
killed (and the shims' sockets removed), containers left in our runtime
roots deleted, every mount below our directory released (storage, pinned
namespaces), our cgroups, the pod network, and what CRI-O makes outside its
directory, only when this instance made it (what was there is noted before
its first start): the nftables table `ip crio-hostports`, the `crio`
cgroups, /run/crun, and the image library's blob info cache (its path is
compiled in for root, /var/lib/containers/cache; CRI-O has no setting).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.kubelet import runtime_wrapper
from crust.kubelet.cni import BridgeNetwork
from crust.kubelet.containerd import CGROUP_FS, can_lower_oom_score, is_shim, remove_cgroup_trees, toml_value
from crust.kubelet.cri_daemon import CriDaemon
from crust.kubelet.image import PAUSE_COMMAND
from crust.sys import proc
from crust.sys.sweep import StillMounted, release_under

log = logging.getLogger(__name__)

CONMON = "/usr/bin/conmon"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Made by CRI-O outside its directory whatever its config says: the host
# port table (nftables, with host port mapping on), its cgroup, and paths:
# crun's default state root, and the blob info cache of the image library
# (its directory is compiled in for root; CRI-O has no setting for it).
HOSTPORT_TABLE = ("ip", "crio-hostports")
# How long a private CRI-O waits for another of the same binary to close
# (a whole critest run on CRI-O, three handlers, fits in it).
MACHINE_WAIT = 1800.0
CRIO_CGROUP = "crio"
BLOB_INFO_CACHE = Path("/var/lib/containers/cache/blob-info-cache-v1.sqlite")
# Files first (the cache and SQLite's companions), then directories
# (removed only when empty), deepest first.
OUTSIDE_PATHS = (BLOB_INFO_CACHE, *(BLOB_INFO_CACHE.with_name(BLOB_INFO_CACHE.name + suffix)
                                    for suffix in ("-wal", "-shm", "-journal")),
                 BLOB_INFO_CACHE.parent, BLOB_INFO_CACHE.parent.parent, Path("/run/crun"))


# sun_path's size less its terminating NUL.
UNIX_PATH_MAX = 107


class CrioError(Exception):
    pass


def available(binary: str | Path, pinns: str | Path) -> str:
    """Why a private CRI-O cannot run here, or "" when it can."""
    missing = [str(p) for p in (binary, pinns) if not os.access(p, os.X_OK)]
    if missing:
        return f"not executable: {', '.join(missing)}"
    if not os.access(CONMON, os.X_OK):
        return f"{CONMON} is missing (apt-get install conmon)"
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc)"
    return ""


def _table(name: str, values: dict) -> list[str]:
    return [f"[{name}]", *(f"  {key} = {toml_value(value)}" for key, value in values.items())]


def hostport_table_exists() -> bool:
    result = subprocess.run(["nft", "list", "table", *HOSTPORT_TABLE], capture_output=True, timeout=30,
                            check=False)
    return result.returncode == 0


def cgroups_named(name: str) -> set[Path]:
    return {h / name for h in CGROUP_FS.iterdir() if (h / name).is_dir()} if CGROUP_FS.is_dir() else set()


@dataclass
class Crio(CriDaemon):
    """One private CRI-O below `directory` (which it owns)."""

    stop_timeout = 30.0   # how long stop() waits for crio itself (CriDaemon)

    directory: Path
    binary: Path
    pinns: Path
    pause_image: str
    # handler name -> the OCI runtime in runc's place ("" = stock runc)
    runtimes: dict[str, str] = field(default_factory=lambda: {"runc": ""})
    # handler name -> a containerd shim v2 binary (runtime_type "vm")
    vm_runtimes: dict[str, str] = field(default_factory=dict)
    # VM handler name -> more of its table's settings (runtime_config_path, ...)
    vm_runtime_settings: dict[str, dict] = field(default_factory=dict)
    # the OCI runtimes' environment (their handlers' monitor_env)
    env: dict[str, str] = field(default_factory=dict)
    # registry host -> the URL of the registry that stands in for it
    mirrors: dict[str, str] = field(default_factory=dict)
    pod_network: bool = False
    host_port_mapping: bool = False
    # Pod metrics (CRI's ListPodSandboxMetrics), which CRI-O collects only
    # for the kinds its config names: none unless asked for.
    pod_metrics: bool = False
    # runtime_wrapper's adjustments, by default where this machine needs them
    raise_oom_floor: bool = field(default_factory=lambda: not can_lower_oom_score())
    drop_hugepage_limits: bool = field(default_factory=lambda: not runtime_wrapper.hugetlb_cgroup_mounted())
    cgroup_root: str = field(default_factory=lambda: f"/crust-crio-{secrets.token_hex(4)}")
    process: subprocess.Popen | None = None
    network: BridgeNetwork | None = None
    # What was there outside our directory before our first start (never
    # removed by close()): the host port table, the crio cgroup, OUTSIDE_PATHS.
    _found: set[str] | None = None
    removed_outside: list[str] = field(default_factory=list)
    # What of CRI-O's outside its directory was still there when close()
    # was done (before another private CRI-O could start).
    left_outside: set[str] = field(default_factory=set)
    _machine_lock: int | None = None
    _channel: grpc.Channel | None = None

    # -- layout -----------------------------------------------------------------------

    @property
    def socket(self) -> Path:
        return self.directory / "crio.sock"

    @property
    def config_path(self) -> Path:
        return self.directory / "crio.conf"

    @property
    def log_path(self) -> Path:
        return self.directory / "crio.log"

    @property
    def storage_conf(self) -> Path:
        return self.directory / "storage.conf"

    @property
    def registries_conf(self) -> Path:
        return self.directory / "registries.conf"

    @property
    def attach_dir(self) -> Path:
        # One letter: every byte counts against the sockets' limit (check_paths).
        return self.directory / "a"

    def runtime_root(self, handler: str) -> Path:
        return self.directory / "runtimes" / handler

    def real_runtime(self, handler: str) -> str:
        """The OCI runtime of a handler."""
        return self.runtimes[handler] or shutil.which("runc") or "runc"

    @property
    def wrapped(self) -> bool:
        return self.raise_oom_floor or self.drop_hugepage_limits

    def runtime_path(self, handler: str) -> str:
        """What CRI-O runs for an OCI handler: its runtime, or the wrapper in
        front of it when this machine needs an adjustment."""
        return str(self.directory / "wrappers" / handler) if self.wrapped else self.real_runtime(handler)

    def config(self) -> str:
        d = self.directory
        lines = _table("crio", {
            "root": d / "storage", "runroot": d / "run" / "storage", "storage_driver": "vfs",
            "log_dir": d / "pod-logs", "version_file": d / "run" / "version",
            "version_file_persist": d / "version", "clean_shutdown_file": d / "clean.shutdown"})
        lines += _table("crio.api", {"listen": self.socket, "stream_address": "127.0.0.1", "stream_port": "0"})
        # No AppArmor profile of CRI-O's is loaded into the host's kernel.
        lines += _table("crio.runtime", {
            "default_runtime": "runc", "cgroup_manager": "cgroupfs", "pinns_path": self.pinns,
            "container_exits_dir": d / "run" / "exits", "container_attach_socket_dir": self.attach_dir,
            "namespaces_dir": d / "run" / "ns", "hooks_dir": [d / "hooks"], "cdi_spec_dirs": [d / "cdi"],
            "default_mounts_file": d / "mounts.conf", "disable_hostport_mapping": not self.host_port_mapping,
            "selinux": False, "apparmor_profile": "unconfined", "log_level": "info"})
        monitor_env = [f"PATH={PATH}", *(f"{k}={v}" for k, v in sorted(self.env.items()))]
        for name in sorted(self.runtimes):
            lines += _table(f"crio.runtime.runtimes.{toml_value(name)}", {
                "runtime_path": self.runtime_path(name), "runtime_type": "oci",
                "runtime_root": self.runtime_root(name), "monitor_path": CONMON, "monitor_cgroup": "pod",
                "monitor_env": monitor_env})
        for name, shim in sorted(self.vm_runtimes.items()):
            lines += _table(f"crio.runtime.runtimes.{toml_value(name)}", {
                **self.vm_runtime_settings.get(name, {}), "runtime_path": shim, "runtime_type": "vm",
                "runtime_root": self.runtime_root(name)})
        # Images are named in full: no short name is ever looked up.
        lines += _table("crio.image", {
            "pause_image": self.pause_image, "pause_command": PAUSE_COMMAND,
            "signature_policy": d / "policy.json", "namespaced_auth_dir": d / "auth",
            "global_auth_file": "", "short_name_mode": "disabled"})
        lines += _table("crio.network", {"network_dir": d / "cni", "plugin_dirs": ["/usr/lib/cni"]})
        lines += _table("crio.nri", {"enable_nri": False})
        lines += _table("crio.metrics", {"enable_metrics": False})
        if self.pod_metrics:
            lines += _table("crio.stats", {"included_pod_metrics": ["all"]})
        return "\n".join(lines) + "\n"

    def registries(self) -> str:
        """Every mirrored host served by its stand-in over plain http; no
        short names resolved anywhere."""
        lines = ["unqualified-search-registries = []"]
        for host, url in sorted(self.mirrors.items()):
            location = url.split("://", 1)[-1].rstrip("/")
            lines += ["[[registry]]", f"prefix = {toml_value(host)}", f"location = {toml_value(location)}", "insecure = true"]
        return "\n".join(lines) + "\n"

    def storage(self) -> str:
        return "\n".join([
            "[storage]", 'driver = "vfs"', f"graphroot = {toml_value(self.directory / 'storage')}",
            f"runroot = {toml_value(self.directory / 'run' / 'storage')}"]) + "\n"

    def check_paths(self) -> None:
        """A container's attach socket is <attach_dir>/<64-hex id>/attach,
        which CRI-O dials by that path: one longer than a unix socket
        address holds makes every Attach fail ("connect: invalid
        argument") while the container runs. Our directory must be short
        enough."""
        longest = len(str(self.attach_dir / ("0" * 64) / "attach"))
        if longest > UNIX_PATH_MAX:
            raise CrioError(f"directory {self.directory} is too long: a container's attach socket below it would "
                            f"take {longest} bytes, a unix socket's path at most {UNIX_PATH_MAX}")

    def write_config(self) -> None:
        d = self.directory
        for sub in ("cni", "conf.d", "registries.d", "hooks", "cdi", "auth", "pod-logs", "run"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        (d / "mounts.conf").touch()
        (d / "policy.json").write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}) + "\n")
        self.storage_conf.write_text(self.storage())
        self.registries_conf.write_text(self.registries())
        for name in self.runtimes if self.wrapped else ():
            runtime_wrapper.write_wrapper(Path(self.runtime_path(name)), self.real_runtime(name),
                                          self.raise_oom_floor, self.drop_hugepage_limits)
        self.config_path.write_text(self.config())

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> Crio:
        """Start (or start again, keeping its state) and wait until CRI answers."""
        if self.process is not None and self.process.poll() is None:
            raise CrioError("this CRI-O is already running")
        self.check_paths()
        self._hold_machine()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self._found is None:
            self._found = self.outside()
        if self.pod_network and self.network is None:
            self.network = BridgeNetwork(self.directory / "cni", self.directory / "cni-state")
            self.network.create()
        self.write_config()
        # HOME below ours: the image library looks for a user's registries.conf
        # and credentials there, and none of root's must count.
        env = {"PATH": os.environ.get("PATH", PATH), "CONTAINERS_STORAGE_CONF": str(self.storage_conf),
               "CONTAINERS_REGISTRIES_CONF": str(self.registries_conf), "HOME": str(self.directory)}
        argv = [str(self.binary), "--config", str(self.config_path), "--config-dir", str(self.directory / "conf.d"),
                "--registries-conf", str(self.registries_conf),
                "--registries-conf-dir", str(self.directory / "registries.d")]
        with open(self.log_path, "ab") as log_file:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self._await_answer(timeout, CrioError, "crio")

    # -- cleanup ------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop and remove everything this CRI-O made; returns what had to
        be cleaned up by force (empty after an orderly end). What it made
        outside its directory, which CRI-O never removes itself, is noted
        in removed_outside. StillMounted (after the rest is cleaned up) when
        a mount in its directory would not go: the directory is kept then."""
        forced: list[str] = []
        if self.process is not None and self.process.poll() is None:
            forced += self._remove_pods()
        self.stop()
        forced += self._kill_monitors()
        forced += self._kill_shims()
        forced += self._delete_containers()
        still: StillMounted | None = None
        try:
            forced += release_under(self.directory)
        except StillMounted as exc:
            still = exc   # the rest cleaned up; the directory kept, not removed through the mount
        forced += remove_cgroup_trees(self.cgroup_root)
        if self.network is not None:
            forced += self.network.remove()
        self.removed_outside += self._remove_outside()
        self.left_outside = self.made_outside()
        if still is None:
            shutil.rmtree(self.directory, ignore_errors=True)
        self._let_go_of_machine()
        if still is not None:
            raise still
        return forced

    def _hold_machine(self, timeout: float = MACHINE_WAIT) -> None:
        """One private CRI-O of a binary at a time on a machine (a lock on
        the binary, held from the first start to close()): what CRI-O makes
        outside its directory (the /crio cgroup of pods without a cgroup
        parent, /run/crun, the image library's cache) is the same for every
        instance, so one could not tell what it made from what another did,
        nor remove its own without taking another's."""
        if self._machine_lock is not None:
            return
        descriptor = os.open(self.binary, os.O_RDONLY | os.O_CLOEXEC)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(descriptor)
                    raise CrioError(f"another private CRI-O of {self.binary} kept running for {timeout:.0f} s")
                time.sleep(0.2)
        self._machine_lock = descriptor

    def _let_go_of_machine(self) -> None:
        if self._machine_lock is not None:
            os.close(self._machine_lock)
            self._machine_lock = None

    def _kill_monitors(self) -> list[str]:
        """SIGKILL the conmons of our containers (they outlive CRI-O by
        design): processes whose program is conmon and whose command line
        names a path below our directory (exit directory, bundle, socket)."""
        killed = []
        ours = str(self.directory).encode() + b"/"

        def monitor_of_ours(pid: int) -> bool:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                return False
            return bool(argv) and argv[0].endswith(b"conmon") and any(ours in arg for arg in argv[1:])

        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and monitor_of_ours(int(entry.name)) and proc.signal_if(
                    int(entry.name), lambda pid=int(entry.name): monitor_of_ours(pid)):
                killed.append(f"conmon pid {entry.name}")
        return killed

    def _kill_shims(self) -> list[str]:
        """SIGKILL the shims of our VM handlers (they outlive CRI-O by
        design; CRI-O names no address of its own, so a shim is known by a
        path below our directory on its command line: its bundle's log),
        then remove the sockets our bundles name that nobody serves any more."""
        from crust.sys.sockets import remove_if_dead

        killed = [f"shim pid {pid}" for pid in self.shim_pids()
                  if proc.signal_if(pid, lambda pid=pid: self._is_shim_of_ours(pid))]
        for path in self.shim_sockets():
            if remove_if_dead(str(path)):
                killed.append(f"shim socket {path.name[:12]}")
        return killed

    def _is_shim_of_ours(self, pid: int) -> bool:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        ours = str(self.directory).encode() + b"/"
        return bool(argv) and is_shim(argv) and any(ours in arg for arg in argv[1:])

    def shim_pids(self) -> list[int]:
        """The shims (daemons) of our VM handlers' pods."""
        return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and self._is_shim_of_ours(int(e.name))]

    def shim_sockets(self) -> set[Path]:
        """The sockets of the shims our bundles name (each VM container's
        `address`), those in the shims' socket directory only."""
        from crust.containerd_shim.options import SOCKET_DIR

        found = set()
        bundles = self.directory / "run" / "storage"
        for address in bundles.glob("*-containers/*/userdata/address") if bundles.is_dir() else []:
            try:
                path = Path(address.read_text().strip().removeprefix("unix://"))
            except OSError:
                continue
            if path.parent == SOCKET_DIR and path.is_socket():
                found.add(path)
        return found

    def _delete_containers(self) -> list[str]:
        """Containers left in our runtime roots (CRI-O died or could not
        remove a pod): the handler's own runtime deletes them first (crust's
        releases its volume claims), stock runc after it."""
        deleted = []
        env = {"PATH": PATH, **self.env}
        for name in sorted(self.runtimes):
            root = self.runtime_root(name)
            binaries = [b for b in (self.runtimes[name], shutil.which("runc")) if b]
            for container in sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
                for binary in binaries:
                    result = subprocess.run([binary, "--root", str(root), "delete", "--force", container],
                                            capture_output=True, timeout=60, env=env, check=False)
                    if result.returncode == 0 or not (root / container).exists():
                        deleted.append(f"container {container[:13]}")
                        break
        return deleted

    @staticmethod
    def outside() -> set[str]:
        """What of CRI-O's outside its directory is there now."""
        found = {str(p) for p in OUTSIDE_PATHS if p.exists()}
        if hostport_table_exists():
            found.add("nftables table " + " ".join(HOSTPORT_TABLE))
        if cgroups_named(CRIO_CGROUP):
            found.add(f"cgroup {CRIO_CGROUP}")
        return found

    def made_outside(self) -> set[str]:
        """What of CRI-O's outside its directory appeared since our first start."""
        return self.outside() - (self._found if self._found is not None else self.outside())

    def _remove_outside(self) -> list[str]:
        """What CRI-O made outside its directory, only when it was not
        there before this instance first started; a directory only when
        empty (another tool's files keep it)."""
        made = self.made_outside()
        removed = []
        if "nftables table " + " ".join(HOSTPORT_TABLE) in made:
            subprocess.run(["nft", "delete", "table", *HOSTPORT_TABLE], capture_output=True, timeout=30,
                           check=False)
            removed.append("nftables table " + " ".join(HOSTPORT_TABLE))
        if f"cgroup {CRIO_CGROUP}" in made:
            left = remove_cgroup_trees(CRIO_CGROUP)
            removed.append(f"cgroup {CRIO_CGROUP}" + (f" ({len(left)} busy)" if left else ""))
        for path in OUTSIDE_PATHS:
            if str(path) not in made:
                continue
            try:
                path.rmdir() if path.is_dir() else path.unlink()
                removed.append(str(path))
            except OSError:
                pass
        return removed
