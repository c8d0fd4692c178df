#!/usr/bin/env python3
"""TCG's translation buffer against what a VM does: the size QEMU's
`-accel tcg,tb-size=N` is given (crust.kata.vm_config.TCG_TB_MIB, node.yaml
handler.kata.tcgTbMiB) weighed by boot time, exec latency and QEMU's
resident memory, sizes side by side.

Each round boots one VM of the current guest image per size (the order
rotated from round to round; crust.kata.qemu.Vm, the handler's own path,
until the agent answers), then runs in its guest, one after another,
--execs processes of `true` and as many of `python3.11 -S -c pass` (the
agent's own interpreter: the largest code a guest runs), each through the
agent (ExecProcess, WaitProcess, its output read, RemoveProcess), and
reads QEMU's resident memory (VmRSS) and the PSS of its translation buffer
(its one anonymous mapping that is writable and executable). Size 0 is
QEMU's own default (an eighth of the host's RAM, at most 1 GiB).

    .venv/bin/python bench/microvm/tcg_buffer.py [--sizes 0,8,16,32,64] [--rounds 2] [--execs 8] [--json OUT.json]

Median per size (min-max), the machine and its load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from bench.runtime.pod_density import tcg_buffer_kib  # noqa: E402
from tests.harness.guest_vm import Guest, guest_config  # noqa: E402


def rss_kib(pid: int) -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


async def one_vm(workdir: Path, config, execs: int) -> dict:
    started = time.monotonic()
    async with Guest(workdir, "crust-tcg-buffer", config=config) as g:
        boot = time.monotonic() - started
        samples: dict[str, list[float]] = {"true": [], "python": []}
        for _ in range(execs):
            for name, script in (("true", "true"), ("python", "python3.11 -S -c pass")):
                at = time.monotonic()
                code, out = await g.sh(script, timeout=120)
                if code != 0:
                    raise RuntimeError(f"{script!r} in the guest: {code} {out}")
                samples[name].append((time.monotonic() - at) * 1e3)
        return {"boot_ms": boot * 1e3, "true_ms": sorted(samples["true"])[execs // 2],
                "python_ms": sorted(samples["python"])[execs // 2],
                "rss_mib": rss_kib(g.vm.pid) / 1024, "buffer_pss_mib": tcg_buffer_kib(g.vm.pid) / 1024}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0,8,16,32,64", help="buffer sizes in MiB (0: QEMU's default)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--execs", type=int, default=8, help="processes of each kind per VM")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("tcg_buffer.py", "QEMU and the image cache"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("tcg_buffer", argv, benchlib.machine(), vm=True)
    base = Path(tempfile.mkdtemp(prefix="crust-tcg-buffer-"))
    sizes = [int(s) for s in args.sizes.split(",")]

    def body() -> None:
        config = guest_config()
        samples: dict[int, list[dict]] = {size: [] for size in sizes}
        results["load_before"] = benchlib.loadavg()
        for turn in range(args.rounds):
            for size in benchlib.rotated(sizes, turn):
                measured = asyncio.run(one_vm(base / f"tb{size}", dataclasses.replace(config, tcg_tb_mib=size),
                                              args.execs))
                shutil.rmtree(base / f"tb{size}", ignore_errors=True)
                samples[size].append(measured)
                print(f"round {turn + 1}/{args.rounds} tb-size {size or 'default'}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in measured.items()), flush=True)
        results["load_after"] = benchlib.loadavg()
        results["accelerator"] = "tcg"
        results["sizes"] = {str(size): {key: benchlib.summary([m[key] for m in got], 1, ("median", "min", "max"))
                                        for key in got[0]} for size, got in samples.items()}
        print(f"\nper VM, median of {args.rounds} (min-max); {benchlib.machine_summary(results['machine'])}")
        for size, row in results["sizes"].items():
            print(f"  tb-size {size if size != '0' else 'QEMU default':>12}: "
                  + ", ".join(f"{k} {v['median']} ({v['min']}-{v['max']})" for k, v in row.items()))
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.vm_dir_cleanup(base), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
