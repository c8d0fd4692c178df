"""A containerd of our own, for the demo, the tests and the benchmarks: the
CRI runtime the replayed kubelet (and critest) talks to, and the daemon
under `ctr` for containers run from a spec of one's own (crust.kubelet.ctr).

It runs beside anything else on the machine: its own root and state
directories, its own socket (gRPC and ttrpc), its own config file, its own
runc state root, its own cgroup root, its pods' network namespaces, all
below one directory this module owns. The CRI plugin is on (`cri=False` turns it off) with a sandbox
(pause) image built here (crust.kubelet.image); pods use the host's network
unless `pod_network` gives them a bridge of their own (crust.kubelet.cni).
Images are imported, or pulled through `mirrors`: a registry host (e.g.
registry.k8s.io) -> the URL of a registry standing in for it
(crust.kubelet.registry), as hosts.toml files below our directory.
Runtime handlers are named as in a node's config: `runc` is containerd's runc
shim with the stock runc, and each extra handler is the same shim with
another `BinaryName` (crust's OCI runtime). Shim runtimes of their own
(`crust`: runtime_type io.containerd.crust.v2, crust's microVM shim) are
found by containerd on its PATH, which starts with this interpreter's bin
directory (the venv holding containerd-shim-crust-v2).

close() leaves nothing behind, also when a test failed half-way or
containerd died: it removes the pods through CRI and the tasks of `ctr`'s
namespace while containerd answers,
stops containerd, kills the shims this containerd started (processes whose
command line is a runc or crust shim serving our socket),
force-deletes containers left in its runc root, unmounts everything below
its directory, removes the shims' sockets it can name, the cgroups below
its cgroup root, the pod network, and the directory. Nothing is touched
that another containerd could own.

The binary may be another containerd than the one on PATH (`binary`, e.g. a
containerd 2.x): its own directory then comes first on the PATH it and its
shims see (its ctr and containerd-shim-runc-v2 beside it), and the config
is written in the format its version reads (config_format()): 2 for 1.x,
3 for 2.0 to 2.2, 4 from 2.3, where the CRI plugin's settings are split
between io.containerd.cri.v1.images (the pause image, registry hosts) and
io.containerd.cri.v1.runtime (runtimes, CNI, OOM scores), and streaming
stays with io.containerd.grpc.v1.cri.

One thing is not ours to choose: containerd puts shim sockets in
/run/containerd/s whatever its state directory (the path is compiled in).
Their names are hashes of our socket's path, so they never collide with
another containerd's; close() removes ours, and the directory too when this
module made it and it is empty.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import cri_pb2
from crust.kubelet.cni import BridgeNetwork
from crust.kubelet.cri_daemon import CriDaemon
from crust.kubelet.image import Image
from crust.sys import caps, proc
from crust.sys.sweep import StillMounted, release_under

log = logging.getLogger(__name__)

NAMESPACE = "k8s.io"
# Containers run through `ctr` from specs of one's own (crust.kubelet.ctr):
# a namespace of their own, which CRI never lists.
CTR_NAMESPACE = "crust-ctr"
SHIM_SOCKETS = Path("/run/containerd")
CGROUP_FS = Path("/sys/fs/cgroup")
# Kubelet's CRI client gives an ordinary call two minutes.
CALL_TIMEOUT = 120.0


class ContainerdError(Exception):
    pass


def available() -> str:
    """Why a private containerd cannot run here, or "" when it can."""
    missing = [b for b in ("containerd", "ctr", "runc", "containerd-shim-runc-v2") if shutil.which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install containerd runc)"
    return ""


def version_of(binary: str) -> tuple[int, int]:
    """`containerd --version`'s release, major and minor: "containerd
    github.com/containerd/containerd/v2 v2.3.4 <commit>" -> (2, 3);
    Debian's "containerd containerd.io 1.6.20~ds1 <commit>" -> (1, 6)."""
    shown = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"\sv?(\d+)\.(\d+)\.\d+", shown)
    if found is None:
        raise ContainerdError(f"{binary} --version names no release: {shown.strip()!r}")
    return int(found[1]), int(found[2])


def config_format(version: tuple[int, int]) -> int:
    """The config format a containerd release reads natively (an older
    one is migrated, with warnings in its log)."""
    if version < (2, 0):
        return 2
    return 3 if version < (2, 3) else 4


def is_shim(argv: list[bytes]) -> bool:
    """A runc shim, or crust's (its daemon runs as `python -m crust.containerd_shim`)."""
    return argv[0].endswith(b"containerd-shim-runc-v2") or (
        len(argv) > 2 and argv[1:3] == [b"-m", b"crust.containerd_shim"]) or (
        len(argv) > 1 and argv[1].endswith(b"containerd-shim-crust-v2"))


def can_lower_oom_score() -> bool:
    """Whether this process may lower an OOM score (CAP_SYS_RESOURCE). A CRI
    sandbox asks for -998; without the capability runc's init fails with
    "failed to update /proc/self/oom_score_adj: Permission denied", so
    containerd must then keep scores at or above its own
    (restrict_oom_score_adj)."""
    return caps.effective(caps.CAP_SYS_RESOURCE)


def remove_cgroup_trees(name: str) -> list[str]:
    """The cgroup `name` (a path below each hierarchy's root) and every
    cgroup below it, in every hierarchy, deepest first; rmdir removes only
    an empty cgroup, so one a process is still in stays. Returns what could
    not be removed."""
    left = []
    name = name.strip("/")
    if not name:
        return left
    for hierarchy in sorted(CGROUP_FS.iterdir()) if CGROUP_FS.is_dir() else []:
        top = hierarchy / name
        if not top.is_dir() or top.is_symlink():
            continue
        for dirpath, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
            try:
                os.rmdir(dirpath)
            except OSError as exc:
                left.append(f"cgroup {dirpath} not removed: {exc.strerror}")
    return left


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string


@dataclass
class Containerd(CriDaemon):
    """One private containerd below `directory` (which it owns)."""

    directory: Path
    sandbox_image: str = ""
    # handler name -> BinaryName for io.containerd.runc.v2 ("" = stock runc)
    runtimes: dict[str, str] = field(default_factory=lambda: {"runc": ""})
    # handler name -> runtime_type of a shim of its own (containerd-shim-NAME-v2 on PATH)
    shim_runtimes: dict[str, str] = field(default_factory=dict)
    # handler name -> its `options` table (e.g. ConfigPath)
    shim_options: dict[str, dict[str, str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    # registry host -> the URL of the registry that stands in for it
    mirrors: dict[str, str] = field(default_factory=dict)
    # pods not on the host's network get a bridge of their own
    pod_network: bool = False
    cri: bool = True
    binary: str = "containerd"
    cgroup_root: str = field(default_factory=lambda: f"/crust-cri-{secrets.token_hex(4)}")
    process: subprocess.Popen | None = None
    network: BridgeNetwork | None = None
    _channel: grpc.Channel | None = None
    _made_shim_dir: bool = False
    _release: tuple[int, int] | None = None

    # -- layout -----------------------------------------------------------------------

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def config_path(self) -> Path:
        return self.directory / "config.toml"

    @property
    def runc_root(self) -> Path:
        return self.directory / "runc"

    @property
    def log_path(self) -> Path:
        return self.directory / "containerd.log"

    @property
    def task_dir(self) -> Path:
        return self.task_root / NAMESPACE

    @property
    def task_root(self) -> Path:
        return self.directory / "state" / "io.containerd.runtime.v2.task"

    @property
    def hosts_dir(self) -> Path:
        return self.directory / "certs.d"

    def release(self) -> tuple[int, int]:
        if self._release is None:
            self._release = version_of(self.binary)
        return self._release

    def config(self) -> str:
        """The config file, in the format this containerd reads natively."""
        form = config_format(self.release())
        header = [
            f"version = {form}",
            f"root = {toml_value(self.directory / 'root')}",
            f"state = {toml_value(self.directory / 'state')}",
            # Snapshotters this machine cannot use only add noise to the log.
            "disabled_plugins = " + toml_value([f"io.containerd.snapshotter.v1.{s}"
                                           for s in ("aufs", "btrfs", "devmapper", "zfs")]
                                          + ([] if self.cri else ["io.containerd.grpc.v1.cri"])),
            # From format 4 the listeners are server plugins; the top-level
            # tables are read only when an older format is migrated.
            *(['[plugins."io.containerd.server.v1.grpc"]', f"  address = {toml_value(self.socket)}",
               '[plugins."io.containerd.server.v1.ttrpc"]', f"  address = {toml_value(str(self.socket) + '.ttrpc')}"]
              if form >= 4 else
              ["[grpc]", f"  address = {toml_value(self.socket)}",
               "[ttrpc]", f"  address = {toml_value(str(self.socket) + '.ttrpc')}"]),
            '[plugins."io.containerd.internal.v1.opt"]', f"  path = {toml_value(self.directory / 'opt')}",
        ]
        body = self._cri_format2() if form == 2 else self._cri_format3()
        return "\n".join(header + body) + "\n"

    # Streaming (exec -it, attach) on an ephemeral loopback port.
    STREAMING = ['  stream_server_address = "127.0.0.1"', '  stream_server_port = "0"']
    # Pods' network namespaces below our state directory, not in the host's
    # /run/netns, where a tool that later binds /run/netns onto itself (as
    # `ip netns` and pyroute2 do on first use) would cover them and make
    # them impossible to remove.
    NETNS = "  netns_mounts_under_state_dir = true"

    def _cri_format2(self) -> list[str]:
        """containerd 1.x: one CRI plugin."""
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        return [
            f"[{cri}]",
            *([f"  sandbox_image = {toml_value(self.sandbox_image)}"] if self.sandbox_image else []),
            *self.STREAMING,
            f"  restrict_oom_score_adj = {toml_value(not can_lower_oom_score())}",
            self.NETNS,
            f"[{cri}.cni]",
            '  bin_dir = "/usr/lib/cni"',
            f"  conf_dir = {toml_value(self.directory / 'cni')}",
            f"[{cri}.registry]",
            f"  config_path = {toml_value(self.hosts_dir)}",
            *self._runtime_tables(f"{cri}.containerd", sandboxer=False),
        ]

    def _cri_format3(self) -> list[str]:
        """containerd 2.x: images, runtime and the CRI service apart; each
        runtime names the sandboxer that starts its pods (podsandbox: the
        pause container, as 1.x did)."""
        images, runtime = 'plugins."io.containerd.cri.v1.images"', 'plugins."io.containerd.cri.v1.runtime"'
        # bin_dirs since 2.1; 2.0 knows bin_dir only.
        bin_dirs = '  bin_dirs = ["/usr/lib/cni"]' if self.release() >= (2, 1) else '  bin_dir = "/usr/lib/cni"'
        return [
            *([f"[{images}.pinned_images]", f"  sandbox = {toml_value(self.sandbox_image)}"]
              if self.sandbox_image else []),
            f"[{images}.registry]",
            f"  config_path = {toml_value(self.hosts_dir)}",
            f"[{runtime}]",
            f"  restrict_oom_score_adj = {toml_value(not can_lower_oom_score())}",
            self.NETNS,
            f"[{runtime}.cni]",
            bin_dirs,
            f"  conf_dir = {toml_value(self.directory / 'cni')}",
            *self._runtime_tables(f"{runtime}.containerd", sandboxer=True),
            '[plugins."io.containerd.grpc.v1.cri"]',
            *self.STREAMING,
        ]

    def _runtime_tables(self, table: str, sandboxer: bool) -> list[str]:
        """The runtime handlers: runc's shim with each BinaryName, and the
        shims of their own."""
        lines = [f"[{table}]", '  default_runtime_name = "runc"']
        podsandbox = ['  sandboxer = "podsandbox"'] if sandboxer else []
        for name, binary in sorted(self.runtimes.items()):
            lines += [f"[{table}.runtimes.{toml_value(name)}]",
                      '  runtime_type = "io.containerd.runc.v2"', *podsandbox,
                      f"[{table}.runtimes.{toml_value(name)}.options]",
                      f"  Root = {toml_value(self.runc_root)}"]
            if binary:
                lines.append(f"  BinaryName = {toml_value(binary)}")
        for name, runtime_type in sorted(self.shim_runtimes.items()):
            lines += [f"[{table}.runtimes.{toml_value(name)}]",
                      f"  runtime_type = {toml_value(runtime_type)}", *podsandbox]
            if self.shim_options.get(name):
                lines.append(f"[{table}.runtimes.{toml_value(name)}.options]")
                lines += [f"  {key} = {toml_value(value)}" for key, value in sorted(self.shim_options[name].items())]
        return lines

    def write_hosts(self) -> None:
        """One hosts.toml per mirrored registry host: the registry standing
        in for it is its server (plain http), so a pull never leaves the
        machine, not even to fall back."""
        for host, url in sorted(self.mirrors.items()):
            directory = self.hosts_dir / host
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts.toml").write_text(
                f"server = {toml_value(url)}\n[host.{toml_value(url)}]\n  capabilities = [\"pull\", \"resolve\"]\n")

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "Containerd":
        """Start (or start again, keeping its state) and wait until CRI answers."""
        if self.process is not None and self.process.poll() is None:
            raise ContainerdError("this containerd is already running")
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for sub in ("cni", "opt", "certs.d"):
            (self.directory / sub).mkdir(exist_ok=True)
        if not SHIM_SOCKETS.exists():
            self._made_shim_dir = True
        if self.pod_network and self.network is None:
            self.network = BridgeNetwork(self.directory / "cni", self.directory / "cni-state")
            self.network.create()
        self.write_hosts()
        self.config_path.write_text(self.config())
        env = {"PATH": self.search_path(), **self.env}
        self.process = subprocess.Popen(
            [self.binary, "--config", str(self.config_path)], stdin=subprocess.DEVNULL,
            stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self._await_answer(timeout, ContainerdError, "containerd", "CRI" if self.cri else "ctr")

    def search_path(self) -> str:
        """The PATH containerd and its shims see: crust's shim first, then a
        containerd's own directory when it is not the one on PATH (its
        containerd-shim-runc-v2 and ctr belong to it)."""
        path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        own = Path(self.binary).parent if os.sep in self.binary else None
        return ":".join([str(Path(sys.executable).parent), *([str(own)] if own else []), path])

    def _answers(self) -> bool:
        if not self.cri:
            return self.ctr("version", check=False, timeout=10).returncode == 0
        return super()._answers()

    # -- CRI ----------------------------------------------------------------------------

    def import_image(self, image: Image, timeout: float = 120.0) -> None:
        """`ctr images import` into the CRI's namespace; waits until CRI sees it."""
        self.ctr("images", "import", str(image.archive), namespace=NAMESPACE, timeout=timeout)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = self.image_service.ImageStatus(
                cri_pb2.ImageStatusRequest(image=cri_pb2.ImageSpec(image=image.name)), timeout=10)
            if status.image.id:
                return
            time.sleep(0.05)
        raise ContainerdError(f"CRI does not list {image.name} after importing it")

    def ctr(self, *args: str, namespace: str = CTR_NAMESPACE, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """`ctr` against this containerd, in `ctr`'s namespace unless told."""
        ctr = shutil.which("ctr", path=self.search_path()) or "ctr"
        result = subprocess.run([ctr, "--address", str(self.socket), "--namespace", namespace, *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise ContainerdError(f"ctr {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
        return result

    # -- cleanup ------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop and remove everything this containerd made; returns what had
        to be cleaned up by force (empty after an orderly end). StillMounted
        (after the rest is cleaned up) when a mount in its directory would
        not go: the directory is kept then, never removed through it."""
        forced: list[str] = []
        if self.process is not None and self.process.poll() is None:
            if self.cri:
                forced += self._remove_pods()
            forced += self._remove_ctr_tasks()
        self.stop()
        forced += self._kill_shims()
        forced += self._delete_containers()
        still: StillMounted | None = None
        try:
            forced += release_under(self.directory)
        except StillMounted as exc:
            still = exc   # the rest cleaned up; the directory kept, not removed through the mount
        forced += self._remove_cgroups()
        if self.network is not None:
            forced += self.network.remove()
        if still is None:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self._made_shim_dir:
            # Made for our shims (and the runc shim's state below it, e.g.
            # runc/<namespace>): every directory left empty goes, deepest
            # first; a file or another containerd's directory keeps it.
            for top, _dirs, _files in sorted(os.walk(SHIM_SOCKETS), key=lambda w: -w[0].count("/")):
                try:
                    os.rmdir(top)
                except OSError:
                    pass
        if still is not None:
            raise still
        return forced

    def _remove_ctr_tasks(self) -> list[str]:
        """Tasks still running in `ctr`'s namespace, killed and deleted with
        their containers while containerd answers."""
        removed = []
        listing = self.ctr("tasks", "ls", "--quiet", check=False, timeout=30)
        for task in listing.stdout.split() if listing.returncode == 0 else []:
            self.ctr("tasks", "kill", "--all", "--signal", "SIGKILL", task, check=False, timeout=30)
            self.ctr("tasks", "delete", "--force", task, check=False, timeout=60)
            self.ctr("containers", "delete", task, check=False, timeout=30)
            removed.append(f"ctr task {task}")
        return removed

    def _bundles(self) -> list[Path]:
        try:
            return [p for ns in self.task_root.iterdir() if ns.is_dir() for p in ns.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []

    def _kill_shims(self) -> list[str]:
        """SIGKILL the shims this containerd started (they outlive it by
        design): processes whose command line is a runc shim's or crust's
        with our socket as its -address; then remove their sockets, named in
        the bundles of our state directory."""
        killed = []
        ours = str(self.socket).encode()

        def shim_of_ours(pid: int) -> bool:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                return False
            return bool(argv) and is_shim(argv) and any(
                flag == b"-address" and value == ours for flag, value in zip(argv, argv[1:]))

        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and shim_of_ours(int(entry.name)):
                if proc.signal_if(int(entry.name), lambda pid=int(entry.name): shim_of_ours(pid)):
                    killed.append(f"shim pid {entry.name}")
        for socket_path in self.shim_sockets():
            socket_path.unlink(missing_ok=True)
            killed.append(f"shim socket {socket_path.name[:12]}")
        return killed

    def shim_sockets(self) -> set[Path]:
        """The shims' sockets the bundles of our state directory name (their
        `address`), those in containerd's socket directory only."""
        found = set()
        for bundle in self._bundles():
            try:
                socket_path = Path((bundle / "address").read_text().strip().removeprefix("unix://"))
            except OSError:
                continue
            if socket_path.parent == SHIM_SOCKETS / "s" and socket_path.is_socket():
                found.add(socket_path)
        return found

    def _delete_containers(self) -> list[str]:
        """Containers left in our runc root, any namespace (a shim died
        without cleaning up): each configured runtime deletes them, crust's
        first (so its volume claims go too), stock runc last."""
        deleted = []
        binaries = [b for b in self.runtimes.values() if b] + ["runc"]
        states = sorted(p for p in self.runc_root.iterdir() if p.is_dir()) if self.runc_root.is_dir() else []
        for state in states:
            for container in sorted(p.name for p in state.iterdir() if p.is_dir()):
                for binary in binaries:
                    result = subprocess.run([binary, "--root", str(state), "delete", "--force", container],
                                            capture_output=True, timeout=60, env={**os.environ, **self.env})
                    if result.returncode == 0 or not (state / container).exists():
                        deleted.append(f"container {container[:13]}")
                        break
        return deleted

    def _remove_cgroups(self) -> list[str]:
        """The cgroups runc made below our cgroup root, deepest first; only
        empty ones can go (rmdir), which is all of them once every container
        is gone."""
        return remove_cgroup_trees(self.cgroup_root)
