"""bench/csi/hop_cost.py with its bare variant: `crust driver` behind two
bench/lib/bare_hop.py hops, measured beside the real chain, as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from tests.harness.bench_run import PROJECT, run_bench


def test_help_names_the_bare_variant():
    out = subprocess.run([sys.executable, str(PROJECT / "bench" / "csi" / "hop_cost.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--bare" in out.stdout and "bare_hop.py" in out.stdout


def test_the_bare_variant_is_measured_beside_the_real_chain(tmp_path):
    result = run_bench("bench/csi/hop_cost.py", "--bare", "--rounds", "1", "--cpu-calls", "20",
                       out=tmp_path / "hops.json")
    assert list(result["variants"]) == ["current", "bare"]
    cpu = result["part2"]["bare"]
    # A Probe sent to the outer hop costs CPU in every process of the chain,
    # one sent to the driver in the driver only (the hops' idle noise aside).
    assert all(cpu["proxy"][d] > 0 for d in ("driver", "shim", "proxy")), cpu
    assert cpu["driver"]["driver"] > 5 * max(cpu["driver"]["shim"], cpu["driver"]["proxy"]), cpu
    # A volume the bare variant made on its driver answers through both hops.
    volume = result["part1"]["ControllerGetVolume"]["bare"]
    assert all(volume[f"{door}_p50_ms"] > 0 for door in ("driver", "shim", "proxy")), volume
