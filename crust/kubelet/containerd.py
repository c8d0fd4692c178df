"""A containerd of our own, for the demo and the tests: the CRI runtime the
replayed kubelet talks to.

It runs beside anything else on the machine: its own root and state
directories, its own socket (gRPC and ttrpc), its own config file, its own
runc state root, its own cgroup root, all below one directory this module
owns. The CRI plugin is on, with no CNI configuration (pods use the host's
network), and a sandbox (pause) image built here (crust.kubelet.image).
Runtime handlers are named as in a node's config: `runc` is containerd's runc
shim with the stock runc, and each extra handler is the same shim with
another `BinaryName` (crust's OCI runtime). Shim runtimes of their own
(`crust`: runtime_type io.containerd.crust.v2, crust's microVM shim) are
found by containerd on its PATH, which starts with this interpreter's bin
directory (the venv holding containerd-shim-crust-v2).

close() leaves nothing behind, also when a test failed half-way or
containerd died: it removes the pods through CRI while containerd answers,
stops containerd, kills the shims this containerd started (processes whose
command line is a runc or crust shim serving our socket),
force-deletes containers left in its runc root, unmounts everything below
its directory, removes the shims' sockets it can name, the cgroups below
its cgroup root, and the directory. Nothing is touched that another
containerd could own.

One thing is not ours to choose: containerd 1.6 puts shim sockets in
/run/containerd/s whatever its state directory (the path is compiled in).
Their names are hashes of our socket's path, so they never collide with
another containerd's; close() removes ours, and the directory too when this
module made it and it is empty.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import cri_pb2, cri_pb2_grpc
from crust.common.channel import local_channel
from crust.kubelet.image import Image
from crust.sys import caps, proc
from crust.sys.sweep import release_under

log = logging.getLogger(__name__)

NAMESPACE = "k8s.io"
SHIM_SOCKETS = Path("/run/containerd")
CGROUP_FS = Path("/sys/fs/cgroup")
# Kubelet's CRI client gives an ordinary call two minutes.
CALL_TIMEOUT = 120.0


class ContainerdError(Exception):
    pass


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


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))  # a TOML basic string is a JSON string


@dataclass
class Containerd:
    """One private containerd below `directory` (which it owns)."""

    directory: Path
    sandbox_image: str
    # handler name -> BinaryName for io.containerd.runc.v2 ("" = stock runc)
    runtimes: dict[str, str] = field(default_factory=lambda: {"runc": ""})
    # handler name -> runtime_type of a shim of its own (containerd-shim-NAME-v2 on PATH)
    shim_runtimes: dict[str, str] = field(default_factory=dict)
    # handler name -> its `options` table (e.g. ConfigPath)
    shim_options: dict[str, dict[str, str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    binary: str = "containerd"
    cgroup_root: str = field(default_factory=lambda: f"/crust-cri-{secrets.token_hex(4)}")
    process: subprocess.Popen | None = None
    _channel: grpc.Channel | None = None
    _made_shim_dir: bool = False

    # -- layout -----------------------------------------------------------------------

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

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
        return self.directory / "state" / "io.containerd.runtime.v2.task" / NAMESPACE

    def config(self) -> str:
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        lines = [
            "version = 2",
            f"root = {_toml(self.directory / 'root')}",
            f"state = {_toml(self.directory / 'state')}",
            # Snapshotters this machine cannot use only add noise to the log.
            "disabled_plugins = " + _toml([f"io.containerd.snapshotter.v1.{s}"
                                           for s in ("aufs", "btrfs", "devmapper", "zfs")]),
            "[grpc]", f"  address = {_toml(self.socket)}",
            "[ttrpc]", f"  address = {_toml(str(self.socket) + '.ttrpc')}",
            '[plugins."io.containerd.internal.v1.opt"]', f"  path = {_toml(self.directory / 'opt')}",
            f"[{cri}]",
            f"  sandbox_image = {_toml(self.sandbox_image)}",
            # Streaming (exec -it, attach) on an ephemeral loopback port.
            '  stream_server_address = "127.0.0.1"', '  stream_server_port = "0"',
            f"  restrict_oom_score_adj = {_toml(not can_lower_oom_score())}",
            f"[{cri}.cni]",
            '  bin_dir = "/usr/lib/cni"',
            f"  conf_dir = {_toml(self.directory / 'cni')}",
            f"[{cri}.containerd]",
            '  default_runtime_name = "runc"',
        ]
        for name, binary in sorted(self.runtimes.items()):
            lines += [f"[{cri}.containerd.runtimes.{_toml(name)}]",
                      '  runtime_type = "io.containerd.runc.v2"',
                      f"[{cri}.containerd.runtimes.{_toml(name)}.options]",
                      f"  Root = {_toml(self.runc_root)}"]
            if binary:
                lines.append(f"  BinaryName = {_toml(binary)}")
        for name, runtime_type in sorted(self.shim_runtimes.items()):
            lines += [f"[{cri}.containerd.runtimes.{_toml(name)}]",
                      f"  runtime_type = {_toml(runtime_type)}"]
            if self.shim_options.get(name):
                lines.append(f"[{cri}.containerd.runtimes.{_toml(name)}.options]")
                lines += [f"  {key} = {_toml(value)}" for key, value in sorted(self.shim_options[name].items())]
        return "\n".join(lines) + "\n"

    # -- lifecycle --------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "Containerd":
        """Start (or start again, keeping its state) and wait until CRI answers."""
        if self.process is not None and self.process.poll() is None:
            raise ContainerdError("this containerd is already running")
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for sub in ("cni", "opt"):
            (self.directory / sub).mkdir(exist_ok=True)
        if not SHIM_SOCKETS.exists():
            self._made_shim_dir = True
        self.config_path.write_text(self.config())
        path = os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        env = {"PATH": f"{Path(sys.executable).parent}:{path}", **self.env}
        self.process = subprocess.Popen(
            [self.binary, "--config", str(self.config_path)], stdin=subprocess.DEVNULL,
            stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ContainerdError(f"containerd exited with {self.process.returncode}: {self.log_tail()}")
            if self.socket.exists():
                try:
                    self.version()
                    return self
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        raise ContainerdError(f"containerd did not answer CRI within {timeout:g} s: {self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
        """Stop containerd itself; its shims and containers keep running."""
        self._close_channel()
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def restart(self, sig: int = signal.SIGTERM) -> "Containerd":
        self.stop(sig)
        return self.start()

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- CRI ----------------------------------------------------------------------------

    @property
    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = local_channel(self.endpoint)
        return self._channel

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    @property
    def runtime_service(self) -> cri_pb2_grpc.RuntimeServiceStub:
        return cri_pb2_grpc.RuntimeServiceStub(self.channel)

    @property
    def image_service(self) -> cri_pb2_grpc.ImageServiceStub:
        return cri_pb2_grpc.ImageServiceStub(self.channel)

    def version(self) -> cri_pb2.VersionResponse:
        return self.runtime_service.Version(cri_pb2.VersionRequest(version="v1"), timeout=2)

    def import_image(self, image: Image, timeout: float = 120.0) -> None:
        """`ctr images import` into the CRI's namespace; waits until CRI sees it."""
        result = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", NAMESPACE, "images",
                                 "import", str(image.archive)], capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise ContainerdError(f"ctr images import {image.archive}: {result.stderr.strip()}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            status = self.image_service.ImageStatus(
                cri_pb2.ImageStatusRequest(image=cri_pb2.ImageSpec(image=image.name)), timeout=10)
            if status.image.id:
                return
            time.sleep(0.05)
        raise ContainerdError(f"CRI does not list {image.name} after importing it")

    def crictl_config(self) -> Path:
        """A crictl.yaml for this containerd (crictl --config PATH ps)."""
        path = self.directory / "crictl.yaml"
        path.write_text(f"runtime-endpoint: {self.endpoint}\nimage-endpoint: {self.endpoint}\ntimeout: 30\n")
        return path

    # -- cleanup ------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop and remove everything this containerd made; returns what had
        to be cleaned up by force (empty after an orderly end)."""
        forced: list[str] = []
        if self.process is not None and self.process.poll() is None:
            forced += self._remove_pods()
        self.stop()
        forced += self._kill_shims()
        forced += self._delete_containers()
        forced += release_under(self.directory)
        forced += self._remove_cgroups()
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._made_shim_dir:
            for path in (SHIM_SOCKETS / "s", SHIM_SOCKETS):
                try:
                    path.rmdir()
                except OSError:
                    break
        return forced

    def _remove_pods(self) -> list[str]:
        removed = []
        try:
            pods = self.runtime_service.ListPodSandbox(cri_pb2.ListPodSandboxRequest(), timeout=10).items
            for pod in pods:
                self.runtime_service.StopPodSandbox(cri_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=60)
                self.runtime_service.RemovePodSandbox(cri_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod.id),
                                                      timeout=60)
                removed.append(f"pod sandbox {pod.id[:13]}")
        except grpc.RpcError as exc:
            log.warning("could not remove pods through CRI", extra={"fields": {"error": str(exc.details())}})
        return removed

    def _bundles(self) -> list[Path]:
        try:
            return [p for p in self.task_dir.iterdir() if p.is_dir()]
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
        for bundle in self._bundles():
            try:
                address = (bundle / "address").read_text().strip().removeprefix("unix://")
            except OSError:
                continue
            socket_path = Path(address)
            if socket_path.parent == SHIM_SOCKETS / "s" and socket_path.is_socket():
                socket_path.unlink(missing_ok=True)
                killed.append(f"shim socket {socket_path.name[:12]}")
        return killed

    def _delete_containers(self) -> list[str]:
        """Containers left in our runc root (a shim died without cleaning
        up): each configured runtime deletes them, crust's first (so its
        volume claims go too), stock runc last."""
        state = self.runc_root / NAMESPACE
        if not state.is_dir():
            return []
        deleted = []
        binaries = [b for b in self.runtimes.values() if b] + ["runc"]
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
        removed = []
        name = self.cgroup_root.strip("/")
        if not name:
            return removed
        for hierarchy in sorted(CGROUP_FS.iterdir()) if CGROUP_FS.is_dir() else []:
            top = hierarchy / name
            if not top.is_dir() or top.is_symlink():
                continue
            for dirpath, _, _ in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
                try:
                    os.rmdir(dirpath)
                except OSError as exc:
                    removed.append(f"cgroup {dirpath} not removed: {exc.strerror}")
        return removed
