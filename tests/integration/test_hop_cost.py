"""bench/csi/hop_cost.py's bare variant: `crust driver` behind two
bench/lib/bare_hop.py hops, measured like the real chain and gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.lib.benchlib import PROJECT
from bench.csi.hop_cost import BareVariant, part2
from crust.api import csi_pb2
from tests.harness.daemons import pid_alive


def test_help_names_the_bare_variant():
    out = subprocess.run([sys.executable, str(PROJECT / "bench" / "csi" / "hop_cost.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--bare" in out.stdout and "bare_hop.py" in out.stdout


def test_bare_variant_forwards_through_two_hops_and_leaves_nothing():
    variant = BareVariant("bare", PROJECT, {**os.environ, "PYTHONPATH": str(PROJECT)})
    closed = False
    try:
        variant.start()
        driver, first, second = (variant.doors[d] for d in ("driver", "shim", "proxy"))
        assert first.proc.pid != second.proc.pid and driver.proc.pid not in (first.proc.pid, second.proc.pid)
        # The volume it made on the driver answers through both hops.
        got = second.controller.ControllerGetVolume(
            csi_pb2.ControllerGetVolumeRequest(volume_id=variant.volume.volume_id), timeout=30)
        assert got.volume.volume_id == variant.volume.volume_id
        cpu = part2([variant], calls=20, blocks=2)["bare"]
        # A Probe sent to the outer hop costs CPU in every process of the chain,
        # one sent to the driver in the driver only.
        assert all(cpu["proxy"][d] > 0 for d in ("driver", "shim", "proxy")), cpu
        assert cpu["driver"]["driver"] > 0
        pids = variant.pids()
        sockets = [first.socket, second.socket, driver.socket]
        closed = variant.close()
        assert closed
        assert not [pid for pid in pids if pid_alive(pid)]
        assert not [s for s in sockets if s.exists()] and not variant.root.path.exists()
    finally:
        if not closed:
            variant.close()
