#!/usr/bin/env python3
"""A crust-microvm pod's shared directory (virtio-fs) against what it replaced
and against a deferred volume (virtio-blk), side by side in one run.

The stack is the tests' (tests/harness/kata_env.py kata_env: driver -> shim -> proxy,
`crust kata handler`), driven through PodRuntime as containerd's crust shim
drives it (tests/harness/pod_runtime_client.py PodClient). One pod VM serves every
part; the guest runs under whatever accelerator the handler chose.

1. Container create. (a) The copy crust made before the share: the
   bundle's rootfs into a sparse ext4 image with `mkfs.ext4 -d` (sized as
   it was: content + a quarter + 256 MiB), only that step timed. (b) The
   share: CreateContainer of the same bundle (rootfs bound into the share,
   bound in the guest with /proc and /dev), the gRPC call timed; the
   container is deleted between runs. For a busybox rootfs and one with
   --big-mib MiB more of files (4 MiB each, random bytes). Interleaved.
2. First output: CreateContainer + StartProcess until the first line of
   `echo ready` comes back through ReadOutput (busybox rootfs).
3. Guest file I/O, in one container: a sequential write of --mib MiB
   (dd bs=1M conv=fsync) and a cold read back (the guest's page cache
   dropped first) through (a) a host directory bound through the share
   (virtio-fs) and (b) a deferred xfs volume (virtio-blk, mounted by the
   guest), timed in the guest (/proc/uptime, 10 ms) and alternating.

    .venv/bin/python bench/runtime/pod_share.py [--runs 5] [--mib 64] [--big-mib 200] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import accelerator_under  # noqa: E402
from bench.lib.run_record import machine, run_header, write_json  # noqa: E402
from tests.harness.daemons import MIB, Root  # noqa: E402
from tests.harness.kata_env import kata_env  # noqa: E402
from tests.harness.pod_runtime_client import PodClient, bind, container_bundle  # noqa: E402

IO_SCRIPT = """set -e
t() {{ read -r up _ < /proc/uptime; echo "$up"; }}
a=$(t); dd if=/dev/zero of={path}/bench.bin bs=1M count={mib} conv=fsync 2>/dev/null; b=$(t)
sync; echo 3 > /proc/sys/vm/drop_caches
c=$(t); dd if={path}/bench.bin of=/dev/null bs=1M 2>/dev/null; d=$(t)
rm -f {path}/bench.bin; sync
echo "$a $b $c $d"
"""
LOOKUP_SCRIPT = """t() { read -r up _ < /proc/uptime; echo "$up"; }
a=$(t); i=0; while [ $i -lt 20 ]; do ls -lL /bin > /dev/null; i=$((i+1)); done; b=$(t)
i=0; while [ $i -lt 100 ]; do /bin/true; i=$((i+1)); done; c=$(t)
echo "$a $b $c"
"""


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])  # the 1, 5 and 15 minute averages


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def span(values: list[float]) -> list[float]:
    """[min, max] of the runs behind a median (kept beside it, in KEY_min_max)."""
    return [round(min(values), 3), round(max(values), 3)]


def copy_image_seconds(rootfs: Path, image: Path) -> float:
    """The copy crust made at create before the share (only this step)."""
    content = sum(f.stat().st_size for f in rootfs.rglob("*") if f.is_file() and not f.is_symlink())
    size = content + content // 4 + 256 * MIB
    image.unlink(missing_ok=True)
    with open(image, "wb") as f:
        f.truncate(size)
    began = time.monotonic()
    subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(rootfs), "-E", "root_owner=0:0", str(image)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seconds = time.monotonic() - began
    image.unlink()
    return seconds


def add_files(rootfs: Path, mib: int) -> None:
    data_dir = rootfs / "data-files"
    data_dir.mkdir()
    for n in range(mib // 4):
        (data_dir / f"f{n}").write_bytes(os.urandom(4 * MIB))


def run(args) -> dict:
    root = Root()
    out: dict = {"load_before": load(), "runs": args.runs, "mib": args.mib, "big_mib": args.big_mib}
    try:
        for kenv in kata_env(root):
            client = PodClient(kenv.handler.socket)
            try:
                sandbox = kenv.path / "bundles" / "bench-sandbox"
                sandbox.mkdir(parents=True)
                (sandbox / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                                 "process": {"args": ["/p"]}}))
                began = time.monotonic()
                client.create_pod("bench", sandbox)
                out["pod_boot_s"] = round(time.monotonic() - began, 2)
                # The pod VM's accelerator, from its QEMU's command line.
                out["accelerator"] = accelerator_under(root.path)

                # 1. create: copy against share
                bundles = {"busybox": container_bundle(kenv.path, "bb", ["/bin/sh", "-c", "exit 0"], []),
                           "big": container_bundle(kenv.path, "big", ["/bin/sh", "-c", "exit 0"], [])}
                add_files(bundles["big"] / "rootfs", args.big_mib)
                create: dict = {name: {"copy": [], "share": []} for name in bundles}
                for r in range(args.runs):
                    for name, bundle in bundles.items():
                        create[name]["copy"].append(copy_image_seconds(bundle / "rootfs", kenv.path / "img"))
                        began = time.monotonic()
                        client.create_container("bench", f"c-{name}-{r}", bundle)
                        create[name]["share"].append(time.monotonic() - began)
                        client.delete_container(f"c-{name}-{r}")
                out["create_s"] = {name: {k: median(v) for k, v in sides.items()} for name, sides in create.items()}
                out["create_s_min_max"] = {name: {k: span(v) for k, v in sides.items()}
                                           for name, sides in create.items()}

                # 2. first output
                firsts = []
                ready = container_bundle(kenv.path, "ready", ["/bin/sh", "-c", "echo ready; exec sleep 600"], [])
                for r in range(args.runs):
                    began = time.monotonic()
                    client.create_container("bench", f"ready-{r}", ready)
                    client.start(f"ready-{r}")
                    client.output_until(f"ready-{r}", b"ready")
                    firsts.append(time.monotonic() - began)
                    client.delete_container(f"ready-{r}")
                out["first_output_s"] = median(firsts)
                out["first_output_s_min_max"] = span(firsts)

                # 3. guest I/O
                host_dir = kenv.path / "io-host"
                host_dir.mkdir()
                xfs = kenv.volume("pv-bench-io", "xfs")
                io = container_bundle(kenv.path, "io", ["/bin/sh", "-c", "echo up; exec sleep 3600"],
                                      [bind("/fs", host_dir), bind("/blk", xfs.target)])
                client.create_container("bench", "io", io)
                client.start("io")
                client.output_until("io", b"up")
                rates: dict = {side: {"write": [], "read": []} for side in ("virtio-fs", "virtio-blk")}
                for r in range(args.runs):
                    order = (("virtio-fs", "/fs"), ("virtio-blk", "/blk"))
                    for side, path in (order if r % 2 == 0 else order[::-1]):
                        code, text, err = client.exec("io", f"io-{side}-{r}",
                                                      ["sh", "-c", IO_SCRIPT.format(path=path, mib=args.mib)])
                        if code != 0:
                            raise RuntimeError(f"guest I/O through {side} failed: {err.decode()[-300:]}")
                        a, b, c, d = (float(x) for x in text.split())
                        rates[side]["write"].append(args.mib / max(b - a, 0.01))
                        rates[side]["read"].append(args.mib / max(d - c, 0.01))
                out["io_mib_per_s"] = {side: {k: median(v) for k, v in v2.items()} for side, v2 in rates.items()}
                out["io_mib_per_s_min_max"] = {side: {k: span(v) for k, v in v2.items()} for side, v2 in rates.items()}
                out["io_ratio_blk_over_fs"] = {
                    k: round(out["io_mib_per_s"]["virtio-blk"][k] / out["io_mib_per_s"]["virtio-fs"][k], 2)
                    for k in ("write", "read")}

                # 4. path lookups in the root
                lookups: dict = {"ls_lL_bin_x20": [], "exec_true_x100": []}
                for r in range(args.runs):
                    code, text, err = client.exec("io", f"lookup-{r}", ["sh", "-c", LOOKUP_SCRIPT])
                    if code != 0:
                        raise RuntimeError(f"path lookups failed: {err.decode()[-300:]}")
                    a, b, c = (float(x) for x in text.split())
                    lookups["ls_lL_bin_x20"].append(b - a)
                    lookups["exec_true_x100"].append(c - b)
                out["lookups_s"] = {k: median(v) for k, v in lookups.items()}
                out["lookups_s_min_max"] = {k: span(v) for k, v in lookups.items()}
                client.delete_container("io")
                client.delete_pod("bench")
                kenv.unpublish(xfs)
            finally:
                for pod_id in client.pods():
                    client.delete_pod(pod_id)
                client.close()
    finally:
        root.close()
    out["load_after"] = load()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement (medians; default 5)")
    parser.add_argument("--mib", type=int, default=64, help="MiB written and read per I/O run (default 64)")
    parser.add_argument("--big-mib", type=int, default=200, help="MiB of files in the big rootfs (default 200)")
    parser.add_argument("--json", type=Path, help="also write the results there")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root (loop devices, mounts, QEMU)")
    result = run(args)
    print(f"machine: {os.cpu_count()} CPUs, load {result['load_before']} -> {result['load_after']}; "
          f"pod VM booted in {result['pod_boot_s']} s")
    for name, sides in result["create_s"].items():
        print(f"create ({name}): copy {sides['copy'] * 1000:.0f} ms, share {sides['share'] * 1000:.0f} ms "
              f"(medians of {args.runs})")
    print(f"first output (busybox, create + start): {result['first_output_s']:.2f} s")
    for side, rates in result["io_mib_per_s"].items():
        print(f"guest I/O {side}: write {rates['write']:.1f} MiB/s, cold read {rates['read']:.1f} MiB/s")
    ratio = result["io_ratio_blk_over_fs"]
    print(f"virtio-blk / virtio-fs: write {ratio['write']}x, read {ratio['read']}x")
    looked = result["lookups_s"]
    print(f"lookups in the root: 20 x ls -lL /bin {looked['ls_lL_bin_x20']:.2f} s, "
          f"100 x /bin/true {looked['exec_true_x100']:.2f} s")
    if args.json:
        write_json(args.json, {**run_header("pod_share", argv, machine(), vm=True), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
