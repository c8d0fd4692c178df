"""`crust proxy`'s runtime socket: private, healthy, and safe across a crash.

A real driver -> shim -> proxy stack (tests.harness.proxy_runtime_env). The runtime
socket is 0600 in a private directory and both sockets answer gRPC health
for their services; a world-readable socket directory makes the proxy
refuse to start; a stale socket left by a SIGKILL is replaced on the next
start, and something that is not a socket is never replaced.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.proxy_runtime_env import REPO, env, mode  # noqa: F401 - env: the stack fixture


# -- the runtime socket ---------------------------------------------------------------------


def health(socket: Path, service: str = "") -> int:
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=10).status


def test_runtime_socket_is_private_and_both_sockets_answer_health(env):
    e = env()
    sock = e.proxy.runtime_socket
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.filemode(st.st_mode) == "srw-------"
    assert mode(sock.parent) & 0o077 == 0
    SERVING = health_pb2.HealthCheckResponse.SERVING
    assert health(sock) == SERVING
    assert health(sock, "crust.runtime.v1.Runtime") == SERVING
    assert health(sock, "crust.registry.v1.Registry") == SERVING
    assert health(e.proxy.socket) == SERVING


def test_a_world_readable_socket_directory_is_refused(root):
    open_dir = root.path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    argv = [sys.executable, "-m", "crust", "proxy", "--csi-endpoint", f"unix://{root.path}/k.sock",
            "--plugin-endpoint", f"unix://{root.path}/nothing.sock",
            "--runtime-endpoint", f"unix://{open_dir}/runtime.sock", "--volumes-dir", str(root.path / "volumes"),
            "--state-dir", str(root.path / "state"), "--kubelet-root", str(root.path / "kubelet")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert str(open_dir) in err and "755" in err and "700" in err, err[-2000:]
    assert os.listdir(open_dir) == []
    assert not (root.path / "k.sock").exists()


def test_a_stale_socket_from_a_killed_proxy_is_replaced(env):
    e = env()
    target = e.target("stale")
    e.stage(target)
    sock = e.proxy.runtime_socket
    e.proxy.kill()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode), "SIGKILL leaves the socket file behind"
    e.start()
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert health(sock) == health_pb2.HealthCheckResponse.SERVING
    assert list(e.volumes()) == [target]

    # Something that is not a socket is never replaced.
    e.stop()
    assert not os.path.lexists(sock), "a clean stop removes the socket"
    sock.write_text("not a socket")
    with pytest.raises(RuntimeError):
        e.proxy.start()
    assert "not a socket" in e.proxy.log_path.read_text()
    assert sock.read_text() == "not a socket"
    e.proxy.proc = None
