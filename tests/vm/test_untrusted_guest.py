"""The guest is not trusted, driven as the issue's hostile guest drove it:
a privileged container of a crust-microvm pod gets guest root outside every
container through the guest kernel's core_pattern (its helper runs as root
in the guest's own namespaces) and from there stops the guest's agent
(SIGSTOP: it holds its port open and answers nothing). A second pod runs
beside it on the node.

- the guest writes its console as fast as it can: the host's console
  files stay within their bound (crust.kata.vmm.console), the newest kept;
- kubelet's stop of the silent pod ends within the grace period plus the
  stated bound (crust.kata.agent.stop_bound): its VM is killed, its containers are
  reported exited 137, the handler names the agent that did not answer,
  and the removal leaves nothing of the pod; the pod beside it execs as
  fast as before."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kata.agent import stop_bound
from crust.kata.vmm import console
from crust.kata.vmm.console import previous
from crust.kata.vmm.qemu import qemu_pids_under
from crust.sys import mount as sysmount
from tests.harness.pod_nodes import KEEP_RUNNING, pod_node

pytestmark = pytest.mark.slow

# Written into the privileged container's root, which the guest's root
# namespace sees at /run/crust/share/<id>/rootfs: run by the guest kernel as
# root for a crashing process, it does what the file `mode` beside it says,
# in the background (the exec that crashed is reported first): `flood`
# writes the guest's console as fast as it can for FLOOD_SECONDS; `stop`
# stops the agent a moment later.
FLOOD_SECONDS = 30
GUEST_ROOT_HELPER = f"""#!/bin/sh
here="${{0%/helper}}"
echo guest root > "$here/ran"
case "$(cat "$here/mode")" in
  flood) ( timeout {FLOOD_SECONDS} yes crust-flood > /dev/console ) </dev/null >/dev/null 2>&1 & ;;
  stop) ( sleep 3
          for d in /proc/[0-9]*; do
            case "$(tr '\\0' ' ' < "$d/cmdline" 2>/dev/null)" in
              *crust.guest*--port-name*) kill -STOP "${{d#/proc/}}" ;;
            esac
          done ) </dev/null >/dev/null 2>&1 & ;;
esac
"""


def as_guest_root(mode: str) -> str:
    """The script a privileged container's exec runs: the helper in its
    root, core_pattern pointing at it, a process that crashes. The kernel
    keeps 127 bytes of core_pattern and splits it at spaces: a shell finds
    the helper below the containers' roots (the pod's share, which the
    guest's root namespace sees at /run/crust/share) by a glob."""
    return (f"cat > /helper <<'EOF'\n{GUEST_ROOT_HELPER}EOF\necho {mode} > /mode; rm -f /ran; "
            "echo '|/bin/sh -c sh${IFS}/run/crust/share/*/rootfs/helper' > /proc/sys/kernel/core_pattern && "
            "sh -c 'kill -SEGV $$'; sleep 1; cat /ran")


def consoles(root_path: Path) -> dict[Path, tuple[int, int]]:
    """Each VM's console files: directory -> (console.log's size, console.log.1's)."""
    found = {}
    for path in root_path.rglob("console.log"):
        sizes = []
        for part in (path, previous(path)):
            try:
                sizes.append(part.stat().st_size)
            except FileNotFoundError:
                sizes.append(0)
        found[path.parent] = (sizes[0], sizes[1])
    return found


def exec_seconds(node, container_id: str, count: int = 5) -> float:
    """The median wall time of an exec of /bin/true in the container."""
    times = []
    for _ in range(count):
        started = time.monotonic()
        node.run(container_id, "/bin/true")
        times.append(time.monotonic() - started)
    return statistics.median(times)


@pytest.fixture
def node(root):
    with pod_node("crust-microvm", root) as made:
        yield made


def test_a_guest_root_floods_its_console_within_the_bound_then_a_silent_agent_is_stopped_leaving_nothing(node, root):
    silent = node.pod("silent", volumes={}, containers=[node.container("root", KEEP_RUNNING, privileged=True),
                                                        node.container("app", KEEP_RUNNING)])
    beside = node.pod("beside", volumes={}, containers=[node.container("app", KEEP_RUNNING)])
    for pod in (silent, beside):
        node.volumes.set_up(pod)
    try:
        silent_id = node.runtime.run_pod(silent)
        node.runtime.run_pod(beside)
        neighbour = node.status(beside, "app").id
        before = exec_seconds(node, neighbour)
        vms = set(qemu_pids_under(root.path))
        guest_root = node.status(silent, "root")
        assert node.run(guest_root.id, "/bin/sh", "-c", as_guest_root("flood")) == b"guest root\n"
        # The guest writes its console for FLOOD_SECONDS: no console file
        # on the host ever holds more than its bound.
        largest, rotated = 0, set()
        until = time.monotonic() + FLOOD_SECONDS + 3
        while time.monotonic() < until:
            for directory, sizes in consoles(root.path).items():
                assert max(sizes) <= console.FILE_BYTES, (directory, sizes)
                largest = max(largest, sum(sizes))
                if sizes[1]:
                    rotated.add(directory)
            time.sleep(0.25)
        print(f"console flood of {FLOOD_SECONDS} s: at most {largest} bytes on disk, bound "
              f"{2 * console.FILE_BYTES}")
        (flooded,) = rotated
        assert b"crust-flood" in (flooded / "console.log").read_bytes()[-4096:]
        assert node.run(guest_root.id, "/bin/sh", "-c", as_guest_root("stop")) == b"guest root\n"
        time.sleep(6)   # the helper's pause, and the agent stopped
        started = time.monotonic()
        node.runtime.kill_pod(silent)
        took = time.monotonic() - started
        bound = silent.termination_grace_period_seconds + stop_bound.SIGNAL_ANSWER + stop_bound.KILLED_EXIT \
            + stop_bound.QEMU_KILL
        print(f"stop of the silent pod: {took:.1f} s (bound {bound:.0f} s); exec beside it before: "
              f"{before * 1e3:.0f} ms")
        assert took < bound, took
        log = node.handler_log.read_text(errors="replace")
        assert "its guest's agent did not answer" in log and "killing QEMU" in log, log[-3000:]
        for name in ("root", "app"):
            status = node.status(silent, name)
            assert (status.state, status.exit_code) == (cri.CONTAINER_EXITED, 137), (name, status)
        left = set(qemu_pids_under(root.path))
        assert len(vms - left) == 1 and len(left) == 1, (vms, left)
        after = exec_seconds(node, neighbour)
        print(f"exec beside it after: {after * 1e3:.0f} ms")
        assert after < max(3 * before, before + 1.0), (before, after)
        node.runtime.remove_pod(silent)
    finally:
        node.stop(silent)
        node.stop(beside)
    node.assert_gone(silent)
    assert qemu_pids_under(root.path) == []
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(f"{root.path}/")] == []
    assert [p for p in root.path.rglob(f"*{silent_id}*")] == []
