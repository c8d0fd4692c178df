#!/usr/bin/env python3
"""The proxy and the mount-namespace handler at many deferred volumes.

Two real stacks side by side (tests/harness/daemons.py: crust driver -> crust shim
-> crust proxy, and `crust handler` registered with the proxy), one filled
to 10 deferred volumes, the other to --volumes N (default 1000). Each volume
(--size MiB of --fs) is created, staged and published with defer_fs_ops on
the proxy's kubelet-facing socket, as kubelet would, and mounted by a
mount-namespace sandbox (--per-sandbox volumes in each, default 100: one
RunSandbox with that many mounts). Then, both stacks interleaved:

1. fill: CreateVolume, NodeStageVolume, NodePublishVolume per volume, and
   when the handler library's index (crust.runtime_handler.index, a
   VolumeIndex in this process on the proxy's real watched directory) held
   the entry, counted from the start of the publish; RunSandbox per volume;
2. NodeGetVolumeStats through the whole chain (proxy -> shim -> proxy
   Runtime API -> handler -> inside the sandbox), --rounds rounds, each on a
   random volume of each stack: median, p90, p99;
3. a burst of --burst concurrent NodeGetVolumeStats (--bursts times per
   stack): latencies and the burst's wall time against one call's median
   ("serialized" 1.0 would mean every call waited for the one before);
4. a fan-out of N NodeGetVolumeStats per stack spread evenly over
   --fanout-seconds (default 60), both stacks at once, none waiting for
   another's answer: latencies;
5. churn, --churn rounds: publish of one more volume, the index holding it,
   RunSandbox over it alone (claim, device check, mount), DeleteSandbox
   (unmount, release), NodeUnpublishVolume;
6. drain: DeleteSandbox of every sandbox, NodeUnpublishVolume of every
   volume (the first 10 unpublished at N are compared with the stack at 10);
and the RSS (VmRSS) of each daemon of each stack: started, full, after the
measurements. Everything lives under two temporary roots. On exit, also on
Ctrl-C, SIGTERM or failure, sandboxes are deleted and volumes unpublished,
unstaged and deleted as far as they got; then the daemons are stopped and
what is left below the roots (mounts, loop devices, this run's sandbox
processes) is removed (close_root of bench/lib/mountns_chain.py). As root:

    .venv/bin/python bench/csi/scale_deferred.py [--volumes 1000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

import grpc  # noqa: E402

from bench.lib.benchlib import (code_label, close_and_report, file_text, guarded_run_then_write, loadavg, machine,  # noqa: E402
                            machine_summary, not_root, print_log_tails, raise_on_signals, report_failure,
                            run_header, summary)
from bench.lib.mountns_chain import close_root  # noqa: E402
from bench.lib.fleet import rss_mib  # noqa: E402
from bench.lib.stack import ProxyVolume, project_on_pythonpath, start_stack  # noqa: E402
from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc  # noqa: E402
from crust.contract.mountinfo import digest  # noqa: E402
from crust.runtime_handler.index import VolumeIndex  # noqa: E402
from tests.harness.daemons import MIB, Root, mount_cap  # noqa: E402

SMALL = 10
DAEMONS = ("driver", "shim", "proxy", "handler")
ms = lambda samples: summary(samples, 3, ("p50", "p90", "p99", "max"), "_ms")  # noqa: E731


def now_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1e3


def stats_request(volume: ProxyVolume) -> csi_pb2.NodeGetVolumeStatsRequest:
    return csi_pb2.NodeGetVolumeStatsRequest(volume_id=volume.volume_id, volume_path=str(volume.target))


class Stack:
    """One real stack, its volumes (ProxyVolume, in publish order) and sandboxes."""

    def __init__(self, n: int, fs: str, size: int):
        self.n, self.cap, self.size = n, mount_cap(fs), size
        self.root = Root()
        self.daemons = self.proxy = None
        self.index: VolumeIndex | None = None
        self.volumes: list[ProxyVolume] = []
        self.spare: list[ProxyVolume] = []  # staged, published and unpublished by the churn
        self.sandboxes: dict[str, list[ProxyVolume]] = {}
        self.times: dict[str, list[float]] = {}

    def up(self) -> None:
        self.daemons = start_stack(self.root)
        self.proxy = self.daemons[2]
        self.index = VolumeIndex(self.proxy.volumes_dir).start()
        self.handler_stub = handler_pb2_grpc.SandboxControlStub(
            grpc.insecure_channel(f"unix://{self.daemons[3].socket}"))

    def add(self, what: str, value: float) -> None:
        self.times.setdefault(what, []).append(value)

    def rss(self) -> dict:
        return {name: round(rss_mib(d.proc.pid), 1) for name, d in zip(DAEMONS, self.daemons)}

    def make(self, i: int, spare: bool = False) -> ProxyVolume:
        """Created and staged (timed), not published."""
        name = f"{'spare' if spare else 'pv'}-{i:05d}"
        started = time.perf_counter()
        volume = ProxyVolume.create(self.proxy, name, f"pod-{name}", self.size, self.cap)
        (self.spare if spare else self.volumes).append(volume)
        self.add("create", now_ms(started))
        started = time.perf_counter()
        volume.stage()
        self.add("stage", now_ms(started))
        return volume

    def publish(self, volume: ProxyVolume, what: str = "publish") -> None:
        """Deferred publish, timed, and when the index held its entry."""
        key = digest(str(volume.target))
        started, since = time.perf_counter(), time.monotonic()
        volume.publish_deferred()
        self.add(what, now_ms(started))
        if self.index.wait_for(key, 10) is None:
            raise RuntimeError(f"the index never held the entry of {volume.target}")
        # The moment wait_for() saw the entry (the index keeps no time of its
        # own since ea4a0a6): as bench/csi/handler_bench.py's probe, the waiting
        # thread's wake-up is included.
        self.add(f"{what}_indexed", (time.monotonic() - since) * 1e3)

    def unpublish(self, volume: ProxyVolume, what: str) -> None:
        started = time.perf_counter()
        self.proxy.unpublish(volume.volume_id, volume.target)
        volume.published = False
        self.add(what, now_ms(started))

    def run_sandbox(self, sandbox_id: str, volumes: list[ProxyVolume], what: str = "run_sandbox") -> None:
        bundle = self.root.path / "bundle" / sandbox_id
        (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["sleep", "86400"], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
            "mounts": [{"destination": f"/data/{v.volume_id}", "source": str(v.target), "type": "bind",
                        "options": ["rbind"]} for v in volumes]}))
        self.sandboxes[sandbox_id] = volumes
        started = time.perf_counter()
        self.handler_stub.RunSandbox(handler_pb2.RunSandboxRequest(bundle=str(bundle), sandbox_id=sandbox_id),
                                     timeout=600)
        self.add(what, now_ms(started) / len(volumes))

    def delete_sandbox(self, sandbox_id: str, what: str = "delete_sandbox") -> None:
        started = time.perf_counter()
        self.handler_stub.DeleteSandbox(handler_pb2.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=600)
        self.add(what, now_ms(started) / len(self.sandboxes.pop(sandbox_id)))

    def stats(self, volume: ProxyVolume) -> float:
        started = time.perf_counter()
        rsp = self.proxy.node.NodeGetVolumeStats(stats_request(volume), timeout=30)
        took = now_ms(started)
        if rsp.volume_condition.abnormal or not rsp.usage:
            raise RuntimeError(f"stats of {volume.target}: {rsp}")
        return took

    def tear_down(self) -> list[str]:
        """Undo what got done, in order; the errors (forced cleanup follows)."""
        problems: list[str] = []
        if self.index is not None:
            self.index.stop()
        if self.daemons is None or any(d.proc is None or d.proc.poll() is not None for d in self.daemons):
            return ["a daemon is not running; forced cleanup only"] if self.daemons else []
        for sandbox_id in list(self.sandboxes):
            try:
                self.delete_sandbox(sandbox_id)
            except grpc.RpcError as exc:
                problems.append(f"delete {sandbox_id}: {exc.details()}")
        for volume in self.volumes + self.spare:
            volume.take_down(problems)
        return problems


class Calls:
    """NodeGetVolumeStats sent without waiting (futures); each latency taken
    by its own completion callback."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)
        self.latencies: dict[int, list[float]] = {}
        self.failures: list[str] = []
        self.pending = 0

    def send(self, stack: Stack, volume: ProxyVolume) -> None:
        started = time.perf_counter()
        with self.lock:
            self.pending += 1
        future = stack.proxy.node.NodeGetVolumeStats.future(stats_request(volume), timeout=60)

        def finished(f) -> None:
            took = now_ms(started)
            with self.lock:
                if f.exception() is not None or f.result().volume_condition.abnormal:
                    self.failures.append(str(f.exception() or f.result().volume_condition.message)[:200])
                self.latencies.setdefault(stack.n, []).append(took)
                self.pending -= 1
                self.done.notify_all()

        future.add_done_callback(finished)

    def wait(self) -> None:
        with self.lock:
            if not self.done.wait_for(lambda: self.pending == 0, timeout=300):
                raise RuntimeError(f"{self.pending} stats calls never finished")
        if self.failures:
            raise RuntimeError(f"{len(self.failures)} stats calls failed: {self.failures[:3]}")


def fill(stacks: list[Stack], per_sandbox: int, churn: int) -> None:
    for s in stacks:
        print(f"  filling the stack at {s.n}: create, stage, publish", flush=True)
        for i in range(s.n):
            s.publish(s.make(i))
            if (i + 1) % 100 == 0:
                print(f"    {i + 1} published ({loadavg()})", flush=True)
        for i in range(churn):
            s.make(i, spare=True)
        print(f"  running sandboxes at {s.n} ({per_sandbox} volumes each)", flush=True)
        for k in range(0, s.n, per_sandbox):
            s.run_sandbox(f"sb-{k // per_sandbox:03d}", s.volumes[k:k + per_sandbox])


def stats_rounds(stacks: list[Stack], rounds: int) -> dict:
    rng = random.Random(11)
    samples: dict[int, list[float]] = {s.n: [] for s in stacks}
    for s in stacks:  # warm-up: channels, first calls
        for v in s.volumes[:20]:
            s.stats(v)
    for r in range(rounds):
        for s in stacks[r % 2:] + stacks[:r % 2]:
            samples[s.n].append(s.stats(rng.choice(s.volumes)))
    return {str(n): ms(v) for n, v in samples.items()}


def bursts(stacks: list[Stack], size: int, count: int) -> dict:
    rng = random.Random(12)
    out = {}
    single = {s.n: summary([s.stats(rng.choice(s.volumes)) for _ in range(50)], 3, ("p50",))["p50"] for s in stacks}
    walls: dict[int, list[float]] = {s.n: [] for s in stacks}
    calls = Calls()
    for b in range(count):
        for s in stacks[b % 2:] + stacks[:b % 2]:
            started = time.perf_counter()
            for _ in range(size):
                calls.send(s, rng.choice(s.volumes))
            calls.wait()
            walls[s.n].append(now_ms(started))
    for s in stacks:
        wall = summary(walls[s.n], 1, ("p50",))["p50"]
        out[str(s.n)] = {"single_p50_ms": single[s.n], "latency": ms(calls.latencies[s.n]), "wall_p50_ms": wall,
                         "serialized": round(wall / (size * single[s.n]), 2)}
    return out


def fanout(stacks: list[Stack], calls_per_stack: int, seconds: float) -> dict:
    rng = random.Random(13)
    plan = [(s, rng.choice(s.volumes)) for _ in range(calls_per_stack) for s in stacks]
    gap = seconds / len(plan)
    calls = Calls()
    started = time.monotonic()
    late = 0.0
    for i, (s, volume) in enumerate(plan):
        delay = started + i * gap - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            late = max(late, -delay)
        calls.send(s, volume)
    calls.wait()
    return {"calls_per_stack": calls_per_stack, "seconds": round(time.monotonic() - started, 1),
            "sender_late_max_ms": round(late * 1e3, 1), **{str(n): ms(v) for n, v in calls.latencies.items()}}


def churn_rounds(stacks: list[Stack], rounds: int) -> None:
    for r in range(rounds):
        for s in stacks[r % 2:] + stacks[:r % 2]:
            volume = s.spare[r]
            s.publish(volume, "churn_publish")
            s.run_sandbox(f"churn-{r:03d}", [volume], "churn_run_sandbox")
            s.add("churn_stats", s.stats(volume))
            s.delete_sandbox(f"churn-{r:03d}", "churn_delete_sandbox")
            s.unpublish(volume, "churn_unpublish")


def drain(stacks: list[Stack]) -> None:
    for s in stacks:
        print(f"  draining the stack at {s.n}", flush=True)
        for sandbox_id in list(s.sandboxes):
            s.delete_sandbox(sandbox_id)
        for volume in reversed(s.volumes):
            s.unpublish(volume, "unpublish")
        problems: list[str] = []
        while s.volumes or s.spare:
            volume = (s.volumes or s.spare).pop()
            started = time.perf_counter()
            if not volume.take_down(problems):
                raise RuntimeError(f"taking down {volume.volume_id}: {problems}")
            s.add("unstage_and_delete", now_ms(started))


def report(stacks: list[Stack], results: dict) -> None:
    small, big = stacks
    print(f"\n  {'per call (ms), p50 / p90':<44}{f'at {small.n}':>18}{f'at {big.n}':>18}{'ratio':>8}")
    results["per_call"] = {}
    for key in [k for k in big.times if k in small.times]:
        # The stack at N against the stack at 10: the last 10 publishes of its
        # fill, the first 10 unpublishes of its drain, everything else whole.
        b = big.times[key]
        b = b[-small.n:] if key in ("publish", "publish_indexed") else b[:small.n] if key == "unpublish" else b
        a, b = ms(small.times[key]), ms(b)
        results["per_call"][key] = {str(small.n): a, str(big.n): b}
        ratio = b["p50_ms"] / a["p50_ms"] if a["p50_ms"] > 0 else float("nan")
        print(f"  {key:<44}{a['p50_ms']:>9.2f} / {a['p90_ms']:<6.2f}{b['p50_ms']:>9.2f} / {b['p90_ms']:<6.2f}"
              f"{ratio:>7.2f}x")
    for part in ("stats", "burst", "fanout", "rss"):
        print(f"  {part}: {json.dumps(results[part])}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scale_deferred.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--volumes", type=int, default=1000, metavar="N", help="volumes of the big stack (default 1000)")
    p.add_argument("--fs", choices=("ext4", "xfs"), default="ext4", help="file system (default ext4)")
    p.add_argument("--size", type=int, default=32, metavar="MIB", help="volume size (default 32; xfs needs 300)")
    p.add_argument("--per-sandbox", type=int, default=100, metavar="K", help="volumes per sandbox (default 100)")
    p.add_argument("--rounds", type=int, default=300, metavar="R", help="stats rounds of part 2 (default 300)")
    p.add_argument("--burst", type=int, default=50, metavar="B", help="concurrent stats per burst (default 50)")
    p.add_argument("--bursts", type=int, default=10, metavar="K", help="bursts per stack (default 10)")
    p.add_argument("--fanout-seconds", type=float, default=60.0, metavar="S", help="fan-out length (default 60)")
    p.add_argument("--churn", type=int, default=20, metavar="C", help="churn rounds of part 5 (default 20)")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.volumes <= SMALL or min(args.per_sandbox, args.rounds, args.burst, args.bursts, args.churn) < 1:
        p.error(f"--volumes must be over {SMALL}; the counts at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not_root("scale_deferred.py", "loop devices, mounts, namespaces"):
        return 2
    raise_on_signals()
    project_on_pythonpath(os.environ)
    results: dict = {**run_header("scale_deferred", argv, machine(grpc=grpc.__version__)),
                     "loadavg_start": file_text("/proc/loadavg"), "rss": {}}
    stacks: list[Stack] = []
    started = time.monotonic()

    def rss(when: str) -> None:
        results["rss"][when] = {str(s.n): s.rss() for s in stacks}

    def run() -> None:
        print(f"crust at {args.volumes} deferred volumes ({code_label(results)})\nmachine: "
              f"{machine_summary(results['machine'])}, load {loadavg()}", flush=True)
        for n in (SMALL, args.volumes):
            stacks.append(Stack(n, args.fs, args.size * MIB))
            stacks[-1].up()
        rss("started")
        print("[1] fill", flush=True)
        fill(stacks, args.per_sandbox, args.churn)
        rss("full")
        results["host_mounts"] = len(file_text("/proc/self/mountinfo").splitlines())
        print(f"[2] stats, {args.rounds} rounds ({results['host_mounts']} host mounts)", flush=True)
        results["stats"] = stats_rounds(stacks, args.rounds)
        print(f"[3] bursts of {args.burst}", flush=True)
        results["burst"] = bursts(stacks, args.burst, args.bursts)
        print(f"[4] fan-out of {args.volumes} per stack over {args.fanout_seconds:.0f} s", flush=True)
        results["fanout"] = fanout(stacks, args.volumes, args.fanout_seconds)
        print(f"[5] churn, {args.churn} rounds", flush=True)
        churn_rounds(stacks, args.churn)
        rss("after_measurements")
        print("[6] drain", flush=True)
        drain(stacks)
        results["wall_seconds"] = round(time.monotonic() - started, 1)
        results["loadavg_end"] = file_text("/proc/loadavg")
        report(stacks, results)

    def failed(exc: Exception) -> None:
        report_failure(exc)
        for s in stacks:
            print_log_tails(s.root.path, "*.log")

    def clean_up() -> bool:
        ok = True
        for s in stacks:
            ok = close_and_report(s.root, s.tear_down(), lambda s=s: close_root(s.root)) and ok
        return ok

    return guarded_run_then_write(run, clean_up, failed, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
