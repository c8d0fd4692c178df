"""containerd-shim-crust-v2 as each containerd starts it: the shipped shim
binary run as a subprocess, fed on its standard input the bytes containerd
1.6 to 2.2 write (the runtime's options alone, a google.protobuf.Any) and
those 2.3 writes (BootstrapParams, the options among its extensions), and
asked `-info` as 2.2 asks it. What is observed is what the shim prints, where
its socket is, which handler its daemon dials (a real ttrpc PodRuntime server
at each candidate handler's `<socket>.ttrpc` records the call), and the
daemon's environment.
Everything lives below temporary directories; the daemons started here are
stopped (SIGTERM to their own pid) and their sockets removed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from google.protobuf import any_pb2

from crust import __version__
from crust.api import containerd_bootstrap_pb2 as bootstrap_pb
from crust.api import containerd_introspection_pb2 as introspection_pb
from crust.api import containerd_runtimeoptions_pb2 as runtimeoptions_pb
from crust.api import containerd_task_pb2 as task_pb
from crust.api import handler_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.common.ttrpc_client import Client
from crust.common.ttrpc_server import Server
from tests.harness.cri import processes_naming
from tests.harness.ttrpc import TASK

SHIM = Path(sys.executable).parent / "containerd-shim-crust-v2"
NAMESPACE = "k8s.io"


class RecordingHandler:
    """A PodRuntime that records which pod asked for a VM, and refuses it."""

    def __init__(self, name: str):
        self.name, self.pods = name, []

    async def CreatePod(self, request, call):
        self.pods.append(request.sandbox_id)
        raise TtrpcError(ttrpc.FAILED_PRECONDITION, f"the {self.name} handler refuses, as this test asks")


@pytest.fixture
def node():
    """Two handlers (the one the runtime's ConfigPath names, the one the
    environment names), a ConfigPath file naming the first, a short
    directory for sockets (unix socket paths are short)."""
    top = Path(tempfile.mkdtemp(prefix="crs", dir="/tmp"))
    servers, handlers = [], {}
    # The handlers' own event loop, beside the test's.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        for name in ("configured", "environment"):
            handler = RecordingHandler(name)
            server = Server()
            server.register_service(handler_pb2.DESCRIPTOR.services_by_name["PodRuntime"], handler)
            asyncio.run_coroutine_threadsafe(server.serve_path(f"{top / name}.sock.ttrpc"), loop).result(10)
            servers.append(server)
            handlers[name] = handler
        config = top / "shim.toml"
        config.write_text(f'handler_endpoint = "unix://{top / "configured.sock"}"\n')
        yield top, handlers, config
    finally:
        for server in servers:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        for daemon in processes_naming(str(top)):
            os.kill(int(daemon.split(":")[0]), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while processes_naming(str(top)) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(top, ignore_errors=True)


def options_any(config: Path) -> any_pb2.Any:
    inner = runtimeoptions_pb.Options(config_path=str(config)).SerializeToString()
    return any_pb2.Any(type_url="runtimeoptions.v1.Options", value=inner)


def bundle_of(top: Path, pod: str) -> Path:
    bundle = top / "bundles" / pod
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "process": {"args": ["/pause"], "cwd": "/"},
        "annotations": {"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-id": pod}}))
    return bundle


def run_shim(top: Path, bundle: Path, pod: str, stdin: bytes) -> subprocess.CompletedProcess:
    """`start` as containerd runs it, with an address of this test's own
    (the shim names its socket after it) and the environment's handler and
    event socket set."""
    env = {**os.environ, "CRUST_KATA_HANDLER_ENDPOINT": f"unix://{top / 'environment.sock'}",
           "TTRPC_ADDRESS": f"{top}/from-environment.ttrpc"}
    return subprocess.run([str(SHIM), "-namespace", NAMESPACE, "-address", f"{top}/containerd.sock",
                           "-publish-binary", "/usr/bin/containerd", "-id", pod, "start"],
                          cwd=bundle, input=stdin, capture_output=True, env=env, timeout=60)


def daemon_of(socket_path: str) -> int:
    """The pid of the shim daemon `start` left serving on socket_path."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if b"serve" in argv and socket_path.encode() in argv:
            found.append(int(entry.name))
    (pid,) = found
    return pid


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


async def create_pod(address: str, pod: str, bundle: Path) -> str:
    """containerd's first task call for a pod: the shim asks its handler for the VM."""
    client = await Client.connect(address[len("unix://"):])
    try:
        with pytest.raises(TtrpcError) as caught:
            await client.call(TASK, "Create", task_pb.CreateTaskRequest(id=pod, bundle=str(bundle)),
                              task_pb.CreateTaskResponse, timeout=60)
    finally:
        await client.close()
    assert caught.value.code == ttrpc.FAILED_PRECONDITION, caught.value
    return str(caught.value)


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


async def test_containerd_16_to_22_hands_start_the_runtime_options_alone(node):
    top, handlers, config = node
    bundle = bundle_of(top, "pod-legacy")
    out = run_shim(top, bundle, "pod-legacy", options_any(config).SerializeToString())
    assert out.returncode == 0, out.stderr
    address = out.stdout.decode()
    assert address.startswith("unix:///run/containerd/s/"), address  # the bare address, in 1.6's directory
    assert (bundle / "address").read_text() == address
    assert (bundle / "crust-handler-endpoint").read_text() == f"unix://{top / 'configured.sock'}"
    pid = daemon_of(address[len("unix://"):])
    try:
        assert environ_of(pid)["TTRPC_ADDRESS"] == f"{top}/from-environment.ttrpc"
        message = await create_pod(address, "pod-legacy", bundle)
        assert "configured handler refuses" in message
        assert handlers["configured"].pods == ["pod-legacy"] and handlers["environment"].pods == []
    finally:
        stop(pid)
    assert not Path(address[len("unix://"):]).exists()


async def test_containerd_23_hands_start_bootstrap_params_with_the_options_among_its_extensions(node):
    top, handlers, config = node
    bundle = bundle_of(top, "pod-boot")
    sockets = top / "s"
    params = bootstrap_pb.BootstrapParams(
        instance_id="pod-boot", namespace=NAMESPACE, log_level=bootstrap_pb.LOG_LEVEL_DEBUG,
        containerd_version="v2.3.4", containerd_ttrpc_address=f"{top}/from-bootstrap.ttrpc",
        containerd_grpc_address=f"{top}/containerd.sock", containerd_binary="/usr/bin/containerd",
        socket_dir=str(sockets))
    params.extensions.add().value.CopyFrom(any_pb2.Any(type_url="containerd.io/other.v1.Config", value=b"\x0a\x01x"))
    params.extensions.add().value.CopyFrom(options_any(config))
    out = run_shim(top, bundle, "pod-boot", params.SerializeToString())
    assert out.returncode == 0, out.stderr
    result = bootstrap_pb.BootstrapResult()
    result.ParseFromString(out.stdout)  # a BootstrapResult, as containerd 2.3 parses first
    assert (result.version, result.protocol) == (2, "ttrpc")
    assert result.address.startswith(f"unix://{sockets}/") and Path(result.address[7:]).is_socket()
    assert (bundle / "address").read_text() == result.address
    assert (bundle / "crust-socket-dir").read_text() == str(sockets)
    pid = daemon_of(result.address[len("unix://"):])
    try:
        daemon_env = environ_of(pid)
        assert daemon_env["TTRPC_ADDRESS"] == f"{top}/from-bootstrap.ttrpc"  # the params win
        assert b"-debug" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")  # the params' log level
        message = await create_pod(result.address, "pod-boot", bundle)
        assert "configured handler refuses" in message
        assert handlers["configured"].pods == ["pod-boot"] and handlers["environment"].pods == []
    finally:
        stop(pid)


async def test_bootstrap_params_without_options_or_of_another_task_fall_back_as_containerd_does(node):
    """No runtime options: the environment's handler. Params whose id is not
    `-id` are no BootstrapParams (containerd's own shims decide so): read as
    a broken Any, reported, and the environment's handler used."""
    top, handlers, _ = node
    for pod, params in [("pod-none", bootstrap_pb.BootstrapParams(instance_id="pod-none", namespace=NAMESPACE)),
                        ("pod-other", bootstrap_pb.BootstrapParams(instance_id="someone-else", namespace=NAMESPACE,
                                                                   socket_dir=str(top / "s")))]:
        bundle = bundle_of(top, pod)
        out = run_shim(top, bundle, pod, params.SerializeToString())
        assert out.returncode == 0, out.stderr
        if pod == "pod-none":
            result = bootstrap_pb.BootstrapResult()
            result.ParseFromString(out.stdout)
            address = result.address
        else:
            address = out.stdout.decode()
            assert address.startswith("unix:///run/containerd/s/")  # not the other task's socket dir
        assert (bundle / "crust-handler-endpoint").read_text() == f"unix://{top / 'environment.sock'}"
        pid = daemon_of(address[len("unix://"):])
        try:
            assert "environment handler refuses" in await create_pod(address, pod, bundle)
        finally:
            stop(pid)
    assert handlers["environment"].pods == ["pod-none", "pod-other"] and handlers["configured"].pods == []


def test_info_prints_a_runtime_info_whatever_its_input(tmp_path):
    """`<shim> -info` as containerd 2.2+ runs it: the options (or nothing)
    on stdin, a RuntimeInfo on stdout, exit 0; never the usage error."""
    config = tmp_path / "shim.toml"
    options = options_any(config)
    for stdin, echoed in [(b"", None), (options.SerializeToString(), options), (b"\x12\x05ab", None)]:
        out = subprocess.run([str(SHIM), "-info"], input=stdin, capture_output=True, timeout=60)
        assert out.returncode == 0, out.stderr
        info = introspection_pb.RuntimeInfo()
        info.ParseFromString(out.stdout)
        assert info.name == "io.containerd.crust.v2" and info.version.version == __version__
        assert not info.HasField("features")
        if echoed is None:
            assert not info.HasField("options")
        else:
            assert info.options == echoed
    # Without -info the usage error stays what it was.
    assert subprocess.run([str(SHIM)], capture_output=True, timeout=60).returncode == 2
