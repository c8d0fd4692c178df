#!/usr/bin/env python3
"""What the deferral shim costs, measured side by side in one run.

Starts a real `crust driver` and a real `crust shim` in front of it (unix
sockets in a temporary root) and measures, interleaving the two paths so
both see the same machine state:

1. passthrough latency: the same RPC sent to the driver directly and through
   the shim (GetPluginInfo, Probe, ControllerGetCapabilities, ListVolumes,
   ControllerGetVolume, NodeGetInfo, NodeGetCapabilities: byte-level
   passthrough or, for NodeGetCapabilities, answered by the shim);
2. publish: a deferred NodePublishVolume (placeholder tmpfs + description)
   against a host-mounting one (mount at staging + bind) on the same staged
   volume, alternating, each followed by its NodeUnpublishVolume (untimed).

Reports medians, p90 and the ratios. Run from the project root as root:

    .venv/bin/python bench/csi/shim_latency.py [--rounds 300] [--publishes 40] [--fs ext4] [--json OUT]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root: bench, crust, tests

from bench.lib.benchlib import machine, quantiles, run_header, timed, write_json  # noqa: E402
from crust.api import csi_pb2  # noqa: E402
from tests.harness.daemons import MIB, Root, mount_cap  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=300, help="calls per RPC and path (default 300)")
    parser.add_argument("--publishes", type=int, default=40, help="publishes per kind (default 40)")
    parser.add_argument("--fs", default="ext4", choices=["ext4", "xfs"])
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()

    root = Root()
    # The header every result records (its benchmark, command, commit, load):
    # without it, docs/performance.md's scenario finds no run of this bench.
    results: dict = {**run_header("shim_latency", None, machine()), "passthrough": {}, "publish": {}}
    try:
        driver = root.driver().start()
        shim = root.shim(driver).start()
        cap = mount_cap(args.fs)
        size = 320 * MIB if args.fs == "xfs" else 64 * MIB
        vol = driver.create("bench-shim", size, cap)
        staging = root.path / "staging"

        # Warm both channels so connection set-up is not measured.
        for stub in (driver, shim):
            for _ in range(20):
                stub.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())

        probes = {
            "GetPluginInfo": lambda p: p.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest()),
            "Probe": lambda p: p.identity.Probe(csi_pb2.ProbeRequest()),
            "ControllerGetCapabilities": lambda p: p.controller.ControllerGetCapabilities(
                csi_pb2.ControllerGetCapabilitiesRequest()),
            "ListVolumes": lambda p: p.controller.ListVolumes(csi_pb2.ListVolumesRequest()),
            "ControllerGetVolume": lambda p: p.controller.ControllerGetVolume(
                csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id)),
            "NodeGetInfo": lambda p: p.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest()),
            "NodeGetCapabilities": lambda p: p.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest()),
        }
        print(f"{'RPC':<28}{'direct p50':>12}{'shim p50':>12}{'added p50':>12}{'direct p90':>12}{'shim p90':>12}")
        for name, call in probes.items():
            direct, shimmed = [], []
            for _ in range(args.rounds):  # interleaved: same conditions for both
                direct.append(timed(lambda: call(driver)))
                shimmed.append(timed(lambda: call(shim)))
            d50, d90 = quantiles(direct)
            s50, s90 = quantiles(shimmed)
            results["passthrough"][name] = {"direct_p50_ms": round(d50, 4), "shim_p50_ms": round(s50, 4),
                                            "added_p50_ms": round(s50 - d50, 4), "direct_p90_ms": round(d90, 4),
                                            "shim_p90_ms": round(s90, 4)}
            print(f"{name:<28}{d50:>12.3f}{s50:>12.3f}{s50 - d50:>12.3f}{d90:>12.3f}{s90:>12.3f}")

        shim.stage(vol.volume_id, staging, cap)
        deferred, host = [], []
        for i in range(args.publishes):
            for kind in ("deferred", "host"):
                target = root.path / "pods" / f"{kind}-{i}" / "mount"
                request = csi_pb2.NodePublishVolumeRequest(
                    volume_id=vol.volume_id, staging_target_path=str(staging), target_path=str(target),
                    volume_capability=cap, defer_fs_ops=(kind == "deferred"))
                ms = timed(lambda: shim.node.NodePublishVolume(request, timeout=60))
                (deferred if kind == "deferred" else host).append(ms)
                shim.unpublish(vol.volume_id, target)
        d50, d90 = quantiles(deferred)
        h50, h90 = quantiles(host)
        results["publish"] = {"deferred_p50_ms": round(d50, 4), "deferred_p90_ms": round(d90, 4),
                              "host_p50_ms": round(h50, 4), "host_p90_ms": round(h90, 4),
                              "host_over_deferred": round(h50 / d50, 3), "fs": args.fs, "n": args.publishes}
        print(f"\nNodePublishVolume ({args.fs}, {args.publishes} each, alternating)")
        print(f"  deferred (placeholder + description)  p50 {d50:8.3f} ms   p90 {d90:8.3f} ms")
        print(f"  host mount (mount staging + bind)     p50 {h50:8.3f} ms   p90 {h90:8.3f} ms")
        print(f"  host / deferred                       {h50 / d50:8.2f}x")
        shim.unstage(vol.volume_id, staging)
        driver.delete(vol.volume_id)
    finally:
        root.close()
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
