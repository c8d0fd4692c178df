"""A pod's processes as CRI streams and measures them, whatever runs them:
the same pods under runc (the baseline) and under crust-microvm, started
through CRI as kubelet starts them (crust.kubelet), driven by crictl (a
real streaming client: SPDY to containerd's streaming server, as kubectl).

- exec on a terminal with a standard input (`kubectl exec -it`): crictl
  runs on a terminal util-linux's script gives it, as under a user's;
- exec with a standard input and no terminal: the bytes arrive, then the end
  of the input;
- attach to a container started with stdin (`kubectl run -i`, `kubectl
  attach`), without and with a terminal (`kubectl run -it`): what is typed
  runs in its shell;
- the container's stats (its cgroup's CPU and memory), one container asked
  for by id, as CRI's ContainerStats does;
- a container over its memory limit: exit code 137, reason OOMKilled.

crictl is not part of crust: it is kubernetes-sigs/cri-tools' cmd/crictl,
found on PATH or by CRICTL (tests/harness/upstream.py); without it this module is
skipped, naming it, in CI too.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time

import pytest

from crust.api import cri_pb2 as cri
from tests.harness import upstream
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import KEEP_RUNNING, node  # noqa: F401 - node is the fixture
from tests.harness.upstream import CRICTL

pytestmark = [pytest.mark.slow, upstream.suite("crictl", CRICTL)]
MiB = 1024 * 1024


def crictl(node, *args: str, stdin: bytes = b"", timeout: float = 120) -> bytes:  # noqa: F811
    """crictl against the node's containerd; its output (exit code 0 required)."""
    argv = [str(upstream.path(CRICTL)), "--config", str(node.containerd.crictl_config()), *args]
    done = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
    assert done.returncode == 0, (args, done.returncode, done.stdout, done.stderr)
    return done.stdout


def crictl_on_a_terminal(node, *args: str, typed: bytes, after: bytes, wait: float = 0.0,  # noqa: F811
                         timeout: float = 120) -> bytes:
    """crictl on a terminal (util-linux script's), as on a user's: typed is
    typed once the output shows after (the program is reading), or after
    wait seconds; the terminal stays open until crictl ends (an end of
    input would reach the program too). Its output, exit code 0 required."""
    argv = [str(upstream.path(CRICTL)), "--config", str(node.containerd.crictl_config()), *args]
    user = subprocess.Popen(["script", "-q", "-e", "-c", shlex.join(argv), "/dev/null"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    output = b""
    try:
        os.set_blocking(user.stdout.fileno(), False)
        deadline = time.monotonic() + timeout
        typing_at = time.monotonic() + wait
        while (after not in output or time.monotonic() < typing_at) and user.poll() is None \
                and time.monotonic() < deadline:
            output += user.stdout.read() or b""
            time.sleep(0.05)
        user.stdin.write(typed)
        user.stdin.flush()
        os.set_blocking(user.stdout.fileno(), True)
        rest, errors = user.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if user.poll() is None:
            user.kill()
            user.wait()
    assert user.returncode == 0, (args, user.returncode, output + rest, errors)
    return output + rest


def test_exec_and_attach_with_terminals_and_standard_input(node):  # noqa: F811
    pod = node.pod("streams", volumes={}, containers=[
        node.container("app", KEEP_RUNNING),
        # A shell reading its standard input, as `kubectl run -i` starts one,
        # and one on a terminal, as `kubectl run -it` does.
        node.container("shell", "exec sh", stdin=True, stdin_once=True),
        node.container("console", "exec sh", stdin=True, stdin_once=True, tty=True)])
    with node.running(pod):
        app, shell = node.status(pod, "app").id, node.status(pod, "shell").id
        console = node.status(pod, "console").id

        # On a terminal: the process sees one on its three streams, named in
        # the container's devpts as under runc, reads what is typed (echoed
        # by the terminal), and ends when it exits.
        script = ("test -t 0 && test -t 1 && test -t 2 && case $(tty) in /dev/pts/*) echo on-a-terminal;; esac; "
                  "read line; echo got:$line")
        out = crictl_on_a_terminal(node, "exec", "-it", app, "sh", "-c", script, typed=b"typed\r",
                                   after=b"on-a-terminal")
        assert b"got:typed" in out, out

        # Without one: bytes through, then end of file (cat ends).
        data = bytes(range(1, 256)) * 64 + b"\nlast line\n"
        out = crictl(node, "exec", "-i", app, "sh", "-c", "cat; echo end-of-input", stdin=data)
        assert out == data + b"end-of-input\n"

        # Attach: a command written to the container's shell runs there.
        out = crictl(node, "attach", "-i", shell, stdin=b"echo attached-$((6*7))\nexit 3\n")
        assert b"attached-42" in out, out
        wait_until(lambda: node.status(pod, "shell").state == cri.CONTAINER_EXITED,
                   what="the attached shell exits after `exit 3`")
        assert node.status(pod, "shell").exit_code == 3

        # Attach on a terminal: the container's own shell runs on one, of
        # the container's devpts.
        out = crictl_on_a_terminal(node, "attach", "-it", console, after=b"", wait=3.0,
                                   typed=b"test -t 0 && case $(tty) in /dev/pts/*) echo tty-$((6*7));; esac; exit 5\r")
        assert b"tty-42" in out, out
        wait_until(lambda: node.status(pod, "console").state == cri.CONTAINER_EXITED,
                   what="the console's shell exits after `exit 5`")
        assert node.status(pod, "console").exit_code == 5


def test_container_stats_come_from_its_cgroup(node):  # noqa: F811
    # 8 MiB held in the container's memory (a tmpfs file counts as shmem).
    pod = node.pod("stats", volumes={}, containers=[
        node.container("busy", "head -c 8388608 /dev/zero > /dev/shm/held; " + KEEP_RUNNING)])
    with node.running(pod):
        container = node.status(pod, "busy").id
        wait_until(lambda: node.run(container, "/bin/ls", "-l", "/dev/shm/held").split()[4] == b"8388608",
                   what="the container's 8 MiB in /dev/shm")
        before = time.time_ns()
        stats = node.runtime._call("ContainerStats", cri.ContainerStatsRequest(container_id=container)).stats
        assert stats.attributes.id == container and stats.attributes.metadata.name == "busy"
        assert stats.cpu.timestamp > 0 and stats.memory.timestamp > 0
        assert stats.cpu.usage_core_nano_seconds.value > 0
        assert stats.memory.working_set_bytes.value >= 8 * MiB, stats.memory
        # Listing them for this container alone gives the same one.
        listed = node.runtime._call("ListContainerStats", cri.ListContainerStatsRequest(
            filter=cri.ContainerStatsFilter(id=container))).stats
        assert [s.attributes.id for s in listed] == [container]
        assert listed[0].cpu.timestamp >= before - 60 * 10**9


def test_a_container_over_its_memory_limit_is_oom_killed(node):  # noqa: F811
    # dd's one 64 MiB buffer, filled, against a 32 MiB limit: the
    # container's own process is the one killed.
    pod = node.pod("oom", volumes={}, containers=[
        node.container("hog", "exec dd if=/dev/zero of=/dev/null bs=64M", memory_limit=32 * MiB)])
    with node.running(pod):
        wait_until(lambda: node.status(pod, "hog").state == cri.CONTAINER_EXITED, timeout=120,
                   what="the memory hog is stopped")
        status = node.status(pod, "hog")
        assert (status.exit_code, status.reason) == (137, "OOMKilled"), status
