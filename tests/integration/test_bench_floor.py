"""The floor under crust's costs, as the benchmarks measure it: bare hops
(bench/lib/bare_hop.py, what bench/csi/conformance_ratio.py and
bench/csi/hop_cost.py put in front of `crust driver`) and bench/csi/call_cpu.py
(CPU per call, call by call). Each is run for real, briefly; the hops must
leave nothing behind."""

from __future__ import annotations

import grpc
import pytest

from bench.lib.stack import BareHop
from crust.api import csi_pb2, csi_pb2_grpc
from tests.harness.bench_run import run_bench
from tests.harness.daemons import Root, pid_alive


@pytest.mark.parametrize("stack", ["aio", "sync"])
def test_bare_hops_forward_to_the_driver_and_leave_nothing(stack):
    root = Root()
    try:
        chain = [root.driver().start()]
        for n in (1, 2):
            hop = BareHop(root.path / f"bare-hop-{n}.sock", chain[-1].socket, stack)
            root.drivers.append(hop)  # stopped by the root, the front first
            chain.append(hop.start())
        pids = [d.proc.pid for d in chain]
        assert len(set(pids)) == 3 and all(pid_alive(pid) for pid in pids)
        with grpc.insecure_channel(f"unix://{chain[-1].socket}") as channel:
            controller = csi_pb2_grpc.ControllerStub(channel)
            # A real call through both hops, and a refusal of the driver's
            # (its status and message) back unchanged.
            caps = controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest(), timeout=30)
            assert caps.capabilities
            with pytest.raises(grpc.RpcError) as refused:
                controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "volume_id" in refused.value.details()
        hop_sockets = [root.path / "bare-hop-1.sock", root.path / "bare-hop-2.sock"]
        assert all(s.exists() for s in hop_sockets)
        hops = [d.proc for d in chain[1:]]
    finally:
        root.close()
    # Stopped in order (SIGTERM, a clean exit), nothing left running or listening.
    assert [hop.returncode for hop in hops] == [0, 0]
    assert not [pid for pid in pids if pid_alive(pid)]
    assert not [s for s in hop_sockets if s.exists()] and not root.path.exists()


def test_call_cpu_reports_every_call(tmp_path):
    calls = run_bench("bench/csi/call_cpu.py", "--targets", "driver", "--calls", "5", "--volumes", "1",
                      out=tmp_path / "calls.json")["calls"]
    assert set(calls) == {"Probe", "ControllerGetCapabilities", "ListVolumes", "CreateVolume+DeleteVolume",
                          "CreateSnapshot+DeleteSnapshot", "ControllerPublish+Unpublish"}
    assert all(row["driver"]["cpu_ms"] > 0 and row["driver"]["wall_ms_median"] > 0 for row in calls.values())
