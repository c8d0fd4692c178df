"""A pod's guest memory follows its containers' memory limits, as the CRI
passes them (crust.kata.pod.guest_memory): pods started through a real
containerd with kubelet's CRI side replayed, on a handler that keeps a
template, with a floor of 256 MiB and a ceiling of 1 GiB."""

from __future__ import annotations

from crust.kubelet import EmptyDir, VolumeMount
from tests.harness.pod_nodes import KEEP_RUNNING, MiB, pod_node
from tests.harness.template_log import wait_for_template

FLOOR, CEILING = 256, 1024


def _mem_total(node, container_id: str) -> int:
    """The guest's MemTotal in bytes, as the container reads it."""
    meminfo = node.run(container_id, "/bin/cat", "/proc/meminfo").decode()
    line = next(line for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    return int(line.split()[1]) * 1024


def _df_total(node, container_id: str, path: str) -> int:
    fields = node.run(container_id, "/bin/df", "-P", "-B1", path).decode().splitlines()[-1].split()
    return int(fields[1])


def test_a_pods_guest_gets_its_containers_limits_above_the_floor_up_to_the_ceiling(root):
    """A pod whose container has a 512 MiB limit, started at once (its VM
    booted while the handler saves its template), gets 512 MiB more than
    a pod without limits (restored from the template: the floor), and its
    container can fill its limit (480 MiB allocated and written by dd);
    its Memory emptyDir is bounded by half of the grown guest. A pod
    asking 4 GiB gets the ceiling (restored, plugged as much as it
    allows)."""
    extra = ("--vm-template", "--memory", str(FLOOR), "--max-memory", str(CEILING))
    with pod_node("crust-microvm", root, handler_extra=extra) as node:
        big = node.pod("mem-512", volumes={"ram": EmptyDir(medium="Memory")}, containers=[
            node.container("app", KEEP_RUNNING, VolumeMount("ram", "/ram"), memory_limit=512 * MiB)])
        with node.running(big):
            app = node.status(big, "app").id
            big_total = _mem_total(node, app)
            filled = node.runtime.exec_sync(app, ["/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=480M", "count=1"],
                                            timeout=180)
            assert filled.exit_code == 0, filled.stderr
            # tmpfs rounds its size up to whole pages.
            assert 0 <= _df_total(node, app, "/ram") - big_total // 2 < 4096

        wait_for_template(node.handler)
        plain = node.pod("mem-floor", volumes={}, containers=[node.container("app", KEEP_RUNNING)])
        with node.running(plain):
            floor_total = _mem_total(node, node.status(plain, "app").id)
        huge = node.pod("mem-4g", volumes={}, containers=[
            node.container("app", KEEP_RUNNING, memory_limit=4096 * MiB)])
        with node.running(huge):
            huge_total = _mem_total(node, node.status(huge, "app").id)

        # The kernel keeps part of the boot memory for itself; a plugged
        # DIMM adds all of its size.
        assert 128 * MiB < floor_total < FLOOR * MiB
        assert big_total - floor_total == 512 * MiB
        assert huge_total - floor_total == (CEILING - FLOOR) * MiB
        log = node.handler_log.read_text(errors="replace")
        assert log.count('"msg": "guest memory plugged"') == 2, log[-3000:]
