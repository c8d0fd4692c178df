"""Test harness: real `crust driver` processes on real unix sockets.

Everything a test creates lives under one temporary root; cleanup unmounts
only mounts below that root and detaches only loop devices whose backing
file is below it, so a test never touches what it did not create.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import csi_pb2, csi_pb2_grpc
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from crust.sys import netns
from crust.sys.sweep import release_under

AccessMode = csi_pb2.VolumeCapability.AccessMode
MIB = 1024**2
GIB = 1024**3


def sha256_of(path: Path | str) -> str:
    """The hex SHA-256 of a file's bytes (a volume's backing file, an image)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


def blkid(path: Path | str, tag: str = "TYPE") -> str:
    """What blkid's low-level probe reads in a device or file ("" for nothing)."""
    out = subprocess.run(["blkid", "-p", "-o", "value", "-s", tag, "--", str(path)], capture_output=True, text=True)
    return out.stdout.strip()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later zombie still answers kill 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def mount_cap(fs_type: str = "", mode: int = AccessMode.SINGLE_NODE_WRITER, flags=()) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type, mount_flags=list(flags)),
        access_mode=AccessMode(mode=mode),
    )


def block_cap(mode: int = AccessMode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(), access_mode=AccessMode(mode=mode))


def cleanup_root(root: Path) -> None:
    """Detach and unmount what lives under root (deepest mounts first);
    StillMounted (the test fails) when a mount there would not go."""
    release_under(root)


class CsiProcess:
    """A crust daemon serving CSI on `socket`: stubs and CO-side shortcuts."""

    # Set by the dataclasses below.
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    def _launch(self, what: str, argv: list[str], ready, timeout: float, program: tuple[str, ...] = ()) -> None:
        """Start `python -m crust ARGV` (or PROGRAM ARGV, a plugin that is not
        crust's) and wait until ready(channel) holds on its socket; the
        process's stderr goes to log_path."""
        command = list(program) or [sys.executable, "-m", "crust"]
        self.proc = subprocess.Popen([*command, *argv], stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            if self.socket.exists():
                self.channel = grpc.insecure_channel(f"unix://{self.socket}")
                try:
                    if ready():
                        return
                except grpc.RpcError:
                    pass
                self.channel.close()
            time.sleep(0.05)
        raise TimeoutError(f"{what} not ready: {self.log_path.read_text()[-2000:]}")

    def restart(self):
        self.stop()
        return self.start()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    @property
    def identity(self) -> csi_pb2_grpc.IdentityStub:
        return csi_pb2_grpc.IdentityStub(self.channel)

    @property
    def controller(self) -> csi_pb2_grpc.ControllerStub:
        return csi_pb2_grpc.ControllerStub(self.channel)

    @property
    def group(self) -> csi_pb2_grpc.GroupControllerStub:
        return csi_pb2_grpc.GroupControllerStub(self.channel)

    @property
    def node(self) -> csi_pb2_grpc.NodeStub:
        return csi_pb2_grpc.NodeStub(self.channel)

    # -- CO-side shortcuts used by many tests ----------------------------------

    def create(self, name: str, size: int = 64 * MIB, cap=None, **kw) -> csi_pb2.Volume:
        req = csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=size),
            volume_capabilities=[cap or mount_cap()], **kw)
        return self.controller.CreateVolume(req, timeout=60).volume

    def stage(self, volume_id: str, staging: Path, cap=None) -> None:
        self.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), volume_capability=cap or mount_cap()), timeout=60)

    def publish(self, volume_id: str, staging: Path, target: Path, cap=None, readonly=False) -> None:
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging), target_path=str(target),
            volume_capability=cap or mount_cap(), readonly=readonly), timeout=60)

    def unpublish(self, volume_id: str, target: Path) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=volume_id, target_path=str(target)), timeout=60)

    def unstage(self, volume_id: str, staging: Path) -> None:
        self.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=volume_id, staging_target_path=str(staging)), timeout=60)

    def delete(self, volume_id: str) -> None:
        self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume_id), timeout=60)


@dataclass
class DriverProcess(CsiProcess):
    root: Path
    node_id: str = "node-a"
    mode: str = "all"
    extra: list[str] = field(default_factory=list)
    endpoint_name: str = "csi.sock"
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.root / self.endpoint_name

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.endpoint_name}.log"

    def start(self, timeout: float = 15.0) -> "DriverProcess":
        self._launch("driver", ["driver", "--endpoint", f"unix://{self.socket}", "--node-id", self.node_id,
                                "--data-dir", str(self.data_dir), "--mode", self.mode, "--capacity", "100Gi",
                                *self.extra],
                     lambda: self.identity.Probe(csi_pb2.ProbeRequest(), timeout=2).ready.value, timeout)
        return self


@dataclass
class ShimProcess(CsiProcess):
    """`crust shim` in front of a DriverProcess, with a Runtime API endpoint."""

    root: Path
    backend: DriverProcess
    proxy_socket: Path
    extra: list[str] = field(default_factory=list)
    endpoint_name: str = "shim.sock"
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.root / self.endpoint_name

    @property
    def state_dir(self) -> Path:
        return self.root / "shim-state"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.endpoint_name}.log"

    def start(self, timeout: float = 15.0) -> "ShimProcess":
        self._launch("shim", ["shim", "--endpoint", f"unix://{self.socket}",
                              "--backend-endpoint", f"unix://{self.backend.socket}",
                              "--proxy-endpoint", f"unix://{self.proxy_socket}", "--state-dir", str(self.state_dir),
                              *self.extra],
                     lambda: self.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=2), timeout)
        return self



@dataclass
class ProxyProcess(CsiProcess):
    """`crust proxy` in front of a ShimProcess; kubelet talks to `socket`.

    The runtime endpoint is the shim's proxy socket (root/proxy.sock, inside
    the 0700 temporary root); the kubelet root is root/kubelet."""

    root: Path
    plugin: ShimProcess
    extra: list[str] = field(default_factory=list)
    endpoint_name: str = "kubelet-csi.sock"
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.root / self.endpoint_name

    @property
    def runtime_socket(self) -> Path:
        return self.plugin.proxy_socket

    @property
    def volumes_dir(self) -> Path:
        return self.root / "volumes"

    @property
    def kata_dir(self) -> Path:
        return self.root / "kata"

    @property
    def state_dir(self) -> Path:
        return self.root / "proxy-state"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.endpoint_name}.log"

    def target(self, pod: str, pv: str) -> Path:
        """A target path laid out as kubelet lays it out."""
        return self.kubelet_root / "pods" / pod / "volumes" / "kubernetes.io~csi" / pv / "mount"

    def staging(self, pv: str) -> Path:
        return self.kubelet_root / "plugins" / "kubernetes.io" / "csi" / "staging" / pv / "globalmount"

    def start(self, timeout: float = 15.0) -> "ProxyProcess":
        self.kubelet_root.mkdir(exist_ok=True)
        self._launch("proxy", ["proxy", "--csi-endpoint", f"unix://{self.socket}",
                               "--plugin-endpoint", f"unix://{self.plugin.socket}",
                               "--runtime-endpoint", f"unix://{self.runtime_socket}",
                               "--volumes-dir", str(self.volumes_dir), "--state-dir", str(self.state_dir),
                               "--kata-dir", str(self.kata_dir), "--kubelet-root", str(self.kubelet_root),
                               *self.extra],
                     lambda: self.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=2), timeout)
        return self


    def runtime_channel(self) -> grpc.Channel:
        return grpc.insecure_channel(f"unix://{self.runtime_socket}")


@dataclass
class HandlerProcess:
    """`crust handler` (mount-namespace sandboxes), or with command=("kata",
    "handler") the microVM handler, registered with a ProxyProcess."""

    root: Path
    proxy: ProxyProcess
    name: str = "mountns"
    endpoint_name: str = "handler.sock"
    command: tuple[str, ...] = ("handler",)
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> Path:
        return self.root / self.endpoint_name

    @property
    def state_dir(self) -> Path:
        return self.root / f"{self.name}-state"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.endpoint_name}.log"

    def start(self, timeout: float = 15.0) -> "HandlerProcess":
        argv = [sys.executable, "-m", "crust", *self.command, "--endpoint", f"unix://{self.socket}",
                "--proxy-endpoint", f"unix://{self.proxy.runtime_socket}", "--volumes-dir",
                str(self.proxy.volumes_dir), "--state-dir", str(self.state_dir), "--name", self.name, *self.extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.log_path, "ab"))
        deadline = time.monotonic() + timeout
        from crust.api import registry_pb2, registry_pb2_grpc
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"handler exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            with self.proxy.runtime_channel() as channel:
                try:
                    names = [h.name for h in registry_pb2_grpc.RegistryStub(channel).ListHandlers(
                        registry_pb2.ListHandlersRequest(), timeout=2).handlers if not h.lease_expired]
                except grpc.RpcError:
                    names = []
            if self.name in names and self.socket.exists():
                return self
            time.sleep(0.05)
        raise TimeoutError(f"handler not registered: {self.log_path.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code, self.proc = self.proc.returncode, None
        return code

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def sandbox(self, *args: str) -> subprocess.CompletedProcess:
        """Run `crust sandbox ARGS` against this handler."""
        return subprocess.run([sys.executable, "-m", "crust", "sandbox", "--handler-endpoint",
                               f"unix://{self.socket}", *args], capture_output=True, text=True, timeout=120)


def kill_sandbox_holders(root: Path) -> None:
    """Sandboxes outlive their handler by design; a test root kills the
    holders of its own handlers' sandboxes: processes with a mount under
    <root>/<handler>-state/run/, which exists only inside such a sandbox's
    namespace (host mounts propagate into every namespace, so merely
    mentioning the root would also match other roots' sandboxes)."""
    own = re.compile(re.escape(str(root.resolve())) + r"/[^/ ]+-state/(run|accel-probe|pool)/")
    killed: list[Path] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[0].endswith(b"qemu-system-x86_64"):
                # A microVM sandbox (or the handler's KVM probe VM, or a VM
                # its pool booted ahead): its logs live under the state dir.
                if not own.search(b" ".join(argv).decode(errors="replace")):
                    continue
            elif argv[:2] != [b"sleep", b"infinity"] or not own.search((entry / "mountinfo").read_text()):
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed.append(entry)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    # Gone before the caller detaches loop devices they held open.
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline:
        killed = [e for e in killed if e.exists() and "Z" not in _state(e)]
        time.sleep(0.05)


def kill_processes_rooted_under(prefix: str) -> None:
    """Container processes of a test's sandboxes: their root directory is a
    bundle's rootfs below prefix. Root.close() kills sandbox holders only; a
    test that failed before deleting its sandboxes (or with its handler
    down) must not leave a process pinning a volume in a leftover namespace."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "root").startswith(prefix):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue


def remove_network_namespaces(root: Path) -> None:
    """The network namespaces of the sandboxes of this root's handlers (a
    test that left its sandboxes running leaves theirs too)."""
    for run_dir in root.resolve().glob("**/run"):
        netns.sweep(run_dir, keep=set())


def _state(proc_dir: Path) -> str:
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


class Root:
    """A short temporary root (unix socket paths must stay under 108 bytes)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="crust-t-"))
        self.drivers: list[DriverProcess] = []
        self.unexpected: list[str] = []

    def driver(self, **kw) -> DriverProcess:
        d = DriverProcess(root=self.path, **kw)
        self.drivers.append(d)
        return d

    def shim(self, backend: DriverProcess, **kw) -> ShimProcess:
        s = ShimProcess(root=self.path, backend=backend, proxy_socket=self.path / "proxy.sock", **kw)
        # Stopped before the drivers (close() stops in reverse order).
        self.drivers.append(s)
        return s

    def proxy(self, plugin: ShimProcess, **kw) -> ProxyProcess:
        p = ProxyProcess(root=self.path, plugin=plugin, **kw)
        self.drivers.append(p)
        return p

    def stack(self, proxy_extra=(), shim_extra=(), driver_extra=()) -> tuple[DriverProcess, ShimProcess, "ProxyProcess"]:
        """driver -> shim -> proxy, started in that order (the shim's Runtime
        API calls reach the proxy once it is up)."""
        driver = self.driver(extra=list(driver_extra)).start()
        shim = self.shim(driver, extra=list(shim_extra)).start()
        proxy = self.proxy(shim, extra=list(proxy_extra)).start()
        return driver, shim, proxy

    def handler(self, proxy: ProxyProcess, **kw) -> HandlerProcess:
        h = HandlerProcess(root=self.path, proxy=proxy, **kw)
        self.drivers.append(h)
        return h

    def close(self) -> None:
        for d in reversed(self.drivers):
            try:
                d.stop()
            except Exception:  # noqa: BLE001 - cleanup goes on
                pass
        self.unexpected = unexpected_errors(self.path)
        kill_sandbox_holders(self.path)
        remove_network_namespaces(self.path)
        cleanup_root(self.path)
        shutil.rmtree(self.path, ignore_errors=True)


def unexpected_errors(root: Path) -> list[str]:
    """Lines of the daemons' logs under root that show an unexpected
    exception: a request that ended in INTERNAL through a bug (the
    interceptor logs it as "unexpected error" with its traceback)."""
    found = []
    for log in sorted(root.glob("*.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        found += [f"{log.name}: {_unexpected(line)}" for line in text.splitlines() if "unexpected error" in line]
    return found


def _unexpected(line: str) -> str:
    """A log line of an unexpected error, short: where and which request,
    and its traceback's last lines (the exception itself is at the end)."""
    try:
        entry = json.loads(line)
    except ValueError:
        return line[:500]
    trace = str(entry.pop("exc", ""))
    return f"{json.dumps(entry)[:400]}\n  ...{trace[-1500:]}"


def stop_child(child: subprocess.Popen, grace: float = 10) -> int:
    """SIGTERM a process the test started, SIGKILL it after grace seconds; its exit code."""
    child.terminate()
    try:
        return child.wait(grace)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def fill_until_full(directory: Path, name: str = ".filler") -> Path:
    """A file in directory grown until its file system refuses (ENOSPC)."""
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, 1 << 16, 4096, 512):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    finally:
        os.close(fd)
    return path


def code_of(call, *args, **kw) -> grpc.StatusCode:
    """Run an RPC that must fail; return its status code."""
    try:
        call(*args, **kw)
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError("the call succeeded but was expected to fail")


def mounted_at(path: Path) -> sysmount.MountEntry | None:
    return sysmount.at(str(path))


def loop_autoclear(device: str) -> bool:
    """Is the loop device set to vanish at its last close? That is what a
    detach does to a device still open elsewhere: one that has not happened yet."""
    return (Path("/sys/block") / os.path.basename(device) / "loop" / "autoclear").read_text().strip() == "1"


def loops_left(select: Callable[[str], bool], timeout: float = 30) -> dict[str, str]:
    """Loop devices (device: backing file) over a file select() picks, once
    the detaches already made have happened. A device detached while
    something else held it open (a container another test starts copies
    the host's mounts into its new namespace until it pivots away from
    them) carries autoclear and goes at that holder's last close: those are
    waited for, up to timeout; a device never detached is returned at once."""
    deadline = time.monotonic() + timeout
    while True:
        found = {d: b for d, b in sysloop.attached().items() if select(b)}
        try:
            pending = [d for d in found if loop_autoclear(d)]
        except FileNotFoundError:  # went while looking
            continue
        if not pending or len(pending) < len(found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def loops_left_under(path: Path | str, timeout: float = 30) -> dict[str, str]:
    """loops_left for every backing file below path."""
    prefix = str(Path(path).resolve()) + "/"
    return loops_left(lambda backing: backing.startswith(prefix), timeout)


def device_mounts(device: str) -> list[sysmount.MountEntry]:
    st = os.stat(device)
    return sysmount.of_device(os.major(st.st_rdev), os.minor(st.st_rdev))


def device_held(device: str) -> bool:
    """Whether a mount (in any namespace, or a detached one) holds the block
    device: the kernel refuses an exclusive open then."""
    try:
        os.close(os.open(device, os.O_RDONLY | os.O_EXCL))
        return False
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        return True


def scrape_metrics(port: int) -> dict[tuple[str, tuple], float]:
    """A daemon's Prometheus samples on 127.0.0.1:port, by (name, sorted
    labels); waits up to 10 s for the endpoint to answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    deadline = time.monotonic() + 10
    while True:
        try:
            text = opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class UnixGrpcServer:
    """Start and stop of a test's threaded gRPC server on a unix socket; the
    class using it has `socket` (a Path) and `server` (None when stopped)."""

    socket: Path
    server: grpc.Server | None

    def serve(self, register: Callable[[grpc.Server], None]) -> None:
        from concurrent import futures

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        register(self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None


def csi_unary_handler(fn, method: str) -> grpc.RpcMethodHandler:
    """A typed unary handler of a CSI method, for a test's fake plugin (the
    message types named as the CSI spec names them: <method>Request and
    <method>Response)."""
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=getattr(csi_pb2, f"{method}Request").FromString,
        response_serializer=getattr(csi_pb2, f"{method}Response").SerializeToString)
