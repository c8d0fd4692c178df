"""A pod's containers in their order and at their sizes, started through
CRI by a real containerd with kubelet's CRI side replayed: init containers
run one after the other to completion before the app, a failed one fails
the pod under restartPolicy Never, a sidecar (an init container that
restarts Always) runs beside the app and stops after it; environments and
exec commands of the sizes runc takes.

Every test runs once per RuntimeClass of RUNTIME_CLASSES (tests/harness/pod_nodes.py
`node`: a private containerd, and the crust stack for crust's runtimes);
runc (containerd's default handler) is the baseline. CRUST_POD_RUNTIME_CLASSES
(comma-separated) runs them under others: crust-runc (crust's OCI runtime)
or crust-microvm (crust's shim v2 and the microVM handler).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import EmptyDir, VolumeMount
from crust.kubelet.cri import PodFailed
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import KEEP_RUNNING, cri_log
from tests.harness.pod_nodes import node  # noqa: F401 - a fixture


def test_init_containers_run_in_order_to_completion_before_the_app(node):
    work = VolumeMount("work", "/work")
    pod = node.pod("init", volumes={"work": EmptyDir()},
                   init_containers=[node.container("first", "sleep 0.3; echo one > /work/steps", work),
                                    node.container("second", 'test "$(cat /work/steps)" = one && '
                                                   "echo two >> /work/steps", work)],
                   containers=[node.container("app", "cat /work/steps; " + KEEP_RUNNING, work)])
    with node.running(pod):
        first, second, app = (node.status(pod, n) for n in ("first", "second", "app"))
        assert (first.state, first.exit_code, second.state, second.exit_code) == (
            cri.CONTAINER_EXITED, 0, cri.CONTAINER_EXITED, 0)
        assert app.state == cri.CONTAINER_RUNNING
        # Each started only once the one before had finished.
        assert first.finished_at <= second.created_at and second.finished_at <= app.created_at
        wait_until(lambda: [text for _, text in cri_log(app.log_path)] == ["one", "two"], what="the app's read")
        assert (node.volumes.path(pod, "work") / "steps").read_text() == "one\ntwo\n"


def test_a_failed_init_container_fails_the_pod_under_restart_policy_never(node):
    pod = node.pod("init-fails", volumes={},
                   init_containers=[node.container("check", "echo not ready; exit 3")],
                   containers=[node.container("app", KEEP_RUNNING)])
    node.volumes.set_up(pod)
    try:
        with pytest.raises(PodFailed, match='init container "check" exited with 3'):
            node.runtime.run_pod(pod)
        status = node.runtime.pod_status(pod)
        assert [c.metadata.name for c in status.containers] == ["check"], "the app must never be created"
        assert status.sandboxes[0].state == cri.SANDBOX_NOTREADY, "kubelet kills the failed pod"
    finally:
        node.stop(pod)
    node.assert_gone(pod)


def test_a_sidecar_keeps_running_beside_the_app_and_stops_after_it(node):
    shared = VolumeMount("shared", "/shared")
    pod = node.pod("sidecar", volumes={"shared": EmptyDir()},
                   init_containers=[node.container(
                       "ticker", "trap 'exit 0' TERM; i=0; while true; do i=$((i+1)); echo tick-$i >> /shared/ticks; "
                       "sleep 0.1; done", shared, restart_policy="Always")],
                   containers=[node.container("app", "until [ -s /shared/ticks ]; do sleep 0.05; done; "
                                              "echo first $(head -n 1 /shared/ticks); " + KEEP_RUNNING, shared)])
    with node.running(pod):
        ticker, app = node.status(pod, "ticker"), node.status(pod, "app")
        assert (ticker.state, app.state) == (cri.CONTAINER_RUNNING, cri.CONTAINER_RUNNING)
        assert ticker.started_at <= app.created_at, "the app starts once the sidecar runs"
        wait_until(lambda: "first tick-1" in Path(app.log_path).read_text(errors="replace"), what="the app's read")
        count = int(node.run(app.id, "/bin/sh", "-c", "wc -l < /shared/ticks"))
        wait_until(lambda: int(node.run(app.id, "/bin/sh", "-c", "wc -l < /shared/ticks")) > count,
                   what="the sidecar to keep writing")
        node.runtime.kill_pod(pod)
        ticker, app = node.status(pod, "ticker"), node.status(pod, "app")
        assert (ticker.state, ticker.exit_code, app.state, app.exit_code) == (
            cri.CONTAINER_EXITED, 0, cri.CONTAINER_EXITED, 0)
        assert app.finished_at <= ticker.finished_at, "the sidecar stops after the app"


def test_exec_and_environments_of_the_sizes_runc_takes(node):
    """Service links give a pod hundreds of variables; a script is one long
    argument; a container may carry hundreds of KiB of environment. Only
    the kernel's limits apply, and a big command never stalls another
    container's exec."""
    links = {f"SVC_{n}_SERVICE_HOST": f"10.96.{n // 256}.{n % 256}" for n in range(280)}
    links["LONG_VALUE"] = "v" * 5120
    big = {f"BIG_{n}": chr(ord("a") + n % 26) * 10240 for n in range(30)}   # 300 KiB
    pod = node.pod("env", volumes={}, containers=[
        node.container("links", KEEP_RUNNING, env=links),
        node.container("big", KEEP_RUNNING, env=big)])
    with node.running(pod):
        small, large = node.status(pod, "links"), node.status(pod, "big")
        assert (small.state, large.state) == (cri.CONTAINER_RUNNING, cri.CONTAINER_RUNNING)
        seen = dict(line.split("=", 1) for line in node.run(small.id, "/bin/sh", "-c", "env").decode().splitlines()
                    if "=" in line)
        assert all(seen.get(k) == v for k, v in links.items())
        # An exec with 280 variables of its own and a 5 KiB script.
        script = "; ".join(f"test -n \"$SVC_{n}_SERVICE_HOST\"" for n in range(280)) + "; echo ${#LONG_VALUE}"
        assert len(script) > 5000
        out = node.runtime.exec_sync(small.id, ["/bin/sh", "-c", script])
        assert (out.exit_code, out.stdout) == (0, b"5120\n"), out.stderr
        assert node.run(large.id, "/bin/sh", "-c", "echo ${#BIG_29}") == b"10240\n"
        # Execs into both at once: the small one answers while the big one's
        # environment is read back.
        import threading
        times = {}

        def timed(name, container_id, cmd):
            began = time.monotonic()
            result = node.runtime.exec_sync(container_id, cmd)
            times[name] = (time.monotonic() - began, result.exit_code, len(result.stdout))

        threads = [threading.Thread(target=timed, args=("big", large.id, ["/bin/sh", "-c", "env"])),
                   threading.Thread(target=timed, args=("small", small.id, ["/bin/true"]))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert times["big"][1] == 0 and times["big"][2] > 300 * 1024
        assert times["small"][1] == 0
        print(f"\nexecs under {node.runtime_class}: env of 300 KiB {times['big'][0]:.2f} s, "
              f"/bin/true beside it {times['small'][0]:.2f} s")
