"""The test stack of `crust proxy`'s runtime endpoint, as the shim, a handler or a runtime CLI see it.

Env starts a real driver -> shim -> proxy stack (tests.harness.daemons Root.stack())
and talks to the proxy's runtime socket (the KEP-2857 Runtime API and the
handler registry) the way the shim, a runtime handler (tests.harness.handler_server)
or a KEP-style runtime CLI would: stage and unstage volumes, register
handlers and claim volumes for sandboxes, ask for stats and expansion, run
`crust status`. The `env` fixture starts stacks (env() or
env("--lease-seconds", "2")) below the `root` fixture's temporary directory
and stops their handler servers and spawned processes. Device paths are
plain strings: the proxy records them and never opens them.

The helpers compute what the proxy should write independently of crust's
own code: the KEP entry's name is the sha256 of the target path, the Kata
mirror's its URL-safe base64.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from tests.harness.handler_server import HandlerServer

Req = runtime_pb2.RuntimeStageVolumeRequest
GIB = 1024**3

REPO = Path(__file__).resolve().parents[2]


# -- independent expectations (not crust's own helpers) -------------------------------------


def sha(target: str) -> str:
    return hashlib.sha256(target.encode()).hexdigest()


def b64(target: str) -> str:
    return base64.urlsafe_b64encode(target.encode()).decode()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def failure(call, *args, **kw) -> grpc.RpcError:
    try:
        call(*args, **kw)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded but was expected to fail")


# -- the set-up -----------------------------------------------------------------------------


class Env:
    def __init__(self, root, proxy_extra: list[str]):
        self.root = root
        _, _, self.proxy = root.stack(proxy_extra=proxy_extra)
        self.channels: list[grpc.Channel] = []
        self.handlers: list[HandlerServer] = []
        self.procs: list[subprocess.Popen] = []
        self.connect()

    @property
    def path(self) -> Path:
        return self.root.path

    def connect(self) -> None:
        self.channel = self.proxy.runtime_channel()
        self.channels.append(self.channel)
        self.runtime = runtime_pb2_grpc.RuntimeStub(self.channel)
        self.registry = registry_pb2_grpc.RegistryStub(self.channel)

    def disconnect(self) -> None:
        """Close our channels first: a proxy stopping with a client still
        connected waits out its grace period."""
        for c in self.channels:
            c.close()
        self.channels.clear()

    def stop(self) -> None:
        self.disconnect()
        self.proxy.stop()

    def restart(self) -> None:
        self.disconnect()
        self.proxy.restart()
        self.connect()

    def start(self) -> None:
        self.proxy.start()
        self.connect()

    def close(self) -> None:
        for h in self.handlers:
            h.stop()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for c in self.channels:
            c.close()

    # paths ------------------------------------------------------------------------------------

    def target(self, name: str, create: bool = True) -> str:
        path = self.proxy.target(f"pod-{name}", f"pv-{name}")
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def entry(self, target: str) -> Path:
        return self.proxy.volumes_dir / sha(target)

    def mirror(self, target: str) -> Path:
        return self.proxy.kata_dir / b64(target)

    def info(self, target: str) -> dict:
        return json.loads((self.entry(target) / "mountInfo.json").read_bytes())

    # calls ------------------------------------------------------------------------------------

    @staticmethod
    def request(target: str, device: str = "/dev/crust-test0", fs_type: str = "ext4", **kw) -> Req:
        return Req(volume_type=Req.BLOCK, volume_target_path=target, volume_backing_path=device, fs_type=fs_type,
                   **kw)

    def stage(self, target: str, **kw) -> None:
        self.runtime.RuntimeStageVolume(self.request(target, **kw), timeout=10)

    def unstage(self, target: str) -> None:
        self.runtime.RuntimeUnstageVolume(runtime_pb2.RuntimeUnstageVolumeRequest(volume_target_path=target),
                                          timeout=10)

    def stats(self, target: str, timeout: float = 30) -> runtime_pb2.RuntimeGetVolumeStatsResponse:
        return self.runtime.RuntimeGetVolumeStats(
            runtime_pb2.RuntimeGetVolumeStatsRequest(volume_target_path=target), timeout=timeout)

    def expand(self, target: str, required: int, limit: int = 0, timeout: float = 30) -> int:
        return self.runtime.RuntimeExpandVolume(runtime_pb2.RuntimeExpandVolumeRequest(
            volume_target_path=target, capacity_range=csi_pb2.CapacityRange(required_bytes=required,
                                                                            limit_bytes=limit)),
            timeout=timeout).capacity_bytes

    def register(self, name: str, filesystems=("ext4", "xfs"), serve: bool = False, **kw) -> HandlerServer:
        h = HandlerServer(socket=self.path / f"h-{name}.sock", name=name, filesystems=list(filesystems), **kw)
        self.handlers.append(h)
        if serve:
            h.start()
        h.register(self.channel)
        return h

    def lease(self, handler: str) -> str:
        """The lease of the last handler registered here under that name ('' if none)."""
        return next((h.lease_id for h in reversed(self.handlers) if h.name == handler), "")

    def claim(self, target: str, handler: str, sandbox: str, pid: int = 0,
              lease: str | None = None) -> registry_pb2.ClaimVolumeResponse:
        return self.registry.ClaimVolume(registry_pb2.ClaimVolumeRequest(
            target_path=target, handler=handler, sandbox_id=sandbox, sandbox_pid=pid,
            lease_id=self.lease(handler) if lease is None else lease), timeout=10)

    def release(self, target: str, handler: str, sandbox: str, lease: str | None = None) -> None:
        self.registry.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(
            target_path=target, handler=handler, sandbox_id=sandbox,
            lease_id=self.lease(handler) if lease is None else lease), timeout=10)

    def volumes(self) -> dict[str, registry_pb2.DeferredVolume]:
        return {v.target_path: v for v in self.registry.ListVolumes(registry_pb2.ListVolumesRequest(),
                                                                    timeout=10).volumes}

    def handlers_listed(self) -> dict[str, registry_pb2.Handler]:
        return {h.name: h for h in self.registry.ListHandlers(registry_pb2.ListHandlersRequest(),
                                                              timeout=10).handlers}

    def claims(self) -> list[registry_pb2.Claim]:
        return list(self.registry.ListClaims(registry_pb2.ListClaimsRequest(), timeout=10).claims)

    def status(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint",
                               f"unix://{self.proxy.runtime_socket}", *extra],
                              capture_output=True, text=True, timeout=30, cwd=REPO)

    def sleeper(self) -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "60"])
        self.procs.append(p)
        return p

    def script(self, name: str, body: str) -> Path:
        path = self.path / "bin" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path


@pytest.fixture
def env(root):
    """Start a stack: env() or env("--lease-seconds", "2")."""
    made: list[Env] = []

    def make(*proxy_extra: str) -> Env:
        e = Env(root, list(proxy_extra))
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()
