"""Pod lives one after another on the microVM node, lived as kubelet lives
them, and what the node holds between them.

A life: the pod's deferred volume published, RunPodSandbox (a VM restored
from the handler's template, a NIC on the pod network), its container
writing into the volume, an ExecSync reading it back, then kubelet's kill
and removal and the volume unpublished. Every tenth life (the fourth of
each ten) its container crashes once and kubelet starts it again in the
same sandbox (restartPolicy Always); every tenth (the eighth) the pod's
QEMU is SIGKILLed while the container runs.

Beside the lives one pod runs all along (the anchor), as other pods do on
a node: the node's shared shim (containerd-shim.md) serves it and every
life, so the shim lives as long as the series. Between lives the node is
idle but for the anchor, and measured: the handler's RSS and open
descriptors, and, while each life's pod ran, the shim's. What the node held
before the first life, the anchor running, is its baseline: after the last,
everything a life makes (VMs, claims, mounts, loop devices, network
namespaces, veths on the pod bridge, cgroups, files of the handler, proxy
and kubelet, processes) must be as it was, and once the anchor is gone too,
no shim, no shim socket and no VM is left.

tests/vm/test_churn.py runs a short series in the suite; bench/runtime/pod_churn.py
the long one.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import time
from pathlib import Path

from crust.api import cri_pb2 as cri
from crust.kata.vmm.qemu import qemu_pids_under
from crust.kubelet import Container, Pod, VolumeMount
from crust.kubelet.containerd import CGROUP_FS
from crust.kubelet.volumes import VolumeManager
from crust.sys import mount as sysmount
from tests.harness.cri import CriNode, container_log, processes_naming, shim_pids
from tests.harness.daemons import wait_until
# SIGTERM at once (a shell waiting on its child takes the trap at once). A
# crashing one exits 1 on its first run (its mark in the volume).
RUN = "trap 'exit 0' TERM; echo life-{n} > /data/life && sync && echo up; sleep 600 & wait"
CRASH_ONCE = "if [ ! -e /data/crashed-{n} ]; then touch /data/crashed-{n}; sync; exit 1; fi; " + RUN
ANCHOR = "trap 'exit 0' TERM; echo up; sleep 100000 & wait"
RESTARTED, KILLED = 3, 7   # the life in each ten whose container crashes once / whose QEMU is killed
LIFE_TIMEOUT = 300.0       # seconds for any one step of a life (a busy machine's VM restore)
# How much the handler's and the shims' RSS and descriptors may grow from
# the early lives to the last ones.
GROWTH_ALLOWED = 1.05


@dataclasses.dataclass
class Life:
    n: int
    kind: str                # "plain", "restarted" or "killed"
    seconds: float
    handler_rss_kib: int     # after the life, the node idle
    handler_fds: int
    shim_rss_kib: int        # while the pod ran
    shim_fds: int


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Lives:
    """The lives of one node and one volume, and the node's baseline."""

    def __init__(self, node: CriNode, pv, image: str):
        self.node, self.pv, self.image = node, pv, image
        node.runtime.crash_backoff = 0.0   # a crashed container starts again at the next sync
        self.shim_sockets: list[Path] = []
        self.device: tuple[int, int] | None = None
        self.before_anchor = self.held()
        self.anchor = Pod(uid="uid-churn-anchor", name="churn-anchor", runtime_class_name="crust-microvm",
                          host_network=node.containerd.network is None, restart_policy="Never",
                          termination_grace_period_seconds=2,
                          containers=[Container("idle", image, command=["/bin/sh", "-c", ANCHOR])])
        node.runtime.run_pod(self.anchor)
        idle = node.runtime.pod_status(self.anchor).latest("idle")
        wait_until(lambda: "up" in container_log(idle), timeout=LIFE_TIMEOUT, what="the anchor pod to run")
        self.baseline = self.held()

    def end_anchor(self) -> None:
        """The anchor pod removed: with it the node's last pod, so its shim ends."""
        self.node.runtime.kill_pod(self.anchor)
        self.node.runtime.remove_pod(self.anchor)
        assert VolumeManager(self.node.kubelet.root).clean_pod_dir(self.anchor), "the anchor's pod directory stays"
        self.baseline = self.before_anchor

    # -- what the node holds ------------------------------------------------------------------

    def held(self) -> dict[str, set]:
        """Everything a pod's life could leave, as sets to compare."""
        node, containerd = self.node, self.node.containerd
        roots = (node.root.path, containerd.directory)
        found = {
            "vms": set(qemu_pids_under(node.root.path)),
            "shims": set(shim_pids(containerd)),
            "claims": set(node.claims()),
            "mounts": {m.mount_point for m in sysmount.mounts()
                       if any((m.mount_point + "/").startswith(f"{r}/") for r in roots)},
            "loop devices": {p.parent.parent.name for p in Path("/sys/block").glob("loop*/loop/backing_file")
                             if p.read_text().startswith(tuple(f"{r}/" for r in roots))},
            "processes": {line for r in roots for line in processes_naming(str(r))},
            "cgroups": {str(p) for p in (CGROUP_FS / containerd.cgroup_root.strip("/")).rglob("*")
                        if p.is_dir()} if CGROUP_FS.is_dir() else set(),
            "files": {str(p) for p in _files(node.root.path) if not p.name.endswith(".log")},
        }
        if containerd.network is not None:
            ports = Path(f"/sys/class/net/{containerd.network.bridge}/brif")
            found["bridge ports"] = set(os.listdir(ports)) if ports.is_dir() else set()
        return found

    def left(self) -> dict[str, set]:
        """What the node holds now and did not before the first life, and
        the shims' sockets and the volume's host mounts (never any)."""
        now = self.held()
        diff = {kind: now[kind] - self.baseline.get(kind, set()) for kind in now}
        if not self.baseline["shims"]:   # the anchor's shim, serving the lives too, keeps its socket
            diff["shim sockets"] = {str(s) for s in self.shim_sockets if s.exists()}
        if self.device is not None:
            diff["volume mounted on the host"] = {m.mount_point for m in sysmount.of_device(*self.device)}
        return {kind: items for kind, items in diff.items() if items}

    def left_once_settled(self, timeout: float = 30.0) -> dict[str, set]:
        """left(), once it is empty or timeout seconds have passed (a loop
        device's detach, a daemon's exit may finish just after the call that
        asked for them)."""
        deadline = time.monotonic() + timeout
        while (found := self.left()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return found

    # -- a life -------------------------------------------------------------------------------

    def live(self, n: int) -> Life:
        kind = {RESTARTED: "restarted", KILLED: "killed"}.get(n % 10, "plain")
        node, started = self.node, time.monotonic()
        script = (CRASH_ONCE if kind == "restarted" else RUN).format(n=n)
        pod = Pod(uid=f"uid-churn-{n}", name=f"churn-{n}", fs_group=2000, runtime_class_name="crust-microvm",
                  host_network=node.containerd.network is None, volumes={"data": self.pv},
                  restart_policy="Always" if kind == "restarted" else "Never", termination_grace_period_seconds=2,
                  containers=[Container("app", self.image, command=["/bin/sh", "-c", script],
                                        volume_mounts=[VolumeMount("data", "/data")])])
        node.kubelet.start_pod(self.pv, pod)
        if self.device is None:
            entry = node.entry(pod, self.pv)
            self.device = (entry["device-major"], entry["device-minor"])
        sandbox_id = node.runtime.run_pod(pod)
        app = node.runtime.pod_status(pod).latest("app")
        if kind == "restarted":
            crashed = node.runtime.wait_container(app.id, timeout=LIFE_TIMEOUT)
            assert (crashed.state, crashed.exit_code) == (cri.CONTAINER_EXITED, 1), crashed
            assert node.runtime.sync_pod(pod) == sandbox_id, "the restart made a new sandbox"
            app = node.runtime.pod_status(pod).latest("app")
            assert app.id != crashed.id and app.metadata.attempt == 1, app
        wait_until(lambda: "up" in container_log(app), timeout=LIFE_TIMEOUT, what=f"life {n}'s container to write")
        read = node.runtime.exec_sync(app.id, ["/bin/cat", "/data/life"], timeout=60)
        assert (read.exit_code, read.stdout) == (0, f"life-{n}\n".encode()), read
        (shim,) = shim_pids(node.containerd)
        shim_rss, shim_fds = rss_kib(shim), fds(shim)
        argv = Path(f"/proc/{shim}/cmdline").read_bytes().decode().split("\0")
        self.shim_sockets.append(Path(argv[argv.index("-socket") + 1]))
        if kind == "killed":
            (vm,) = set(qemu_pids_under(node.root.path)) - self.baseline["vms"]
            os.kill(vm, signal.SIGKILL)
            ended = wait_until(lambda: (s := node.runtime.container_status(app.id)).state == cri.CONTAINER_EXITED
                               and s, timeout=LIFE_TIMEOUT, what=f"life {n}'s container to end with its VM")
            assert ended.exit_code != 0, ended
            wait_until(lambda: node.claims() == set(), timeout=LIFE_TIMEOUT, what=f"life {n}'s claim to go")
        node.runtime.kill_pod(pod)
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(self.pv, pod)
        # kubelet's housekeeping of a deleted pod (cleanupOrphanedPodDirs).
        assert VolumeManager(node.kubelet.root).clean_pod_dir(pod), f"life {n}'s pod directory stays"
        wait_until(lambda: set(shim_pids(node.containerd)) == self.baseline["shims"] and
                   set(qemu_pids_under(node.root.path)) == self.baseline["vms"],
                   timeout=LIFE_TIMEOUT, what=f"life {n}'s VM to go, the anchor's shim and VM to stay")
        assert node.claims() == set()
        handler = node.env.handler.proc.pid
        return Life(n=n, kind=kind, seconds=round(time.monotonic() - started, 3), handler_rss_kib=rss_kib(handler),
                    handler_fds=fds(handler), shim_rss_kib=shim_rss, shim_fds=shim_fds)


def _files(top: Path):
    for dirpath, dirnames, filenames in os.walk(top):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            yield Path(dirpath) / name


def growth(lives: list[Life], early: range, field: str) -> tuple[float, float]:
    """The field's median over the early lives and over the last as many."""
    first = [getattr(life, field) for life in lives if life.n in early]
    last = [getattr(life, field) for life in lives[-len(early):]]
    return statistics.median(first), statistics.median(last)
