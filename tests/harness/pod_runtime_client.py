"""PodRuntime on the microVM handler as containerd's crust shim drives it,
for the tests and benchmarks that play the shim: PodClient on the
handler's socket, OCI bundles of a busybox-static root file system and
their binds, a watch of the host's mount table, and the fixtures that
start the real stack (tests/harness/kata_env.py) with a client on it (pod_env,
kata_env_with_client); the handler's log entries by message.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import grpc
import pytest

from crust.api import handler_pb2, handler_pb2_grpc
from tests.harness.handler_log import entries
from tests.harness.kata_env import kata_env
from tests.harness.mount_watch import MountWatch

Stream = handler_pb2.OutputChunk.Stream
BUSYBOX = shutil.which("busybox") or "/bin/busybox"


def busybox_rootfs(path: Path) -> Path:
    """A container root file system: Debian's static busybox and a link per applet."""
    (path / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, path / "bin" / "busybox")
    for applet in ("sh", "echo", "cat", "df", "id", "pwd", "sleep", "ls", "touch", "stat", "mkdir", "test",
                   "head", "yes"):
        os.symlink("busybox", path / "bin" / applet)
    (path / "shared").mkdir()
    os.chmod(path / "shared", 0o1777)   # writable by any user, where the root is
    (path / "etc").mkdir()
    (path / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    return path


def container_bundle(root: Path, name: str, args: list[str], mounts: list[dict], *, cwd: str = "/",
                     uid: int = 0, gid: int = 0, readonly: bool = False) -> Path:
    """An OCI bundle as containerd's shim hands it over: config.json and the
    container's root file system at rootfs (containerd's mounts; a tree here)."""
    bundle = root / "bundles" / name
    busybox_rootfs(bundle / "rootfs")
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs", "readonly": readonly},
        "process": {"args": args, "env": ["PATH=/bin", "HOME=/root"], "cwd": cwd,
                    "user": {"uid": uid, "gid": gid}},
        # containerd's for a container of a pod (the pod's network, IPC and
        # UTS are its sandbox's, which the microVM takes as the guest's own).
        "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc", "path": "/proc/1/ns/ipc"},
                                 {"type": "uts", "path": "/proc/1/ns/uts"}, {"type": "mount"},
                                 {"type": "network", "path": "/proc/1/ns/net"}]},
        # As containerd lists them: pseudo file systems first (the guest
        # gives the container its own /proc and /dev), then binds.
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]},
                   {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
                   *mounts],
    }, indent=1))
    return bundle


def bind(destination: str, source, *options: str) -> dict:
    return {"destination": destination, "source": str(source), "type": "bind", "options": ["rbind", *options]}


class PodClient:
    """PodRuntime as the shim calls it."""

    def __init__(self, socket: Path):
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.stub = handler_pb2_grpc.PodRuntimeStub(self.channel)
        self.handler = handler_pb2_grpc.HandlerStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def create_pod(self, sandbox_id: str, bundle: Path) -> int:
        return self.stub.CreatePod(handler_pb2.CreatePodRequest(sandbox_id=sandbox_id, bundle=str(bundle)),
                                   timeout=240).pid

    def create_container(self, sandbox_id: str, container_id: str, bundle: Path) -> None:
        self.stub.CreateContainer(handler_pb2.CreateContainerRequest(
            sandbox_id=sandbox_id, container_id=container_id, bundle=str(bundle)), timeout=120)

    def start(self, container_id: str, exec_id: str = "", **process) -> int:
        spec = handler_pb2.ProcessSpec(**process) if process else None
        return self.stub.StartProcess(handler_pb2.StartProcessRequest(
            container_id=container_id, exec_id=exec_id, process=spec), timeout=60).pid

    def wait(self, container_id: str, exec_id: str = "", timeout: float = 60) -> handler_pb2.ProcessState:
        return self.stub.GetProcess(handler_pb2.GetProcessRequest(
            container_id=container_id, exec_id=exec_id, wait=True), timeout=timeout)

    def state(self, container_id: str, exec_id: str = "") -> handler_pb2.ProcessState:
        return self.stub.GetProcess(handler_pb2.GetProcessRequest(container_id=container_id, exec_id=exec_id),
                                    timeout=30)

    def output(self, container_id: str, exec_id: str = "", stdout_offset: int = 0, stderr_offset: int = 0,
               timeout: float = 60) -> tuple[bytes, bytes]:
        """Everything ReadOutput streams until it ends (the process exited),
        checking each chunk starts where the last one of its stream ended."""
        got = {Stream.STDOUT: b"", Stream.STDERR: b""}
        start = {Stream.STDOUT: stdout_offset, Stream.STDERR: stderr_offset}
        for chunk in self.stub.ReadOutput(handler_pb2.ReadOutputRequest(
                container_id=container_id, exec_id=exec_id, stdout_offset=stdout_offset,
                stderr_offset=stderr_offset), timeout=timeout):
            assert chunk.offset == start[chunk.stream] + len(got[chunk.stream]), chunk
            got[chunk.stream] += chunk.data
        return got[Stream.STDOUT], got[Stream.STDERR]

    def output_until(self, container_id: str, text: bytes, timeout: float = 60) -> bytes:
        """Stdout of a process that keeps running, read until text appears."""
        call = self.stub.ReadOutput(handler_pb2.ReadOutputRequest(container_id=container_id), timeout=timeout)
        out = b""
        try:
            for chunk in call:
                if chunk.stream == Stream.STDOUT:
                    out += chunk.data
                if text in out:
                    return out
        finally:
            call.cancel()
        raise AssertionError(f"{text!r} never came; stdout was {out!r}")

    def exec(self, container_id: str, exec_id: str, args: list[str], **process) -> tuple[int, bytes, bytes]:
        self.start(container_id, exec_id, args=args, env=["PATH=/bin"], **process)
        state = self.wait(container_id, exec_id)
        out, err = self.output(container_id, exec_id)
        return state.exit_code, out, err

    def delete_container(self, container_id: str) -> handler_pb2.ProcessState:
        return self.stub.DeleteContainer(handler_pb2.DeleteContainerRequest(container_id=container_id),
                                         timeout=120).state

    def delete_pod(self, sandbox_id: str) -> None:
        self.stub.DeletePod(handler_pb2.DeletePodRequest(sandbox_id=sandbox_id), timeout=180)

    def pods(self) -> dict[str, handler_pb2.PodInfo]:
        return {p.sandbox_id: p for p in self.stub.ListPods(handler_pb2.ListPodsRequest(), timeout=30).pods}


@pytest.fixture
def pod_env(root):
    """The microVM handler on the real stack, a PodRuntime client on its
    socket, a watch of the host's mount table; every pod deleted at the end."""
    for kenv in kata_env(root):
        client = PodClient(kenv.handler.socket)
        watch = MountWatch().start()
        try:
            yield kenv, client, watch
        finally:
            watch.stop()
            try:
                for pod_id in client.pods():
                    client.delete_pod(pod_id)
            finally:
                client.close()


def log_entries(kenv, msg: str) -> list[dict]:
    """The handler's log entries with that message."""
    return entries(kenv.handler, msg)


def kata_env_with_client(root, **kw):
    """kata_env(root, **kw) and a PodRuntime client on its handler; every
    pod deleted at the end."""
    for kenv in kata_env(root, **kw):
        client = PodClient(kenv.handler.socket)
        try:
            yield kenv, client
        finally:
            try:
                for pod_id in client.pods():
                    client.delete_pod(pod_id)
            finally:
                client.close()
