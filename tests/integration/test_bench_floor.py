"""The benchmarks that measure the floor under crust's costs:
bench/csi/conformance_ratio.py's bare-hop targets (bench/lib/bare_hop.py in front of
`crust driver`) and bench/csi/call_cpu.py (CPU per call, call by call). Each is
run for real, briefly, and must leave nothing behind."""

from __future__ import annotations

import json

import grpc
import pytest

from bench.csi import call_cpu

from bench.csi import conformance_ratio
from crust.api import csi_pb2, csi_pb2_grpc
from tests.harness.daemons import pid_alive


@pytest.mark.parametrize("stack", ["aio", "sync"])
def test_bare_hops_forward_to_the_driver_and_leave_nothing(stack):
    args = conformance_ratio.parse_args(["--targets", "bare-hops", "--bare-stack", stack])
    run = conformance_ratio.Run("bare-hops", args)
    closed = False
    try:
        socket, pids = run.start()
        assert run.daemon_names(pids) == ["driver", "bare hop", "bare hop 2"]
        assert len(set(pids)) == 3 and all(pid_alive(pid) for pid in pids)
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            controller = csi_pb2_grpc.ControllerStub(channel)
            # A real call through both hops, and a refusal of the driver's
            # (its status and message) back unchanged.
            caps = controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest(), timeout=30)
            assert caps.capabilities
            with pytest.raises(grpc.RpcError) as refused:
                controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "volume_id" in refused.value.details()
        hop_sockets = [run.root.path / "bare-hop-1.sock", run.root.path / "bare-hop-2.sock"]
        assert all(s.exists() for s in hop_sockets)
        hops = [d.proc for d in run.root.drivers[-2:]]
        assert [p.pid for p in hops] == pids[1:]
        closed = run.close()
        assert closed
        # Stopped in order (SIGTERM, a clean exit), not left to the
        # benchmark's last resort for stragglers.
        assert [hop.returncode for hop in hops] == [0, 0]
        assert not [pid for pid in pids if pid_alive(pid)]
        assert not [s for s in hop_sockets if s.exists()]
    finally:
        if not closed:
            run.close()


def test_call_cpu_reports_every_call_and_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "calls.json"
    made: list[call_cpu.Target] = []

    class Recorded(call_cpu.Target):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

    monkeypatch.setattr(call_cpu, "Target", Recorded)
    assert call_cpu.main(["--targets", "driver", "--calls", "5", "--volumes", "1", "--json", str(out)]) == 0
    calls = json.loads(out.read_text())["calls"]
    assert set(calls) == {"Probe", "ControllerGetCapabilities", "ListVolumes", "CreateVolume+DeleteVolume",
                          "CreateSnapshot+DeleteSnapshot", "ControllerPublish+Unpublish"}
    assert all(row["driver"]["cpu_ms"] > 0 and row["driver"]["wall_ms_median"] > 0 for row in calls.values())
    # Its daemons are stopped and its temporary root (volumes, records, sockets) is gone.
    assert len(made) == 1 and made[0].pids
    assert not [pid for pid in made[0].pids if pid_alive(pid)]
    assert not made[0].root.path.exists()
