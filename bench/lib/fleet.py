"""The proxies part 3 of bench/csi/proxy_bench.py measures: many deferred
volumes, with the fake plugin behind every proxy.

- Fleet and start_fleets(): proxies in front of the fake plugin, each to
  hold its number of deferred volumes;
- fill_up(), churn_rounds() and drain_all(): publishes and unpublishes on
  them, every call timed;
- rss_mib() and cpu_ms() of a proxy process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from bench.lib.benchlib import TICK, proc_ticks, rotated
from bench.lib.fakes import ServerProcess
from bench.lib.stack import own_session
from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc
from tests.harness.daemons import ProxyProcess, Root, mount_cap


@dataclass
class PluginStandIn:
    """What ProxyProcess needs of its plugin: the plugin's socket and the
    path of the proxy's runtime socket."""

    socket: Path
    proxy_socket: Path


def cpu_ms(pid: int) -> float:
    """CPU time (user + system) a process used so far, in ms."""
    return proc_ticks(pid) * 1e3 / TICK


def rss_mib(pid: int) -> float:
    """A process's resident memory (VmRSS), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Fleet:
    """One proxy (in front of the fake plugin) that is to hold `count` deferred volumes."""

    def __init__(self, proxy: ProxyProcess, count: int):
        self.proxy = proxy
        self.count = count
        self.published: list[tuple[str, Path]] = []  # (volume id, target), in publish order
        self.cap = mount_cap("ext4")

    @property
    def pid(self) -> int:
        return self.proxy.proc.pid

    def target(self, kind: str, i: int) -> Path:
        return self.proxy.target(f"pod-{kind}-{i:05d}", f"pvc-{kind}-{i:05d}")

    def make_targets(self, kind: str, n: int) -> None:
        for i in range(n):
            self.target(kind, i).mkdir(parents=True, exist_ok=True)

    def publish(self, volume_id: str, target: Path) -> float:
        request = csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=str(self.proxy.staging(volume_id)), target_path=str(target),
            volume_capability=self.cap, defer_fs_ops=True,
            volume_context={"storage.kubernetes.io/csiProvisionerIdentity": "1700000000000-1234-fake.bench",
                            "fsOptions": "noatime"})
        started = time.perf_counter()
        response = self.proxy.node.NodePublishVolume(request, timeout=30)
        ms = (time.perf_counter() - started) * 1e3
        if response.deferred_mount.device != "/dev/fake":
            raise RuntimeError(f"publish of {target} through the proxy answered {response}")
        self.published.append((volume_id, target))
        return ms

    def unpublish(self, volume_id: str, target: Path) -> float:
        # No defer_fs_ops, as today's kubelet sends it: the proxy finds its decision on disk.
        request = csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=str(target))
        started = time.perf_counter()
        self.proxy.node.NodeUnpublishVolume(request, timeout=30)
        ms = (time.perf_counter() - started) * 1e3
        self.published.remove((volume_id, target))
        return ms

    def listed(self) -> int:
        with self.proxy.runtime_channel() as channel:
            return len(registry_pb2_grpc.RegistryStub(channel).ListVolumes(registry_pb2.ListVolumesRequest(),
                                                                           timeout=30).volumes)

    def on_disk(self) -> dict:
        state = self.proxy.state_dir
        return {"volumes_dir_entries": len(os.listdir(self.proxy.volumes_dir)),
                "kata_dir_entries": len(os.listdir(self.proxy.kata_dir)),
                "volume_records": len(list((state / "volumes").glob("*.json"))),
                "decision_records": len(list((state / "decisions").glob("*.json")))}


def start_fleets(root: Root, scales: list[int], churn: int, warmup: int) -> list[Fleet]:
    """The fake plugin and one proxy per count in front of it, their target
    directories made and written back, warm-up publishes done: 0 volumes held."""
    plugin = ServerProcess("plugin", root.path / "fake-plugin.sock")
    root.drivers.append(plugin)  # stopped by Root.close(), after the proxies
    plugin.start()
    fleets: list[Fleet] = []
    with own_session():
        for n in scales:
            base = root.path / f"p{n}"
            base.mkdir(mode=0o700)  # the runtime socket's directory must be 0700
            proxy = ProxyProcess(root=base, plugin=PluginStandIn(socket=plugin.socket,
                                                                 proxy_socket=base / "proxy.sock"))
            root.drivers.append(proxy)  # stopped by Root.close()
            fleets.append(Fleet(proxy.start(), n))
    for f in fleets:
        f.make_targets("warm", 1)
        f.make_targets("v", f.count)
        f.make_targets("churn", churn)
    # Write back the directories just made: the first fsyncs of the proxy
    # would otherwise commit them all in their journal transaction.
    os.sync()
    # Warm-up: the same publish/unpublish on every proxy, so imports, channels
    # and first-use costs are paid before anything is timed; 0 volumes stay.
    for i in range(warmup):
        for f in fleets:
            f.publish(f"warm-{i}", f.target("warm", 0))
            f.unpublish(f"warm-{i}", f.target("warm", 0))
    return fleets


def fill_up(fleets: list[Fleet]) -> tuple[dict[int, list[float]], float]:
    """Every proxy filled to its count, each publish timed (ms by count);
    and the seconds the whole fill took."""
    started = time.monotonic()
    fill = {f.count: [f.publish(f"vol-{f.count}-{i:05d}", f.target("v", i)) for i in range(f.count)]
            for f in fleets}
    seconds = time.monotonic() - started
    for f in fleets:
        listed = f.listed()
        if listed != f.count:
            raise RuntimeError(f"the proxy filled to {f.count} lists {listed} deferred volumes")
    return fill, seconds


def churn_rounds(fleets: list[Fleet], rounds: int) -> tuple[dict, dict, dict]:
    """One publish then one unpublish of an extra volume on every proxy per
    round, the order of the proxies rotating: ms of each publish and each
    unpublish by count, and each proxy's own CPU per round in ms (what it
    computes, as opposed to the time it waits: fsync, the plugin, scheduling)."""
    publish = {f.count: [] for f in fleets}
    unpublish = {f.count: [] for f in fleets}
    cpu_before = {f.count: cpu_ms(f.pid) for f in fleets}
    for r in range(rounds):
        order = rotated(fleets, r)
        for f in order:
            publish[f.count].append(f.publish(f"churn-{f.count}-{r:05d}", f.target("churn", r)))
        for f in order:
            unpublish[f.count].append(f.unpublish(f"churn-{f.count}-{r:05d}", f.target("churn", r)))
    cpu = {f.count: (cpu_ms(f.pid) - cpu_before[f.count]) / rounds for f in fleets}
    return publish, unpublish, cpu


def drain_all(fleets: list[Fleet]) -> tuple[dict[int, list[float]], float]:
    """Everything unpublished again, newest first as pods go, each timed (ms
    by count); and the seconds that took. Nothing may stay on disk."""
    started = time.monotonic()
    drain = {f.count: [f.unpublish(vid, target) for vid, target in list(reversed(f.published))] for f in fleets}
    seconds = time.monotonic() - started
    for f in fleets:
        left = f.on_disk()
        if any(left.values()):
            raise RuntimeError(f"after unpublishing everything the proxy left {left}")
    return drain, seconds
