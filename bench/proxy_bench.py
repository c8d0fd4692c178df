#!/usr/bin/env python3
"""What `crust proxy` costs, measured side by side in one run.

Parts 1 and 2 use the REAL stack: `crust driver` -> `crust shim` -> `crust
proxy` (tests/harness.py Root.stack(), unix sockets in a temporary root).
Part 3 uses a FAKE CSI plugin behind the proxy (a small gRPC server that
this script runs in its own process: Identity.GetPluginInfo,
Node.NodeGetCapabilities advertising STAGE_UNSTAGE_VOLUME and DEFER_FS_OPS
7/8/9, NodePublishVolume answering a DeferredMount of /dev/fake,
NodeUnpublishVolume answering OK), so that it measures the proxy's own cost
and not mkfs, loop devices or the shim.

1. Added latency per CSI call: the same RPC sent to the shim directly and
   through the proxy, interleaved (the order alternates every round):
   GetPluginInfo, Probe, ControllerGetCapabilities, ListVolumes, NodeGetInfo,
   NodeGetCapabilities (byte-level passthrough in the proxy), and
   NodeGetVolumeStats of a host-published (not deferred) ext4 volume, which
   the proxy intercepts, checks against its recorded decisions and forwards.
   Median, p90 and the added median. Target: added median under 1 ms.
2. Stats of a deferred volume: RuntimeGetVolumeStats on the proxy's runtime
   socket for (a) a volume claimed by a registered handler (a minimal
   crust.handler.v1.Handler server run by this script, answering fixed
   numbers over its unix socket) and (b) an unclaimed volume whose entry
   directory holds a `runtime-cli` file naming a `#!/bin/sh` printf script
   that prints the same numbers as JSON (the proxy runs it as
   `<cli> crust stats <target>`). Both entries are made with
   RuntimeStageVolume on the runtime socket. Interleaved; medians and the
   ratio. Target: the handler socket at least 10x faster. For scale only,
   (c) the same JSON from a `python -S` script (an interpreter's start-up)
   is measured alongside. The handler runs in its own process, not in
   threads of this script, so it does not share the timing client's GIL.
3. Many deferred volumes (FAKE plugin, see above): one proxy per count in
   --volumes (default 10 and 1000), each filled to its count by deferred
   NodePublishVolume calls (defer_fs_ops=True) on its kubelet-facing CSI
   socket: the proxy records its decision, forwards, stages the entry
   (mountInfo.json, the Kata mirror, its record) and answers. Reported:
   - the fill of the largest proxy, timed per call: at each count N, the
     --batch publishes that brought it to N (at 10: the first 10, at 1000:
     the 991st to the 1000th); and its drain at the end (everything
     unpublished, newest first): the --batch unpublishes starting at N
     (at 1000: the first 10, at 10: the last 10);
   - "churn", interleaved across the proxies: one publish then one
     unpublish of an extra volume on each proxy per round, so the proxies
     holding 10 and 1000 volumes are measured in the same seconds;
   - the CPU time each proxy process used per churn round (what it
     computes, as opposed to what it waits for: fsync, the plugin);
   - the proxy's RSS (VmRSS of /proc/<pid>/status) with the volumes present.
   Every time includes the fake plugin's answer (the same at every count).
   NodeUnpublishVolume is sent without defer_fs_ops, as an unmodified
   kubelet sends it: the proxy finds the deferral in its recorded decision.
   Target directories are made (and written back with sync) before any
   proxy call is timed. Targets: cost at 1000 within 1.5x of the cost at
   10; RSS under 100 MB.

Each part also reports how many cores other processes on the machine kept
busy meanwhile (from /proc/stat, less this script and its daemons), to judge
a run on a shared machine.

Everything lives under one temporary root. On exit, also on Ctrl-C, SIGTERM
or failure, the real volume is unpublished, unstaged and deleted through the
proxy and driver, every process this script started is stopped, any mount
below the root is unmounted and any loop device over a file below it is
detached, and the root is removed. The daemons run in their own session (a
Ctrl-C at the terminal reaches this script only, which then tears down in
order) and get SIGTERM if this script dies.

Run from the project root as root (the real stack makes loop devices and
mounts):

    .venv/bin/python bench/proxy_bench.py [--rounds 300] [--volumes 10,1000] [--churn 200] [--json OUT]

A full run with the defaults takes about half a minute on 2 cores; the JSON
(written only when the run completed) holds every summary and the per-call
samples of the fill and the drain.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project root: bench, crust, tests

import grpc  # noqa: E402

from bench.benchlib import (  # noqa: E402
    PROJECT,
    TICK,
    Interrupted,
    add_parts_option,
    cores,
    die_with_parent,
    file_text,
    ignore_signals,
    machine,
    machine_ticks,
    own_session,
    own_ticks,
    print_log_tails,
    proc_ticks,
    project_on_pythonpath,
    quantiles,
    raise_on_signals,
    report_leftovers,
    retry_failed_precondition,
    run_header,
    stop_process,
    timed,
    write_json,
)
from crust.api import (  # noqa: E402
    csi_pb2,
    csi_pb2_grpc,
    handler_pb2,
    handler_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    runtime_pb2,
    runtime_pb2_grpc,
)
from crust.proxy.mountinfo import digest  # noqa: E402
from crust.sys import loop as sysloop  # noqa: E402
from tests.harness import GIB, MIB, ProxyProcess, Root, mount_cap  # noqa: E402

NodeRPC = csi_pb2.NodeServiceCapability.RPC
Usage = csi_pb2.VolumeUsage

# The fixed numbers every stats path of part 2 answers.
STATS_TOTAL, STATS_USED = 10 * GIB, 3 * GIB
INODES_TOTAL, INODES_USED = 655360, 1234
STATS_MESSAGE = "fixed numbers from the benchmark"


def fixed_stats() -> runtime_pb2.RuntimeGetVolumeStatsResponse:
    return runtime_pb2.RuntimeGetVolumeStatsResponse(
        usage=[Usage(unit=Usage.BYTES, total=STATS_TOTAL, used=STATS_USED, available=STATS_TOTAL - STATS_USED),
               Usage(unit=Usage.INODES, total=INODES_TOTAL, used=INODES_USED,
                     available=INODES_TOTAL - INODES_USED)],
        volume_condition=csi_pb2.VolumeCondition(abnormal=False, message=STATS_MESSAGE))


def stats_json() -> str:
    return json.dumps({
        "usage": [{"unit": "BYTES", "total": STATS_TOTAL, "used": STATS_USED,
                   "available": STATS_TOTAL - STATS_USED},
                  {"unit": "INODES", "total": INODES_TOTAL, "used": INODES_USED,
                   "available": INODES_TOTAL - INODES_USED}],
        "volume_condition": {"abnormal": False, "message": STATS_MESSAGE},
    })


def runtime_cli_sh() -> str:
    """The fixed numbers as JSON from a shell printf (the runtime-cli of part 2 (b))."""
    return "#!/bin/sh\n# Called as: <this> crust stats <target>\nprintf '%s\\n' '" + stats_json() + "'\n"


def runtime_cli_python() -> str:
    """The same from a Python script without site (part 2 (c), for scale only)."""
    return f"#!{sys.executable} -S\n# Called as: <this> crust stats <target>\nprint({stats_json()!r})\n"


# -- the servers this script runs in their own processes (--serve) ----------------------


class FakePlugin(csi_pb2_grpc.IdentityServicer, csi_pb2_grpc.NodeServicer):
    """A CSI plugin that defers everything and does nothing: only the proxy's cost is left."""

    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name="fake.bench.crust.dev", vendor_version="0")

    def Probe(self, request, context):
        return csi_pb2.ProbeResponse()

    def GetPluginCapabilities(self, request, context):
        return csi_pb2.GetPluginCapabilitiesResponse()

    def NodeGetCapabilities(self, request, context):
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=NodeRPC(type=t))
            for t in (NodeRPC.STAGE_UNSTAGE_VOLUME, NodeRPC.DEFER_FS_OPS,
                      NodeRPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP,
                      NodeRPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY)])

    def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(node_id="bench-node")

    def NodePublishVolume(self, request, context):
        if not request.defer_fs_ops:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the fake plugin only defers")
        mount = request.volume_capability.mount
        return csi_pb2.NodePublishVolumeResponse(deferred_mount=csi_pb2.DeferredMount(
            volume_type="block", device="/dev/fake", fs_type="ext4", mount_options=["noatime"],
            readonly=request.readonly, volume_supplemental_group=mount.volume_supplemental_group,
            volume_supplemental_group_change_policy=mount.volume_supplemental_group_change_policy,
            volume_id=request.volume_id, capacity_bytes=GIB, device_major=7, device_minor=0,
            volume_context=dict(request.volume_context)))

    def NodeUnpublishVolume(self, request, context):
        return csi_pb2.NodeUnpublishVolumeResponse()


class FixedHandler(handler_pb2_grpc.HandlerServicer):
    """A runtime handler whose sandbox always reports the same usage."""

    def GetVolumeStats(self, request, context):
        fixed = fixed_stats()
        return handler_pb2.GetVolumeStatsResponse(usage=fixed.usage, volume_condition=fixed.volume_condition)

    def ExpandVolume(self, request, context):
        return handler_pb2.ExpandVolumeResponse(capacity_bytes=request.capacity_range.required_bytes)

    def GetSandbox(self, request, context):
        return handler_pb2.GetSandboxResponse(state=handler_pb2.GetSandboxResponse.RUNNING)


def serve(kind: str, socket: str) -> int:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if kind == "plugin":
        plugin = FakePlugin()
        csi_pb2_grpc.add_IdentityServicer_to_server(plugin, server)
        csi_pb2_grpc.add_NodeServicer_to_server(plugin, server)
    else:
        handler_pb2_grpc.add_HandlerServicer_to_server(FixedHandler(), server)
    old = os.umask(0o077)
    try:
        server.add_insecure_port(f"unix://{socket}")
    finally:
        os.umask(old)
    server.start()
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not stop:
        time.sleep(0.2)
    server.stop(0).wait()
    try:
        os.unlink(socket)
    except FileNotFoundError:
        pass
    return 0


# -- processes ----------------------------------------------------------------------------


class ServerProcess:
    """This script run with --serve KIND: the fake plugin or the test handler."""

    def __init__(self, kind: str, socket: Path):
        self.kind = kind
        self.socket = socket
        self.log_path = socket.with_suffix(".log")
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 15.0) -> ServerProcess:
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve", self.kind, "--socket", str(self.socket)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log, cwd=PROJECT,
                                         start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            if self.socket.exists():
                with grpc.insecure_channel(f"unix://{self.socket}") as channel:
                    try:
                        if self.kind == "plugin":
                            csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=2)
                        else:
                            handler_pb2_grpc.HandlerStub(channel).GetSandbox(handler_pb2.GetSandboxRequest(),
                                                                            timeout=2)
                        return self
                    except grpc.RpcError:
                        pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.kind} server not ready")

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self.proc = None


@dataclass
class PluginStandIn:
    """What ProxyProcess needs of its plugin: the plugin's socket and the
    path of the proxy's runtime socket."""

    socket: Path
    proxy_socket: Path


def cpu_ms(pid: int) -> float:
    """CPU time (user + system) a process used so far, in ms."""
    st = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(st[11]) + int(st[12])) * 1e3 / TICK


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_sample(pids: list[int]) -> dict:
    """Clock ticks: the whole machine busy, and this script with the given processes."""
    busy = machine_ticks()[0]
    mine = own_ticks() + sum(proc_ticks(pid, with_children=True) for pid in pids)
    return {"t": time.monotonic(), "busy": busy, "mine": mine}


def others_cores(a: dict, b: dict) -> float:
    """Cores the rest of the machine (other people's work) kept busy between two samples."""
    return cores(max(0, (b["busy"] - a["busy"]) - (b["mine"] - a["mine"])), b["t"] - a["t"])


# -- statistics -----------------------------------------------------------------------------


def summary(samples: list[float]) -> dict:
    p50, p90 = quantiles(samples)
    return {"n": len(samples), "p50_ms": round(p50, 4), "p90_ms": round(p90, 4),
            "min_ms": round(min(samples), 4), "max_ms": round(max(samples), 4)}


# -- part 1: added latency per CSI call --------------------------------------------------


def part1(driver, shim, proxy: ProxyProcess, rounds: int, live: dict) -> dict:
    cap = mount_cap("ext4")
    vol = driver.create("bench-proxy-stats", 64 * MIB, cap)
    live["volume_id"] = vol.volume_id
    staging = proxy.staging("pv-stats")
    target = proxy.target("pod-stats", "pv-stats")
    target.parent.mkdir(parents=True, exist_ok=True)  # kubelet makes the parent, the plugin the target
    # Staged and published (on the host, no deferral) through the proxy, as kubelet would.
    proxy.stage(vol.volume_id, staging, cap)
    live["staging"] = staging
    proxy.publish(vol.volume_id, staging, target, cap)
    live["target"] = target
    stats_req = csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=str(target))

    probes = {
        "GetPluginInfo": lambda p: p.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=30),
        "Probe": lambda p: p.identity.Probe(csi_pb2.ProbeRequest(), timeout=30),
        "ControllerGetCapabilities": lambda p: p.controller.ControllerGetCapabilities(
            csi_pb2.ControllerGetCapabilitiesRequest(), timeout=30),
        "ListVolumes": lambda p: p.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30),
        "NodeGetInfo": lambda p: p.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=30),
        "NodeGetCapabilities": lambda p: p.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(),
                                                                    timeout=30),
        "NodeGetVolumeStats (host)": lambda p: p.node.NodeGetVolumeStats(stats_req, timeout=30),
    }
    # The same answer both ways (the stats of the real mounted ext4 file system).
    direct, through = probes["NodeGetVolumeStats (host)"](shim), probes["NodeGetVolumeStats (host)"](proxy)
    if not direct.usage or direct.usage[0].total != through.usage[0].total:
        raise RuntimeError(f"NodeGetVolumeStats differs: direct {direct} / through the proxy {through}")
    os.sync()  # what setting up the volume dirtied is not written back during the measurement
    # Warm both channels and code paths so connection set-up is not measured.
    for call in probes.values():
        for _ in range(20):
            call(shim)
            call(proxy)

    out = {}
    print(f"\n[1] Added latency per CSI call: shim directly vs through the proxy "
          f"({rounds} calls each, interleaved, order alternating)", flush=True)
    print(f"  {'RPC':<27}{'direct p50':>11}{'proxy p50':>11}{'added p50':>11}{'direct p90':>12}{'proxy p90':>11}"
          "   (ms)")
    for name, call in probes.items():
        d, p = [], []
        for i in range(rounds):
            if i % 2:
                p.append(timed(lambda c=call: c(proxy)))
                d.append(timed(lambda c=call: c(shim)))
            else:
                d.append(timed(lambda c=call: c(shim)))
                p.append(timed(lambda c=call: c(proxy)))
        d50, d90 = quantiles(d)
        p50, p90 = quantiles(p)
        out[name] = {"direct_p50_ms": d50, "direct_p90_ms": d90, "proxy_p50_ms": p50, "proxy_p90_ms": p90,
                     "added_p50_ms": p50 - d50}
        print(f"  {name:<27}{d50:>11.3f}{p50:>11.3f}{p50 - d50:>11.3f}{d90:>12.3f}{p90:>11.3f}", flush=True)
    return {"rpcs": out, "rounds": rounds}


def holders(data_dir: Path) -> str:
    """Who keeps the loop devices over files below data_dir (for a failed DeleteVolume)."""
    prefix = str(data_dir.resolve()) + "/"
    out = []
    for device, backing in sysloop.attached().items():
        if not backing.startswith(prefix):
            continue
        name = device.removeprefix("/dev/")
        autoclear = file_text(f"/sys/block/{name}/loop/autoclear")
        try:
            rdev = os.stat(device).st_rdev
            numbers = f" {os.major(rdev)}:{os.minor(rdev)} "
        except OSError:
            numbers = None
        users, namespaces = [], set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                for fd in (proc / "fd").iterdir():
                    if os.readlink(fd) == device:
                        users.append(f"{proc.name}:{file_text(f'/proc/{proc.name}/comm')}")
                        break
                # A mount of it in any mount namespace (a sandbox made with
                # unshare -m while it was mounted here keeps a copy).
                if numbers and numbers in (proc / "mountinfo").read_text():
                    namespaces.add(f"{os.readlink(proc / 'ns' / 'mnt')} (pid {proc.name} "
                                   f"{file_text(f'/proc/{proc.name}/comm')})")
            except OSError:
                continue
        out.append(f"{device} autoclear={autoclear}, open by {users or 'nobody'}, mounted in "
                   f"{sorted(namespaces)[:5] or 'no mount namespace'}")
    return "; ".join(out) or "no loop device attached any more"


def teardown_part1(driver, proxy: ProxyProcess, live: dict, timeout: float = 30) -> list[str]:
    """Unpublish, unstage, delete the real volume (whatever of it exists); errors are returned."""
    problems = []
    vid = live.get("volume_id")
    if not vid:
        return problems
    steps = []
    if "target" in live:
        steps.append(("unpublish", lambda: proxy.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=vid, target_path=str(live["target"])), timeout=timeout)))
    if "staging" in live:
        steps.append(("unstage", lambda: proxy.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
            volume_id=vid, staging_target_path=str(live["staging"])), timeout=timeout)))

    def delete() -> None:
        try:
            retry_failed_precondition(lambda: driver.controller.DeleteVolume(
                csi_pb2.DeleteVolumeRequest(volume_id=vid), timeout=timeout), patience=20)
        except grpc.RpcError as exc:
            raise RuntimeError(f"{exc.details()} ({holders(driver.data_dir)})") from None

    steps.append(("delete", delete))
    for name, step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - the forced cleanup follows
            problems.append(f"{name} {vid}: {exc!r}")
    live.clear()
    return problems


# -- part 2: stats through the handler socket vs the runtime-cli ----------------------------


def part2(root: Path, proxy: ProxyProcess, handler: ServerProcess, rounds: int) -> dict:
    channel = proxy.runtime_channel()
    try:
        runtime = runtime_pb2_grpc.RuntimeStub(channel)
        registry = registry_pb2_grpc.RegistryStub(channel)
        name = "bench"
        lease = registry.RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name=name, endpoint=f"unix://{handler.socket}", filesystems=["ext4"], features=["stats"]), timeout=10)
        # (label, target, runtime-cli script or None for the claimed one)
        paths = [("handler", proxy.target("pod-handler", "pv-handler"), None),
                 ("runtime-cli sh", proxy.target("pod-cli", "pv-cli"), runtime_cli_sh()),
                 ("runtime-cli python", proxy.target("pod-cli-py", "pv-cli-py"), runtime_cli_python())]
        Req = runtime_pb2.RuntimeStageVolumeRequest
        for _label, target, script in paths:
            target.mkdir(parents=True, exist_ok=True)  # an existing target: the sweep keeps the entry
            runtime.RuntimeStageVolume(Req(volume_type=Req.BLOCK, volume_target_path=str(target),
                                           volume_backing_path=f"/dev/bench-{target.parent.name}", fs_type="ext4",
                                           volume_id=target.parent.name, capacity_bytes=STATS_TOTAL), timeout=10)
            if script is None:
                registry.ClaimVolume(registry_pb2.ClaimVolumeRequest(target_path=str(target), handler=name,
                                                                     sandbox_id="bench-sandbox"), timeout=10)
            else:
                cli = root / f"runtime-cli-{target.parent.name}"
                cli.write_text(script)
                cli.chmod(0o755)
                # What a KEP-style runtime leaves in the entry directory.
                (proxy.volumes_dir / digest(str(target)) / "runtime-cli").write_text(f"{cli}\n")

        def stats(target: Path):
            return runtime.RuntimeGetVolumeStats(runtime_pb2.RuntimeGetVolumeStatsRequest(
                volume_target_path=str(target)), timeout=30)

        expected = fixed_stats()
        for label, target, _ in paths:
            got = stats(target)
            if got != expected:
                raise RuntimeError(f"RuntimeGetVolumeStats via the {label} answered {got}, expected {expected}")
        for _ in range(20):  # warm-up
            for _, target, _ in paths:
                stats(target)

        samples: dict[str, list[float]] = {label: [] for label, _, _ in paths}
        last_beat = time.monotonic()
        for i in range(rounds):
            if time.monotonic() - last_beat > 3:  # keep the lease fresh (untimed)
                registry.Heartbeat(registry_pb2.HeartbeatRequest(name=name, lease_id=lease.lease_id), timeout=10)
                last_beat = time.monotonic()
            k = i % len(paths)
            for label, target, _ in paths[k:] + paths[:k]:  # order rotating every round
                samples[label].append(timed(lambda t=target: stats(t)))
        (s50, s90), (c50, c90), (p50, p90) = (quantiles(samples[label]) for label, _, _ in paths)
        print(f"\n[2] Stats of a deferred volume: RuntimeGetVolumeStats on the proxy's runtime socket "
              f"({rounds} each, interleaved, order rotating)", flush=True)
        print(f"  (a) claimed by a registered handler (gRPC on its socket)  p50 {s50:8.3f} ms   p90 {s90:8.3f} ms")
        print(f"  (b) unclaimed, runtime-cli: /bin/sh printf script         p50 {c50:8.3f} ms   p90 {c90:8.3f} ms")
        print(f"  (b) / (a)                                                 {c50 / s50:8.1f}x")
        print(f"  for scale only: (c) runtime-cli as a `python -S` script   p50 {p50:8.3f} ms   p90 {p90:8.3f} ms"
              f"   (c) / (a) {p50 / s50:.1f}x", flush=True)

        for _label, target, script in paths:
            if script is None:
                registry.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(target_path=str(target), handler=name,
                                                                         sandbox_id="bench-sandbox"), timeout=10)
            runtime.RuntimeUnstageVolume(runtime_pb2.RuntimeUnstageVolumeRequest(
                volume_target_path=str(target)), timeout=10)
        registry.UnregisterHandler(registry_pb2.UnregisterHandlerRequest(name=name, lease_id=lease.lease_id),
                                   timeout=10)
        return {"handler_socket": summary(samples["handler"]), "runtime_cli": summary(samples["runtime-cli sh"]),
                "cli_over_socket": c50 / s50,
                "for_scale_runtime_cli_python_S": summary(samples["runtime-cli python"]),
                "python_cli_over_socket": p50 / s50}
    finally:
        channel.close()


# -- part 3: many deferred volumes (fake plugin) -------------------------------------------


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


def part3(root: Root, scales: list[int], batch: int, churn: int, warmup: int) -> dict:
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
    rss_empty = {f.count: rss_mib(f.pid) for f in fleets}

    # Fill, timed per call; the largest proxy's fill gives the ramp.
    fill: dict[int, list[float]] = {}
    print(f"\n[3] Deferred volumes, FAKE plugin behind `crust proxy` (the proxy's own cost): filling "
          f"{' and '.join(str(n) for n in scales)} volumes", flush=True)
    t0 = time.monotonic()
    for f in fleets:
        fill[f.count] = [f.publish(f"vol-{f.count}-{i:05d}", f.target("v", i)) for i in range(f.count)]
    fill_seconds = time.monotonic() - t0
    for f in fleets:
        listed = f.listed()
        if listed != f.count:
            raise RuntimeError(f"the proxy filled to {f.count} lists {listed} deferred volumes")
    largest = fleets[-1]
    on_disk = largest.on_disk()

    # Churn, interleaved across the proxies (order rotating every round).
    churn_pub = {f.count: [] for f in fleets}
    churn_unpub = {f.count: [] for f in fleets}
    cpu_before = {f.count: cpu_ms(f.pid) for f in fleets}
    for r in range(churn):
        order = fleets[r % len(fleets):] + fleets[:r % len(fleets)]
        for f in order:
            churn_pub[f.count].append(f.publish(f"churn-{f.count}-{r:05d}", f.target("churn", r)))
        for f in order:
            churn_unpub[f.count].append(f.unpublish(f"churn-{f.count}-{r:05d}", f.target("churn", r)))
    # The proxy's own CPU per round (publish + unpublish): what it computes,
    # as opposed to the time it waits (fsync, the plugin, scheduling).
    churn_cpu = {f.count: (cpu_ms(f.pid) - cpu_before[f.count]) / churn for f in fleets}
    rss_full = {f.count: rss_mib(f.pid) for f in fleets}

    # Everything unpublished again, timed per call (newest first, as pods go).
    drain: dict[int, list[float]] = {}
    t0 = time.monotonic()
    for f in fleets:
        drain[f.count] = [f.unpublish(vid, target) for vid, target in list(reversed(f.published))]
    drain_seconds = time.monotonic() - t0
    for f in fleets:
        left = f.on_disk()
        if any(left.values()):
            raise RuntimeError(f"after unpublishing everything the proxy left {left}")

    # Ramp of the largest proxy at each count: the `batch` publishes that
    # brought it to N (N-batch..N-1 existing), the `batch` unpublishes from N.
    big = largest.count
    ramp_pub = {n: fill[big][n - batch:n] for n in scales}
    ramp_unpub = {n: drain[big][big - n:big - n + batch] for n in scales}

    lo, hi = scales[0], scales[-1]
    print(f"  fill {sum(scales)} publishes in {fill_seconds:.1f}s, drain in {drain_seconds:.1f}s; at {big} volumes: "
          + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in on_disk.items()))
    print(f"\n  {'per call (ms)':<46}" + "".join(f"{f'at {n}':>18}" for n in scales) + f"{f'{hi}/{lo}':>9}")

    def row(label: str, by_n: dict[int, list[float]]) -> None:
        cells = ""
        for n in scales:
            p50, p90 = quantiles(by_n[n])
            cells += f"{p50:>9.3f} p90 {p90:>5.2f}" if p90 < 100 else f"{p50:>9.3f} p90 {p90:>5.0f}"
        ratio = quantiles(by_n[hi])[0] / quantiles(by_n[lo])[0]
        print(f"  {label:<46}{cells}{ratio:>8.2f}x", flush=True)

    row(f"NodePublishVolume, fill of {big} ({batch} calls)", ramp_pub)
    row(f"NodeUnpublishVolume, drain of {big} ({batch} calls)", ramp_unpub)
    row(f"NodePublishVolume, churn ({churn}, interleaved)", churn_pub)
    row(f"NodeUnpublishVolume, churn ({churn}, interleaved)", churn_unpub)
    print(f"  {'proxy CPU per churn publish+unpublish, ms':<46}" + "".join(f"{churn_cpu[n]:>18.3f}" for n in scales)
          + f"{churn_cpu[hi] / churn_cpu[lo]:>8.2f}x")
    print(f"  {'proxy RSS, MiB, empty after warm-up':<46}" + "".join(f"{rss_empty[n]:>18.1f}" for n in scales))
    print(f"  {'proxy RSS, MiB, with the volumes present':<46}" + "".join(f"{rss_full[n]:>18.1f}" for n in scales)
          + f"   (+{(rss_full[hi] - rss_empty[hi]) * 1024 / max(1, hi):.1f} KiB per volume at {hi})", flush=True)

    def ratio(by_n):
        return quantiles(by_n[hi])[0] / quantiles(by_n[lo])[0]

    return {
        "plugin": "fake (this script, --serve plugin): the proxy's own cost, no mkfs, loop device or shim",
        "scales": scales, "batch": batch, "churn_rounds": churn, "warmup_cycles": warmup,
        "fill_seconds": round(fill_seconds, 2), "drain_seconds": round(drain_seconds, 2),
        "on_disk_at_largest": on_disk,
        "ramp_publish": {str(n): summary(ramp_pub[n]) for n in scales},
        "ramp_unpublish": {str(n): summary(ramp_unpub[n]) for n in scales},
        "churn_publish": {str(n): summary(churn_pub[n]) for n in scales},
        "churn_unpublish": {str(n): summary(churn_unpub[n]) for n in scales},
        "ratios_largest_over_smallest": {"ramp_publish": ratio(ramp_pub), "ramp_unpublish": ratio(ramp_unpub),
                                         "churn_publish": ratio(churn_pub), "churn_unpublish": ratio(churn_unpub)},
        "churn_proxy_cpu_ms_per_round": {str(n): round(v, 3) for n, v in churn_cpu.items()},
        "rss_mib_empty": {str(n): round(v, 1) for n, v in rss_empty.items()},
        "rss_mib_full": {str(n): round(v, 1) for n, v in rss_full.items()},
        "fill_samples_ms": [round(x, 3) for x in fill[big]],
        "drain_samples_ms": [round(x, 3) for x in drain[big]],
    }


# -- output ----------------------------------------------------------------------------------


def verdicts(results: dict) -> list[tuple[str, bool, str]]:
    out = []
    if "part1" in results:
        worst = max(results["part1"]["rpcs"].items(), key=lambda kv: kv[1]["added_p50_ms"])
        out.append(("[1] proxy adds < 1 ms (median) to every CSI call", worst[1]["added_p50_ms"] < 1.0,
                    f"largest added median {worst[1]['added_p50_ms']:.3f} ms ({worst[0]})"))
    if "part2" in results:
        r = results["part2"]["cli_over_socket"]
        out.append(("[2] handler socket >= 10x faster than runtime-cli", r >= 10, f"{r:.1f}x"))
    if "part3" in results:
        p3 = results["part3"]
        hi, lo = p3["scales"][-1], p3["scales"][0]
        batch = p3["batch"]
        for key, label in (("ramp_publish", f"publish (fill, {batch} calls each, not interleaved)"),
                           ("ramp_unpublish", f"unpublish (drain, {batch} calls each, not interleaved)"),
                           ("churn_publish", f"publish (churn, {p3['churn_rounds']} interleaved)"),
                           ("churn_unpublish", f"unpublish (churn, {p3['churn_rounds']} interleaved)")):
            r = p3["ratios_largest_over_smallest"][key]
            out.append((f"[3] {label} at {hi} within 1.5x of at {lo}", r <= 1.5, f"{r:.2f}x"))
        rss = p3["rss_mib_full"][str(hi)]
        out.append((f"[3] proxy RSS with {hi} deferred volumes < 100 MB", rss * 1.048576 < 100,
                    f"{rss:.1f} MiB = {rss * 1.048576:.1f} MB"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="proxy_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=300, metavar="N",
                   help="calls per RPC and path in parts 1 and 2 (default 300)")
    p.add_argument("--volumes", default="10,1000", metavar="N,M,...",
                   help="deferred volume counts of part 3, one proxy each (default 10,1000)")
    p.add_argument("--batch", type=int, default=10, metavar="N",
                   help="calls per count taken from the fill/drain of the largest count (default 10)")
    p.add_argument("--churn", type=int, default=200, metavar="N",
                   help="interleaved publish+unpublish rounds on every proxy of part 3 (default 200)")
    p.add_argument("--warmup", type=int, default=20, metavar="N",
                   help="untimed publish+unpublish cycles per proxy of part 3 before it fills (default 20)")
    add_parts_option(p, 3)
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the results as JSON here")
    p.add_argument("--serve", choices=["plugin", "handler"], help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return args
    try:
        args.scales = sorted({int(x) for x in args.volumes.split(",") if x.strip()})
    except ValueError:
        p.error("--volumes takes comma-separated integers, e.g. 10,1000")
    if args.rounds < 1 or args.churn < 1 or args.batch < 1 or args.warmup < 0:
        p.error("--rounds, --churn and --batch must be at least 1, --warmup at least 0")
    if len(args.scales) < 2 or args.scales[0] < args.batch:
        p.error(f"--volumes needs at least two counts, each at least --batch ({args.batch})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.serve, args.socket)
    if os.geteuid() != 0:
        print("proxy_bench.py needs root (the real driver makes loop devices and mounts)", file=sys.stderr)
        return 2

    raise_on_signals()
    project_on_pythonpath(os.environ)

    results: dict = {
        **run_header("proxy_bench", argv, machine(grpc=grpc.__version__)),
        "loadavg_start": file_text("/proc/loadavg"),
        "setup": {"parts 1-2": "real crust driver -> crust shim -> crust proxy (tests/harness.py Root.stack())",
                  "part 3": "fake CSI plugin (this script) -> crust proxy, to isolate the proxy's own cost"},
    }
    root = Root()
    stack = None
    live: dict = {}
    status = 1
    started = time.monotonic()
    m = results["machine"]
    print(f"crust proxy benchmark ({results['code']}), root {root.path}\n"
          f"machine: {m['cpus']} CPUs {m['cpu_model']}, {m['memory']}, kernel {m['kernel']}, Python {m['python']}, "
          f"load {results['loadavg_start'].split(' ')[0]}\n"
          "parts 1-2: the real stack (crust driver -> crust shim -> crust proxy); "
          "part 3: a FAKE CSI plugin behind crust proxy, to isolate the proxy's own cost", flush=True)
    try:
        def pids() -> list[int]:
            return [p.proc.pid for p in root.drivers if p.proc is not None]

        def measured(part: str, run) -> None:
            before = cpu_sample(pids())
            results[part] = run()
            results[part]["other_processes_cpu_cores"] = others_cores(before, cpu_sample(pids()))
            print(f"  (other processes on this machine kept {results[part]['other_processes_cpu_cores']:.2f} of "
                  f"{os.cpu_count()} cores busy meanwhile)", flush=True)

        if args.part_set & {1, 2}:
            with own_session():
                stack = root.stack()
            driver, shim, proxy = stack
            if 1 in args.part_set:
                measured("part1", lambda: part1(driver, shim, proxy, args.rounds, live))
            problems = teardown_part1(driver, proxy, live)
            if problems:  # the measurements stand; the forced cleanup at the end releases what is left
                print(f"  warning: tearing down the part-1 volume: {problems}", file=sys.stderr, flush=True)
                results["teardown_problems"] = problems
            if 2 in args.part_set:
                handler = ServerProcess("handler", root.path / "handler.sock")
                root.drivers.append(handler)
                handler.start()
                measured("part2", lambda: part2(root.path, proxy, handler, args.rounds))
                handler.stop()
            for process in (proxy, shim, driver):  # part 3 runs without the real stack
                process.stop()
            stack = None
        if 3 in args.part_set:
            measured("part3", lambda: part3(root, args.scales, args.batch, args.churn, args.warmup))
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["loadavg_end"] = file_text("/proc/loadavg")
        results["targets"] = [{"target": t, "met": ok, "value": v} for t, ok, v in verdicts(results)]
        print(f"\nTargets ({results['wall_seconds']:.0f}s run, load {results['loadavg_end'].split(' ')[0]} "
              "at the end):")
        for t, ok, v in verdicts(results):
            print(f"  {'MET ' if ok else 'MISSED'}  {t}: {v}")
        status = 0
    except (KeyboardInterrupt, Interrupted) as exc:
        print(f"\ninterrupted ({str(exc) or 'SIGINT'}); cleaning up", file=sys.stderr, flush=True)
        status = 130
    except Exception as exc:  # noqa: BLE001 - report, then clean up
        print(f"\nbenchmark failed: {exc!r}", file=sys.stderr, flush=True)
        print_log_tails(root.path, "*.log", "p*/*.log")
        status = 1
    finally:
        ignore_signals()
        problems = []
        if stack is not None and live:
            driver, shim, proxy = stack
            if all(p.proc is not None and p.proc.poll() is None for p in stack):
                problems = teardown_part1(driver, proxy, live)
        prefix = str(root.path.resolve()) + "/"
        root.close()  # stops every process (proxies, servers, shim, driver), unmounts, detaches, removes
        if report_leftovers(prefix, root.path, problems):
            status = status or 1
        if args.json and status == 0:
            write_json(args.json, results)
    return status


if __name__ == "__main__":
    sys.exit(main())
