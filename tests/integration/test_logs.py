"""What a daemon's structured log says about the calls it serves: one line
per call when it ends, naming the request (secrets stripped), its outcome
and its time; one more while a slow call runs; the plugin's description
reads only at debug."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common import grpcserver
from crust.common.redact import MASK


def lines_of(log_path, request_id: str) -> list[dict]:
    found = []
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("request_id") == request_id:
            found.append(entry)
    return found


def test_a_served_call_is_one_line_when_it_ends_naming_its_request_without_secrets(driver):
    cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                   access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
    driver.controller.CreateVolume.with_call(
        csi_pb2.CreateVolumeRequest(name="logged", volume_capabilities=[cap], secrets={"token": "s3cret"}),
        metadata=(("x-request-id", "req-ok"),), timeout=10)
    try:
        driver.controller.DeleteVolume.with_call(csi_pb2.DeleteVolumeRequest(volume_id=""),
                                                 metadata=(("x-request-id", "req-bad"),), timeout=10)
        raise AssertionError("DeleteVolume without a volume_id succeeded")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
    driver.controller.ControllerGetCapabilities.with_call(
        csi_pb2.ControllerGetCapabilitiesRequest(), metadata=(("x-request-id", "req-caps"),), timeout=10)

    (ok,) = [e for e in lines_of(driver.log_path, "req-ok") if e["logger"] == "crust.rpc"]
    assert (ok["level"], ok["msg"], ok["rpc"], ok["component"]) == ("info", "ok", "CreateVolume", "driver")
    assert ok["request"]["name"] == "logged" and ok["request"]["secrets"] == {"token": MASK}
    assert "s3cret" not in driver.log_path.read_text()
    assert ok["ms"] > 0

    (failed,) = lines_of(driver.log_path, "req-bad")
    assert (failed["level"], failed["msg"], failed["code"]) == ("warning", "failed", "INVALID_ARGUMENT")
    assert "volume_id" in failed["error"] and failed["request"] == {}

    # The plugin's description is read before nearly every call: debug only.
    assert lines_of(driver.log_path, "req-caps") == []


class _Slow(csi_pb2_grpc.ControllerServicer):
    async def ListVolumes(self, request, context):
        await asyncio.sleep(1.0)
        return csi_pb2.ListVolumesResponse(next_token="done")


async def test_a_slow_call_is_logged_while_it_runs_and_when_it_ends(root, monkeypatch, caplog):
    monkeypatch.setattr(grpcserver, "SLOW_CALL_SECONDS", 0.1)
    caplog.set_level(logging.INFO, logger="crust.rpc")
    daemon = grpcserver.Daemon("slow", f"unix://{root.path / 'slow.sock'}", ["csi.v1.Controller"])
    csi_pb2_grpc.add_ControllerServicer_to_server(_Slow(), daemon.server)
    await daemon.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{root.path / 'slow.sock'}") as channel:
            answer = await csi_pb2_grpc.ControllerStub(channel).ListVolumes(
                csi_pb2.ListVolumesRequest(max_entries=3), timeout=10)
        assert answer.next_token == "done"
    finally:
        await daemon.stop(grace=1)
    lines = [(r.getMessage(), r.fields) for r in caplog.records
             if r.name == "crust.rpc" and r.getMessage() in ("still running", "ok")]
    assert [message for message, _ in lines] == ["still running", "ok"]
    (_, running), (_, ended) = lines
    assert running["request"] == ended["request"] == {"max_entries": 3}
    assert 0.1 <= running["s"] < 1.0 and ended["ms"] >= 1000
