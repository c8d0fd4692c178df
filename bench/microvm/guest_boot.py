#!/usr/bin/env python3
"""A microVM's boot, three ways side by side: what booting the kernel
uncompressed (crust.kata.image.bzimage) and the guest command line
(crust.kata.vmm.config.GUEST_CMDLINE) each save.

Each round starts the current guest image's VM (crust.kata.vmm.qemu.Vm, the
handler's own path: QEMU's start, the kernel, /init, until the agent
answers) three times, the order rotated from round to round:

- bzimage-plain: Debian's bzImage (from the image cache's unpacked kernel
  package), command line "console=ttyS0 quiet panic=-1" (before both);
- vmlinux-plain: the uncompressed kernel at its PVH entry, the same line;
- vmlinux-guest: the uncompressed kernel with GUEST_CMDLINE (what pods get).

    .venv/bin/python bench/microvm/guest_boot.py [--rounds 5] [--accel tcg|kvm] [--json OUT.json]

Median, min and max per way, the machine and its load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.kata.image import build as kata_image
from crust.kata.vmm.qemu import Vm, VmConfig  # noqa: E402
from crust.kata.vmm.config import GUEST_CMDLINE  # noqa: E402

PLAIN_CMDLINE = "console=ttyS0 quiet panic=-1"


def bzimage_of(built: kata_image.BuildResult, cache: Path) -> Path:
    """Debian's bzImage of the image's kernel, in the cache's unpacked package."""
    release = built.manifest["kernel_release"]
    found = sorted(cache.glob(f"extract/*/boot/vmlinuz-{release}"))
    if not found:
        raise FileNotFoundError(f"no unpacked vmlinuz-{release} under {cache}/extract (build the image on this node)")
    return found[0]


async def boot_once(workdir: Path, kernel: Path, initrd: Path, cmdline: str, accel: str) -> float:
    vm = Vm("crust-boot-bench", workdir, VmConfig(kernel=kernel, initrd=initrd, accel=accel, cmdline=cmdline))
    try:
        return await vm.start(ready_timeout=120)
    finally:
        await vm.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accel", choices=("tcg", "kvm"), default="tcg")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("guest_boot.py", "QEMU and the image cache"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("guest_boot", argv, benchlib.machine(), vm=True)
    base = Path(tempfile.mkdtemp(prefix="crust-boot-"))

    def body() -> None:
        built = kata_image.build()
        if built.kernel.name != "vmlinux":
            raise RuntimeError(f"the image boots {built.kernel.name}: {built.manifest.get('kernel_boot')}")
        ways = {"bzimage-plain": (bzimage_of(built, kata_image.DEFAULT_CACHE), PLAIN_CMDLINE),
                "vmlinux-plain": (built.kernel, PLAIN_CMDLINE),
                "vmlinux-guest": (built.kernel, GUEST_CMDLINE)}
        samples: dict[str, list[float]] = {name: [] for name in ways}
        results["load_before"] = benchlib.loadavg()
        for turn in range(args.rounds):
            for name in benchlib.rotated(list(ways), turn):
                kernel, cmdline = ways[name]
                seconds = asyncio.run(boot_once(base / name, kernel, built.initrd, cmdline, args.accel))
                samples[name].append(seconds * 1e3)
                print(f"round {turn + 1}/{args.rounds} {name}: {seconds * 1e3:.0f} ms", flush=True)
        results["load_after"] = benchlib.loadavg()
        results["accelerator"] = args.accel
        results["ways"] = benchlib.ms_rows(samples)
        print(f"\nboot to the agent's answer, {args.accel}, median of {args.rounds} (min-max); "
              f"{benchlib.machine_summary(results['machine'])}")
        benchlib.print_ms_rows(results["ways"], 15)
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.vm_dir_cleanup(base), benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
