"""A rolling upgrade with live volumes: the previous release of crust runs
`crust node` with a deferred volume held by a running sandbox and a volume
published on the host with data; it is stopped with SIGTERM, as a DaemonSet
rollout stops its pod, and this release starts `crust node` on the same
directories. The volumes' whole life goes on under the new release: stats
(from inside the sandbox for the deferred one), expansion, then a rollback
to the previous release and forward again, then unpublish, unstage, delete,
the data intact and nothing left behind.

The previous release runs from a git worktree of its commit, in a venv of
its own whose site-packages reuse this checkout's dependencies (a .pth file
names the old tree first, then this venv's site-packages): nothing is
downloaded. Its `crust node` starts its children with its own interpreter,
so every daemon of that node is the previous release's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common.channel import local_channel
from crust.common.formats import FORMAT_KEY
from crust.contract.mountinfo import SCHEMA_VERSION
from crust.csi_shim.records import ShimVolumeRecord
from crust.driver.records import GroupSnapshotRecord, NodeVolumeRecord, PoolRecord, SnapshotRecord, VolumeRecord
from crust.kata.vmm.accel import ProbeRecord
from crust.kubelet import Kubelet, PersistentVolume, Pod
from crust.node.config import NodeConfig
from crust.node.supervisor import NodeStatus
from crust.proxy.records import Decision, DeferredVolume, HandlerRecord
from crust.runtime_handler.container_records import ContainerRecord
from crust.runtime_handler.handler import SandboxRecord
from crust.sys import mount as sysmount
from tests.harness.daemons import loops_left
from tests.harness.node_run import write_config

REPO = Path(__file__).resolve().parents[2]
# The previous release of crust: main as it stood on 2026-11-23 before
# records named their format version (no format key in any record, no
# handler leases, no peer credentials on the registry). Rolling back to it
# must keep working as long as no format this release writes is newer than
# version 1: it has no way to refuse a newer one.
PREVIOUS_RELEASE = "721eaeed7764bfc5e9ac191a3d3e3c260cba048f"
MIB = 1024**2
SIZE = 320 * MIB            # xfs: at least 300 MiB, and it grows online on this kernel
GROWN = SIZE + 256 * MIB
PAYLOAD = MIB
# Every record kind this release writes, by model: all still version 1, so
# the previous release reads them (it ignores the key it does not know).
WRITTEN_FORMATS = (VolumeRecord, SnapshotRecord, GroupSnapshotRecord, NodeVolumeRecord, PoolRecord, ShimVolumeRecord,
                   DeferredVolume, Decision, HandlerRecord, SandboxRecord, ContainerRecord, NodeStatus, ProbeRecord)


def _missing_release(reason: str) -> None:
    message = (f"the previous release {PREVIOUS_RELEASE[:12]} is not available: {reason}. The upgrade test "
               "needs the repository's history: clone without --depth (or `git fetch --unshallow`)")
    if os.environ.get("CI") == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


class PreviousRelease:
    """The previous release checked out and runnable, under a temporary directory."""

    def __init__(self) -> None:
        git = shutil.which("git")
        if git is None:
            _missing_release("git is not installed")
        known = subprocess.run([git, "-C", str(REPO), "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
                               capture_output=True, text=True)
        if known.returncode != 0:
            _missing_release(known.stderr.strip() or "no such commit in this clone")
        started = time.monotonic()
        self.git = git
        self.home = Path(tempfile.mkdtemp(prefix="crust-prev-"))
        self.tree = self.home / "release"  # not "crust": the old nodes run from home
        self.worktree = False
        try:
            subprocess.run([git, "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(self.tree),
                            PREVIOUS_RELEASE], check=True, capture_output=True, text=True)
            self.worktree = True
            venv = self.home / "venv"
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                           capture_output=True, text=True)
            self.python = venv / "bin" / "python"
            site = Path(subprocess.run([str(self.python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                        "['purelib'])"], check=True, capture_output=True, text=True).stdout.strip())
            # The old tree first; then this checkout's dependencies (a plain
            # path: its own .pth files, this checkout's editable crust among
            # them, are not read from there).
            ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
            (site / "crust-previous.pth").write_text("\n".join([str(self.tree), *ours]) + "\n")
            self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
            where = subprocess.run([str(self.python), "-c", "import crust, grpc, pydantic; print(crust.__file__)"],
                                   check=True, capture_output=True, text=True, cwd=self.home, env=self.env)
            assert Path(where.stdout.strip()).is_relative_to(self.tree), where.stdout
        except BaseException:
            self.close()
            raise
        self.setup_seconds = time.monotonic() - started

    def close(self) -> None:
        if self.worktree:
            subprocess.run([self.git, "-C", str(REPO), "worktree", "remove", "--force", str(self.tree)],
                           capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture
def previous():
    release = PreviousRelease()
    try:
        yield release
    finally:
        release.close()


class Node:
    """`crust node --config` of one release, on the test's directories."""

    def __init__(self, name: str, python: Path, cwd: Path, env: dict[str, str], root: Path, config: Path):
        self.name, self.python, self.cwd, self.env, self.root, self.config = name, python, cwd, env, root, config
        self.proc: subprocess.Popen | None = None
        self.out = root / f"node-{name}.out"

    def start(self, timeout: float = 60) -> float:
        started = time.monotonic()
        self.proc = subprocess.Popen([str(self.python), "-m", "crust", "node", "--config", str(self.config)],
                                     cwd=self.cwd, env=self.env, stdout=open(self.out, "wb"),
                                     stderr=open(self.root / f"node-{self.name}.log", "ab"))
        while time.monotonic() - started < timeout:
            if self.proc.poll() is not None:
                log = (self.root / f"node-{self.name}.log").read_text(errors="replace")
                raise AssertionError(f"crust node ({self.name}) exited with {self.proc.returncode}:\n{log[-3000:]}")
            if "every component is serving" in self.out.read_text(errors="replace"):
                return time.monotonic() - started
            time.sleep(0.05)
        raise AssertionError(f"crust node ({self.name}) did not serve within {timeout} s")

    def stop(self) -> int | None:
        """SIGTERM, as the kubelet sends it to a pod the rollout replaces."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc is not None else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def sandbox(self, *args: str) -> subprocess.CompletedProcess:
        """`crust sandbox ARGS` of this release, against its handler."""
        config = NodeConfig.load(self.config)
        return subprocess.run([str(self.python), "-m", "crust", "sandbox", "--handler-endpoint",
                               f"unix://{config.handler_socket}", *args], cwd=self.cwd, env=self.env,
                              capture_output=True, text=True, timeout=120)


def _bundle(root: Path, target: Path) -> Path:
    """A pod whose process writes 1 MiB and its sha256 into /data, says so,
    and keeps running: the sandbox is live across the upgrade."""
    bundle = root / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    script = (f"head -c {PAYLOAD} /dev/urandom > /data/payload.bin && "
              "sha256sum /data/payload.bin | cut -d' ' -f1 > /data/payload.sha256 && sync && "
              "echo payload-written && exec sleep infinity")
    (bundle / "config.json").write_text(json.dumps({
        "ociVersion": "1.0.2", "root": {"path": "rootfs"},
        "process": {"args": ["/bin/sh", "-c", script], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
        "mounts": [{"destination": "/data", "source": str(target), "type": "bind", "options": ["rbind"]}],
    }))
    return bundle


def _until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _kill_our_sandboxes(state: Path) -> None:
    """Sandboxes outlive their handler: after a failure, the test ends the
    processes inside its own sandboxes' mount namespaces, and only those
    (a mount below this test's handler run directory is seen only there)."""
    mark = str(state / "handler" / "run") + "/"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "mountinfo").read_text():
                    os.kill(int(entry.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                continue


def _first_key(path: Path) -> tuple[str, int]:
    data = json.loads(path.read_bytes())
    key = next(iter(data))
    return key, data[key]


def test_a_rolling_upgrade_with_live_volumes_and_a_rollback(root, previous, capsys):
    timings = {"previous release set up (worktree + venv)": previous.setup_seconds}
    config_path = write_config(root.path)
    config = NodeConfig.load(config_path)
    (config.kubelet_root / "plugins_registry").mkdir(parents=True)
    current_env = {**os.environ, "PYTHONPATH": str(REPO)}
    old = Node("previous", previous.python, previous.home, previous.env, root.path, config_path)
    new = Node("current", Path(sys.executable), REPO, current_env, root.path, config_path)
    kubelet = Kubelet(config.kubelet_root, "node-a", retry_seconds=20)
    sandbox_pids: list[int] = []
    try:
        # -- the previous release: a deferred volume in a live sandbox, a host volume with data --------
        timings["previous crust node start"] = old.start()
        kubelet.register()
        with local_channel(kubelet.endpoint) as channel:
            ctl = csi_pb2_grpc.ControllerStub(channel)
            cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type="xfs"),
                                           access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
            volumes = {}
            for name, params in (("pv-deferred", {"crust.dev/defer": "true"}), ("pv-host", {})):
                vol = ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
                    name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE), volume_capabilities=[cap],
                    parameters=params), timeout=60).volume
                volumes[name] = PersistentVolume(name=name, volume_handle=vol.volume_id,
                                                 attributes=dict(vol.volume_context), fs_type="xfs")
        deferred, host = volumes["pv-deferred"], volumes["pv-host"]
        pod_d, pod_h = Pod(uid="uid-deferred", name="pod-d", fs_group=2000), Pod(uid="uid-host", name="pod-h")
        target_d = kubelet.start_pod(deferred, pod_d)
        entry = config.volumes_dir / hashlib.sha256(str(target_d).encode()).hexdigest() / "mountInfo.json"
        assert entry.exists(), "the previous release did not defer the volume"
        assert json.loads(entry.read_bytes())["crust-schema-version"] == 1
        run = old.sandbox("run", "--bundle", str(_bundle(root.path, target_d)), "--id", "pod-d", "--json")
        assert run.returncode == 0, run.stderr
        info = json.loads(run.stdout)[0]
        sandbox_pids += [int(info["pid"]), int(info["process_pid"])]
        process_log = config.state_dir / "handler" / "run" / "pod-d" / "process.log"
        _until(lambda: process_log.exists() and "payload-written" in process_log.read_text(), "the pod's write")
        target_h = kubelet.start_pod(host, pod_h)
        assert sysmount.at(str(target_h)).fs_type == "xfs", "the host volume is not mounted on the host"
        host_data = os.urandom(PAYLOAD)
        with open(target_h / "payload.bin", "wb") as f:
            f.write(host_data)
            os.fsync(f.fileno())
        before = {name: kubelet.volume_stats(volumes[name], pod) for name, pod in
                  (("pv-deferred", pod_d), ("pv-host", pod_h))}
        used_d = {u.unit: u for u in before["pv-deferred"].usage}[csi_pb2.VolumeUsage.BYTES]
        assert used_d.used >= PAYLOAD, "the sandbox's data is not in the deferred volume's stats"
        # No record of the previous release names a format: they are version 1.
        assert _first_key(config.state_dir / "proxy" / "volumes" / f"{entry.parent.name}.json")[0] != FORMAT_KEY

        # -- the rollout: SIGTERM to the previous crust node, this release starts on the same dirs ------
        assert old.stop() == 0
        assert all(_alive(pid) for pid in sandbox_pids), "the sandbox did not outlive crust node"
        timings["current crust node start over the previous release's state"] = new.start()
        kubelet.register()  # the plugin watcher sees the registration socket again
        after = {name: kubelet.retried(kubelet.volume_stats, volumes[name], pod) for name, pod in
                 (("pv-deferred", pod_d), ("pv-host", pod_h))}
        for name in volumes:
            assert not after[name].volume_condition.abnormal, after[name].volume_condition.message
            assert after[name].usage == before[name].usage, f"{name}: the stats changed across the upgrade"
        with local_channel(kubelet.endpoint) as channel:
            ctl = csi_pb2_grpc.ControllerStub(channel)
            for name, pod in (("pv-deferred", pod_d), ("pv-host", pod_h)):
                grown = ctl.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
                    volume_id=volumes[name].volume_handle, capacity_range=csi_pb2.CapacityRange(required_bytes=GROWN)),
                    timeout=60).capacity_bytes
                assert grown >= GROWN
                assert kubelet.expand(volumes[name], pod, GROWN) >= GROWN
        grown_total = {}
        for name, pod in (("pv-deferred", pod_d), ("pv-host", pod_h)):
            total = {u.unit: u for u in kubelet.volume_stats(volumes[name], pod).usage}[csi_pb2.VolumeUsage.BYTES].total
            before_total = {u.unit: u for u in before[name].usage}[csi_pb2.VolumeUsage.BYTES].total
            assert total > before_total + 200 * MIB, f"{name} did not grow: {before_total} -> {total}"
            grown_total[name] = total
        # What this release wrote names its format, first.
        record = config.state_dir / "driver" / "controller" / "volumes" / f"{deferred.volume_handle}.json"
        assert _first_key(record) == (FORMAT_KEY, 1)
        assert json.loads(entry.read_bytes())["crust-schema-version"] == SCHEMA_VERSION

        # -- the reverse: this release stopped, the previous one started on what it wrote ----------------
        # It works: every format this release writes is still version 1, which the previous release
        # reads (the format key is one it ignores). Once a format moves to 2, a release before format
        # versions cannot refuse it: the previous release named here must then be one that refuses.
        assert all(getattr(model, "FORMAT_VERSION", 1) == 1 for model in WRITTEN_FORMATS) and SCHEMA_VERSION == 1
        assert new.stop() == 0
        timings["previous crust node start over this release's state (rollback)"] = old.start()
        kubelet.register()
        back = kubelet.retried(kubelet.volume_stats, deferred, pod_d)
        assert not back.volume_condition.abnormal, back.volume_condition.message
        assert {u.unit: u for u in back.usage}[csi_pb2.VolumeUsage.BYTES].total == grown_total["pv-deferred"]
        with capsys.disabled():
            print("\nrollback from this release to the previous one "
                  f"({PREVIOUS_RELEASE[:12]}): works (every format written is still version 1)")
        assert old.stop() == 0

        # -- forward again, and the rest of the volumes' life under this release -----------------------
        timings["current crust node start (again)"] = new.start()
        kubelet.register()
        again = kubelet.retried(kubelet.volume_stats, deferred, pod_d)
        assert not again.volume_condition.abnormal, again.volume_condition.message
        assert {u.unit: u for u in again.usage}[csi_pb2.VolumeUsage.BYTES].total == grown_total["pv-deferred"]
        delete = new.sandbox("delete", "pod-d")
        assert delete.returncode == 0, delete.stderr
        _until(lambda: not any(_alive(pid) for pid in sandbox_pids), "the sandbox's processes to end", 10)
        kubelet.retried(kubelet.tear_down, deferred, pod_d)
        assert not entry.parent.exists(), "the watched directory still has the volume's entry"
        # The data the sandbox wrote before the upgrade, read on the host.
        reader = Pod(uid="uid-reader", name="reader")
        reader_target = kubelet.target_path(reader, deferred)
        reader_target.parent.mkdir(parents=True, mode=0o750)
        kubelet.node("NodePublishVolume", csi_pb2.NodePublishVolumeRequest(
            volume_id=deferred.volume_handle, staging_target_path=str(kubelet.staging_path(deferred)),
            target_path=str(reader_target), volume_capability=csi_pb2.VolumeCapability(
                mount=csi_pb2.VolumeCapability.MountVolume(fs_type="xfs"),
                access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1)),
            volume_context={k: v for k, v in deferred.attributes.items() if k != "crust.dev/defer"}))
        data = (reader_target / "payload.bin").read_bytes()
        assert len(data) == PAYLOAD
        assert hashlib.sha256(data).hexdigest() == (reader_target / "payload.sha256").read_text().strip()
        assert (target_h / "payload.bin").read_bytes() == host_data
        kubelet.retried(kubelet.tear_down, deferred, reader)
        kubelet.retried(kubelet.unmount_device, deferred)
        kubelet.stop_pod(host, pod_h)
        with local_channel(kubelet.endpoint) as channel:
            ctl = csi_pb2_grpc.ControllerStub(channel)
            for pv in (deferred, host):
                ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=pv.volume_handle), timeout=60)
            assert list(ctl.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30).entries) == []
        assert new.stop() == 0

        # -- nothing left: mounts, loop devices, processes, records, the registration socket -------------
        prefix = str(root.path) + "/"
        assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []
        assert loops_left(lambda b: b.startswith(prefix)) == {}
        assert not any(_alive(pid) for pid in sandbox_pids)
        for records in ("proxy/volumes", "shim/volumes", "handler/sandboxes", "driver/controller/volumes",
                        "driver/node/node-a/volumes"):
            assert list((config.state_dir / records).glob("*.json")) == [], f"{records} still has records"
        assert list((config.kubelet_root / "plugins_registry").iterdir()) == []
        with capsys.disabled():
            print("upgrade timings: " + "; ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
    finally:
        for node in (new, old):
            node.stop()
        _kill_our_sandboxes(config.state_dir)


def test_a_clone_without_the_previous_release_fails_in_ci_and_skips_elsewhere(monkeypatch):
    """A shallow clone lacks the previous release: CI must say so, not pass
    by skipping; elsewhere the test is skipped with the reason."""
    import tests.integration.test_upgrade as module

    monkeypatch.setattr(module, "PREVIOUS_RELEASE", "0" * 40)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="clone without --depth"):
        PreviousRelease()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="is not available"):
        PreviousRelease()
