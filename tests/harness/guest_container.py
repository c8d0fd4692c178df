"""The guest agent run on the host as a process: alone, or beside a real
crun container as in the guest, both in a mount namespace of their own
whose /sys/fs/cgroup is cgroup v2 alone (crun refuses a host's hybrid
hierarchy).

The fixtures: agent (the socket of a lone `python -m crust.guest`) and
pod_cgroup_cleaned (the containers' cgroups below /crust removed after the
test; a module whose tests make containers names it in its `pytestmark`).
A module that uses one imports it."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from crust.common.ttrpc import TtrpcError
from crust.kata.image.build import GUEST_CFLAGS

REPO = Path(__file__).resolve().parents[2]
ENTER_SOURCE = REPO / "crust" / "guest" / "files" / "enter.c"
APPLETS = ("sh", "sleep", "echo", "hostname", "cat", "grep", "readlink", "env", "sort", "mkdir", "id", "tty", "stty")


async def code_of(awaitable) -> tuple[int, str]:
    """(code, message) of the TtrpcError the call must fail with."""
    try:
        await awaitable
    except TtrpcError as exc:
        return exc.code, exc.message
    raise AssertionError("the call did not fail")


def parent_of(pid: int) -> int:
    """pid's parent, 0 once pid is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith("PPid:")).split()[1])
    except (FileNotFoundError, StopIteration):
        return 0


def wait_listening(proc: subprocess.Popen, path: Path, log: Path, timeout: float) -> None:
    """Until the agent's socket exists (it appears only once listening)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the agent did not listen"
        time.sleep(0.02)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def agent(tmp_path):
    path = tmp_path / "agent.sock"
    with open(tmp_path / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "crust.guest", "--listen", str(path)], cwd=REPO, stderr=log)
    try:
        wait_listening(proc, path, tmp_path / "agent.log", 20)
        yield path
    finally:
        stop(proc)


def compile_enter(directory: Path) -> Path:
    """The guest's enter program, compiled for the host as the image
    compiles it."""
    out = directory / "enter"
    subprocess.run(["cc", *GUEST_CFLAGS, "-o", str(out), str(ENTER_SOURCE)], check=True)
    return out


@dataclass
class ContainerAgent:
    socket: Path
    container_id: str
    state: Path
    spec: dict[str, Any]
    agent_pid: int    # the agent's process (the namespace's first process exec'd it)
    log: Path

    def crun_exec(self, process: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess:
        """`crun exec --process` of process, from the agent's mount namespace."""
        path = tmp_path / f"crun-exec-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(process))
        return subprocess.run(["nsenter", "-t", str(self.agent_pid), "-m", shutil.which("crun"), "--root",
                               str(self.state), "exec", "--process", str(path), self.container_id],
                              capture_output=True, timeout=60, check=False)


@contextlib.contextmanager
def crun_container_agent(tmp_path: Path, adjust: Callable[[dict[str, Any], Path], None] | None = None,
                         agent_args: tuple[str, ...] = ()) -> Iterator[ContainerAgent]:
    """The agent beside a running crun container of a busybox root whose
    first process sleeps; adjust(spec, rootfs) may change the spec and the
    root before the container is made; agent_args go to the agent."""
    bundle, state, path = tmp_path / "bundle", tmp_path / "crun", tmp_path / "agent-oci.sock"
    rootfs = bundle / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy2("/usr/bin/busybox", rootfs / "bin" / "busybox")
    for applet in APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    subprocess.run(["crun", "spec"], cwd=bundle, check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"].update(terminal=False, args=["sleep", "1000"])
    spec["hostname"] = "in-container"
    spec["linux"].pop("resources", None)  # no controller is free in the namespace's cgroup2
    if adjust is not None:
        adjust(spec, rootfs)
    (bundle / "config.json").write_text(json.dumps(spec))
    cid = f"agent-test-{os.getpid()}"
    crun = shutil.which("crun")
    script = (f"mount -t cgroup2 none /sys/fs/cgroup && {crun} --root {state} run --detach --bundle {bundle} {cid} "
              f"&& exec {sys.executable} -m crust.guest --listen {path} --oci-runtime {crun} --oci-root {state} "
              f"--exec-dir {tmp_path / 'exec'} --enter-program {compile_enter(tmp_path)} "
              f"--containers-dir {tmp_path / 'containers'} --holds-dir {tmp_path / 'holds'} "
              f"--run-dir {tmp_path / 'run'} --pod-init {shutil.which('catatonit')} {shlex.join(agent_args)}")
    log = tmp_path / "agent-oci.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], cwd=REPO,
                                stderr=out)
    try:
        wait_listening(proc, path, log, 60)
        yield ContainerAgent(path, cid, state, spec, proc.pid, log)
    finally:
        subprocess.run(["nsenter", "-t", str(proc.pid), "-m", crun, "--root", str(state), "delete", "--force", cid],
                       timeout=60, check=False)
        stop(proc)


def unified_hierarchy() -> Path:
    """Where the host mounts cgroup v2 (the agent's namespace mounts the same
    hierarchy at its /sys/fs/cgroup)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[0] == "cgroup2":
            return Path(left.split()[4])
    raise AssertionError("the host mounts no cgroup v2 hierarchy")


@pytest.fixture
def pod_cgroup_cleaned():
    """The containers' cgroups the tests make below /crust in the host's v2
    hierarchy, removed after (and /crust itself when they made it)."""
    pod = unified_hierarchy() / "crust"
    existed = pod.exists()
    before = set(pod.iterdir()) if existed else set()
    yield pod
    for made in (set(pod.iterdir()) if pod.exists() else set()) - before:
        if made.is_dir():
            for directory in (made / "ctr", made):
                if directory.exists():
                    directory.rmdir()
    if not existed and pod.exists():
        pod.rmdir()


def container_spec(c: ContainerAgent, container_id: str, *args: str) -> bytes:
    """The fixture container's spec for another container of the same root,
    in the cgroup crust gives a container below the pod's."""
    spec = copy.deepcopy(c.spec)
    spec["root"]["path"] = str(c.state.parent / "bundle" / "rootfs")
    spec["process"]["args"] = list(args)
    spec["linux"]["cgroupsPath"] = f"/crust/{container_id}/ctr"
    return json.dumps(spec).encode()


def crun_knows(c: ContainerAgent, container_id: str) -> bool:
    return (c.state / container_id).exists()
