"""Memory under bursts of large requests (bench/csi/large_requests.py, in short).

The proxy's CSI socket grew from 57 to 485 MiB RSS under 20 rounds of 14
concurrent 4 MiB requests it forwards: every failed call (aborted with
context.abort()) left a reference cycle holding its request until Python's
cyclic collector ran, and glibc kept the freed buffers. Each daemon now
ends a failed call by setting its status, maps large buffers, and trims its
arenas after large requests: after the burst its RSS comes back close to
where it started.
"""

from __future__ import annotations

import time

import grpc
import pytest

from tests.harness.large_requests import burst, large_request, rss_mib
from crust.api import csi_pb2, csi_pb2_grpc

ROUNDS, CONCURRENCY = 10, 14


@pytest.mark.parametrize("socket", ["proxy", "driver"])
def test_memory_comes_back_after_a_burst_of_large_requests(root, socket):
    driver, shim, proxy = root.stack()
    daemon = {"proxy": proxy, "driver": driver}[socket]
    time.sleep(1)  # the daemon's start-up work settles
    result = burst(daemon.socket, daemon.proc.pid, large_request(4 * 1024 * 1024 - 256), ROUNDS, CONCURRENCY)
    expected = {"proxy": "RESOURCE_EXHAUSTED", "driver": "INVALID_ARGUMENT"}[socket]
    assert result["codes"] == {expected: ROUNDS * CONCURRENCY}
    # Before: 300 MiB more after ten rounds, and none of it given back.
    assert result["rss_max_mib"] < result["rss_before_mib"] + 200, result
    assert result["rss_settled_mib"] < result["rss_before_mib"] + 40, result
    assert rss_mib(daemon.proc.pid) < result["rss_before_mib"] + 40
    # And it still serves.
    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=10)
