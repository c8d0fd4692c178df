"""The daemons the benchmarks start, and the real stack they share.

- daemons: die_with_parent(), own_session(), start_daemon(), wait_until(),
  stop_process(), and project_on_pythonpath() so that they import crust
  from this checkout;
- the real stack of tests/harness/daemons.py (crust driver -> crust shim -> crust
  proxy, a runtime handler registered with the proxy): start_stack();
- a volume published through the proxy's kubelet-facing socket as kubelet
  would publish it, and taken down again in order: ProxyVolume, with the
  steps it shares with the benchmarks' own teardowns, attempt() and
  retry_failed_precondition();
- the OCI bundle the handler benchmarks run over such a volume:
  write_bundle().
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.lib.benchlib import PROJECT
from crust.api import csi_pb2
from tests.harness.daemons import CsiProcess, DriverProcess, HandlerProcess, ProxyProcess, Root, ShimProcess

BARE_HOP = Path(__file__).resolve().parent / "bare_hop.py"

# -- daemons ----------------------------------------------------------------------------------------


def die_with_parent(argv):
    """argv run through setpriv(1) so that it gets SIGTERM if the benchmark
    is killed (PR_SET_PDEATHSIG; a daemon started in its own session, which a
    Ctrl-C at the terminal must not stop before the orderly teardown).

    Not a preexec_fn: with one, subprocess forks (rather than vforks) the
    benchmark, grpc's fork handlers run in the child and can hang there for
    good before the exec (bench/csi/handler_bench.py did, starting its handler).
    setpriv execs argv in the same process, so its pid is the daemon's."""
    if isinstance(argv, (str, bytes)) or not shutil.which("setpriv"):
        return argv
    return ["setpriv", "--pdeathsig", "TERM", "--", *argv]


@contextmanager
def own_session():
    """Make the daemons tests/harness/daemons.py starts run in their own session
    (a Ctrl-C at the terminal reaches the benchmark only, which then tears
    down in order) and end if the benchmark is killed. The harness calls
    subprocess.Popen; it is wrapped only while the daemons start."""
    original = subprocess.Popen

    def popen(argv, *args, **kw):
        kw.setdefault("start_new_session", True)
        return original(die_with_parent(argv), *args, **kw)

    subprocess.Popen = popen
    try:
        yield
    finally:
        subprocess.Popen = original


def start_daemon(argv: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """argv started in the project directory, its stderr appended to
    log_path, in its own session and ending if the benchmark is killed (as
    own_session() makes the harness's daemons)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(die_with_parent(argv), stdout=subprocess.DEVNULL, stderr=log, cwd=PROJECT, env=env,
                                start_new_session=True)


def wait_until(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float,
               exited: Callable[[], Exception], late: Callable[[], Exception]) -> None:
    """Ask ready() every 50 ms until it holds; raise exited() if the process
    ends first, late() once timeout seconds have passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise exited()
        if ready():
            return
        time.sleep(0.05)
    raise late()


def stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM, and SIGKILL if it has not ended within timeout seconds (None: nothing to stop)."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def project_on_pythonpath(env) -> None:
    """Put this checkout first on env's PYTHONPATH (os.environ or a copy):
    the daemons import crust from it."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT), env.get("PYTHONPATH", "")]))


@dataclass
class BareHop(CsiProcess):
    """bench/lib/bare_hop.py serving `socket` in front of `backend`, on grpcio's
    `stack` (a door: a channel to it and CSI stubs, as the harness's daemons
    have). Put it in a Root's drivers before starting it, so that
    Root.close() stops it (the outer hop first) whatever fails meanwhile."""

    socket: Path
    backend: Path
    stack: str = "aio"
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    @property
    def log_path(self) -> Path:
        return self.socket.with_suffix(".log")

    def start(self, timeout: float = 15.0) -> "BareHop":
        """Started (in the caller's session settings: own_session() or the
        like); ready once a Probe through it reaches the driver."""
        self._launch(f"bare hop {self.socket.name}", ["--listen", f"unix://{self.socket}",
                                                      "--backend", f"unix://{self.backend}", "--stack", self.stack],
                     lambda: self.identity.Probe(csi_pb2.ProbeRequest(), timeout=2).ready.value, timeout,
                     program=(sys.executable, str(BARE_HOP)))
        return self


# -- the real stack ---------------------------------------------------------------------------------


def start_stack(root: Root, handler_timeout: float = 15.0,
                **handler) -> tuple[DriverProcess, ShimProcess, ProxyProcess, HandlerProcess]:
    """driver -> shim -> proxy, then a handler (Root.handler(proxy, **handler))
    registered with the proxy, all in their own session."""
    with own_session():
        driver, shim, proxy = root.stack()
        started = root.handler(proxy, **handler).start(timeout=handler_timeout)
    return driver, shim, proxy, started


def attempt(problems: list[str], what: str, call) -> bool:
    """call(); on failure add "what: why" to problems and go on (False)."""
    try:
        call()
        return True
    except Exception as exc:  # noqa: BLE001 - go on with the rest
        problems.append(f"{what}: {exc.details() if isinstance(exc, grpc.RpcError) else exc}")
        return False


def retry_failed_precondition(call, patience: float = 15.0):
    """call() (a DeleteVolume), retried every 0.5 s for up to patience
    seconds while it fails with FAILED_PRECONDITION: the driver still sees
    the volume's loop device attached (`losetup --detach` of a device that
    something else still holds, a mount in another mount namespace or udev
    probing it, only marks it for autoclear)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


@dataclass
class ProxyVolume:
    """A volume created, staged and published on the proxy's kubelet-facing
    socket, and how far it got (what its teardown has to undo)."""

    proxy: ProxyProcess
    cap: csi_pb2.VolumeCapability
    volume_id: str
    capacity: int
    staging: Path
    target: Path
    staged: bool = False
    published: bool = False

    @classmethod
    def create(cls, proxy: ProxyProcess, pv: str, pod: str, size: int, cap) -> ProxyVolume:
        """CreateVolume named pv; staged and published later at kubelet's paths for pv and pod."""
        volume = proxy.create(pv, size, cap)
        return cls(proxy, cap, volume.volume_id, volume.capacity_bytes, proxy.staging(pv), proxy.target(pod, pv))

    def stage(self) -> None:
        self.proxy.stage(self.volume_id, self.staging, self.cap)
        self.staged = True

    def publish_deferred(self) -> csi_pb2.DeferredMount:
        """NodePublishVolume with defer_fs_ops, as kubelet sends it for a
        sandbox whose runtime mounts the volume; the proxy must defer."""
        rsp = self.proxy.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=self.volume_id, staging_target_path=str(self.staging), target_path=str(self.target),
            volume_capability=self.cap, defer_fs_ops=True), timeout=60)
        self.published = True
        if not rsp.HasField("deferred_mount"):
            raise RuntimeError("the proxy did not defer the publish")
        return rsp.deferred_mount

    def publish_on_host(self) -> None:
        self.proxy.publish(self.volume_id, self.staging, self.target, self.cap)
        self.published = True

    def take_down(self, problems: list[str], label: str = "") -> bool:
        """Unpublish, unstage and delete, as far as each step before went
        through; failures are added to problems as "LABELSTEP: why" (the
        forced cleanup follows). True once the volume is deleted."""
        step = functools.partial(attempt, problems)
        if self.published and step(f"{label}unpublish", lambda: self.proxy.unpublish(self.volume_id, self.target)):
            self.published = False
        if self.staged and not self.published and \
                step(f"{label}unstage", lambda: self.proxy.unstage(self.volume_id, self.staging)):
            self.staged = False
        return not self.staged and step(f"{label}delete",
                                        lambda: retry_failed_precondition(lambda: self.proxy.delete(self.volume_id)))


def write_bundle(bundle: Path, target: Path, seconds: int) -> None:
    """An OCI bundle: an empty rootfs, process `sleep SECONDS`, the volume's
    CSI target path bind-mounted at /data."""
    (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["sleep", str(seconds)], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
        "mounts": [{"destination": "/data", "source": str(target), "type": "bind", "options": ["rbind"]}],
    }))
