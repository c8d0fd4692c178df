#!/usr/bin/env python3
"""CPU per CSI call, call by call: crust against the Go reference driver.

bench/csi/conformance_ratio.py gives the CPU of a whole csi-sanity suite; this
says which calls it comes from. Each target is started as the conformance
runs start it (tests/harness/csi_sanity.py), then sent, one at a time, the same
calls or pairs of calls:

    Probe                       an empty call: what a served call costs at the least
    ControllerGetCapabilities   answered from memory
    ListVolumes                 over the volumes the run made (--volumes, 8 by default)
    CreateVolume+DeleteVolume   a 1 GiB mount volume made and removed (a pair)
    CreateSnapshot+DeleteSnapshot  of one of those volumes (a pair)
    ControllerPublish+Unpublish    of one of those volumes to the node (a pair)

and the CPU time every thread of the target's daemons used meanwhile (from
/proc/PID/task/*/schedstat, in ns; none of these calls runs a command) is
divided by the calls. The targets take turns by blocks of --calls / 5 calls
(the order rotating), so all see the same machine. Reported per call and
target: CPU (ms) per call or pair, the ratio to the reference, and the
median wall time.

csi-sanity is not needed; hostpathplugin (not part of crust) comes from
$PATH unless given. Run from the project root as root (loop devices):

    .venv/bin/python bench/csi/call_cpu.py [--calls 200] [--targets reference,driver] [--json OUT]

Everything lives in temporary roots removed at the end, also on Ctrl-C,
SIGTERM or failure.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

from bench.lib.benchlib import (  # noqa: E402
    close_and_report,
    code_label,
    cpu_ns,
    guarded_run_then_write,
    loadavg,
    machine,
    machine_summary,
    not_root,
    raise_on_signals,
    rotated,
    run_header,
)
from bench.lib.stack import own_session  # noqa: E402
from crust.api import csi_pb2, csi_pb2_grpc  # noqa: E402
from tests.harness.csi_sanity import DRIVER_FLAGS, NODE_ID, start_target  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402

TARGETS = ("reference", "driver", "shim", "proxy")
GIB = 1 << 30
BLOCKS = 5
MOUNT = csi_pb2.VolumeCapability(
    mount=csi_pb2.VolumeCapability.MountVolume(),
    access_mode=csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))


class Target:
    """One target started in its own root, with stubs on its front socket."""

    def __init__(self, name: str, hostpath: str, volumes: int):
        self.name, self.hostpath, self.volume_count = name, hostpath, volumes
        self.root = Root()
        self.pids: list[int] = []
        self.volumes: list[str] = []

    def start(self) -> None:
        with own_session():
            chain = start_target(self.root, self.name, hostpath=self.hostpath)
        self.pids = [d.proc.pid for d in chain]
        front = chain[-1]
        self.identity = csi_pb2_grpc.IdentityStub(front.channel)
        self.controller = csi_pb2_grpc.ControllerStub(front.channel)
        self.volumes = [self.create_volume() for _ in range(self.volume_count)]

    def cpu_ns(self) -> int:
        return sum(cpu_ns(pid) for pid in self.pids)

    def create_volume(self) -> str:
        request = csi_pb2.CreateVolumeRequest(name=f"call-cpu-{uuid.uuid4().hex}",
                                              capacity_range=csi_pb2.CapacityRange(required_bytes=GIB),
                                              volume_capabilities=[MOUNT])
        return self.controller.CreateVolume(request, timeout=60).volume.volume_id

    def calls(self) -> dict:
        """name -> one call (or pair) against this target."""
        c = self.controller
        volume = self.volumes[0]

        def create_delete_volume():
            c.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=self.create_volume()), timeout=60)

        def create_delete_snapshot():
            made = c.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name=f"call-cpu-{uuid.uuid4().hex}",
                                                                  source_volume_id=volume), timeout=60)
            c.DeleteSnapshot(csi_pb2.DeleteSnapshotRequest(snapshot_id=made.snapshot.snapshot_id), timeout=60)

        def publish_unpublish():
            c.ControllerPublishVolume(csi_pb2.ControllerPublishVolumeRequest(
                volume_id=volume, node_id=NODE_ID, volume_capability=MOUNT), timeout=60)
            c.ControllerUnpublishVolume(csi_pb2.ControllerUnpublishVolumeRequest(volume_id=volume, node_id=NODE_ID),
                                        timeout=60)

        return {
            "Probe": lambda: self.identity.Probe(csi_pb2.ProbeRequest(), timeout=60),
            "ControllerGetCapabilities": lambda: c.ControllerGetCapabilities(
                csi_pb2.ControllerGetCapabilitiesRequest(), timeout=60),
            "ListVolumes": lambda: c.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=60),
            "CreateVolume+DeleteVolume": create_delete_volume,
            "CreateSnapshot+DeleteSnapshot": create_delete_snapshot,
            "ControllerPublish+Unpublish": publish_unpublish,
        }

    def close(self) -> bool:
        problems = []
        for volume in self.volumes:
            try:
                self.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=volume), timeout=60)
            except Exception as exc:  # noqa: BLE001 - say it, and go on tearing down
                problems.append(f"DeleteVolume {volume} on {self.name}: {exc}")
        self.volumes = []
        return close_and_report(self.root, problems, self.root.close)


def measure(targets: list[Target], calls: int) -> dict:
    per_block = max(1, calls // BLOCKS)
    names = list(targets[0].calls())
    out: dict = {}
    for name in names:
        used = {t.name: 0 for t in targets}
        walls: dict[str, list[float]] = {t.name: [] for t in targets}
        for t in targets:  # warm the code path and the connection
            for _ in range(5):
                t.calls()[name]()
        for b in range(BLOCKS):
            for t in rotated(targets, b):
                call = t.calls()[name]
                before = t.cpu_ns()
                for _ in range(per_block):
                    started = time.perf_counter()
                    call()
                    walls[t.name].append(time.perf_counter() - started)
                used[t.name] += t.cpu_ns() - before
        row = {}
        for t in targets:
            row[t.name] = {"cpu_ms": round(used[t.name] / (per_block * BLOCKS) / 1e6, 3),
                           "wall_ms_median": round(statistics.median(walls[t.name]) * 1e3, 3)}
        ref = row.get("reference")
        for t in targets:
            if ref and t.name != "reference":
                row[t.name]["cpu_ratio_to_reference"] = round(row[t.name]["cpu_ms"] / ref["cpu_ms"], 2)
        out[name] = row
        cells = "  ".join(f"{t.name} {row[t.name]['cpu_ms']:.3f}"
                          + (f" ({row[t.name]['cpu_ratio_to_reference']}x)" if "cpu_ratio_to_reference" in row[t.name]
                             else "") for t in targets)
        print(f"  {name:<32}{cells}", flush=True)
    return out


def render(results: dict, targets: list[str]) -> str:
    lines = ["| call | " + " | ".join(f"{t}: CPU ms (/ reference), wall ms" for t in targets) + " |",
             "|---|" + "---:|" * len(targets)]
    for name, row in results["calls"].items():
        cells = []
        for t in targets:
            r = row[t]
            ratio = f" ({r['cpu_ratio_to_reference']}x)" if "cpu_ratio_to_reference" in r else ""
            cells.append(f"{r['cpu_ms']}{ratio}, {r['wall_ms_median']}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="call_cpu.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200, metavar="N", help="calls (or pairs) per kind and target (200)")
    p.add_argument("--volumes", type=int, default=8, metavar="N", help="volumes made first, for ListVolumes (8)")
    p.add_argument("--targets", default="reference,driver", metavar="T,T",
                   help=f"some of {','.join(TARGETS)} (default reference,driver; ratios need the reference)")
    p.add_argument("--hostpath", metavar="PATH", help="hostpathplugin (default: on $PATH)")
    p.add_argument("--json", metavar="OUT", help="also write the numbers as JSON ('-': stdout)")
    args = p.parse_args(argv)
    args.targets = [t for t in TARGETS if t in args.targets.split(",")]
    if not args.targets or args.calls < 1 or args.volumes < 1:
        p.error(f"--targets: some of {','.join(TARGETS)}; --calls and --volumes at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    hostpath = args.hostpath or shutil.which("hostpathplugin")
    if "reference" in args.targets and not hostpath:
        print("call_cpu.py: no hostpathplugin on $PATH (the Go reference, not part of crust; docs/conformance.md); "
              "give --hostpath PATH or leave the reference out of --targets", file=sys.stderr)
        return 2
    if not_root("call_cpu.py", "loop devices"):
        return 2
    raise_on_signals()
    results: dict = {**run_header("call_cpu", argv, machine()), "config": {
        "calls": args.calls, "volumes": args.volumes, "driver_flags": DRIVER_FLAGS}}
    targets: list[Target] = []

    def body() -> None:
        print(f"{machine_summary(results['machine'])}; code {code_label(results)}; load {loadavg(True)}", flush=True)
        for name in args.targets:
            targets.append(Target(name, hostpath, args.volumes))
            targets[-1].start()
        print(f"CPU ms per call (or pair), every thread of the target's daemons; {args.calls} per kind and target",
              flush=True)
        results["calls"] = measure(targets, args.calls)
        results["loadavg_end"] = loadavg(True)
        print(f"\nload {results['loadavg_end']} at the end\n\n" + render(results, args.targets))

    def cleanup() -> bool:
        return all([t.close() for t in targets])  # noqa: C419 - close every target, even after a failed one

    return guarded_run_then_write(body, cleanup, lambda exc: print(f"call_cpu.py: failed: {exc!r}", file=sys.stderr),
                                  args.json, results)


if __name__ == "__main__":
    sys.exit(main())
