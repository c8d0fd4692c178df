"""`crust shim` end to end, what it forwards and what it refuses: methods it
does not know pass through to the backend byte for byte, RPCs it does not
change answer exactly what the driver answers, bad input is refused naming
the field, an oversized request is refused before it reaches the driver, and
the node capabilities it advertises. The set-up is tests/harness/shim.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from tests.harness.daemons import UnixGrpcServer, block_cap, csi_unary_handler, mount_cap
from tests.harness.shim import RPC, SIZE, Code, deferred_cap, fails, publish_req, stage_req, start_runtime
from tests.harness.shim import env  # noqa: F401 - a fixture


# -- byte-level passthrough -------------------------------------------------------------------


@dataclass
class FakeBackend(UnixGrpcServer):
    """A minimal CSI backend (sync gRPC server) with a method no CSI version has."""

    socket: Path
    seen: list[dict] = field(default_factory=list)
    server: grpc.Server | None = None

    def start(self) -> "FakeBackend":
        def plugin_info(request, context):
            return csi_pb2.GetPluginInfoResponse(name="fake.csi.example", vendor_version="0.0.1")

        def node_caps(request, context):
            return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
                csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=RPC.STAGE_UNSTAGE_VOLUME))])

        def echo(request: bytes, context):
            self.seen.append({"metadata": list(context.invocation_metadata()),
                              "time_remaining": context.time_remaining(), "request": request})
            context.send_initial_metadata((("x-initial", "i"),))
            context.set_trailing_metadata((("x-trailer", "t"), ("x-bin-bin", b"\x00\x01")))
            return request[::-1]

        def fail(request: bytes, context):
            self.seen.append({"metadata": list(context.invocation_metadata()), "request": request})
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "custom msg")

        def chat(requests, context):
            # A bidirectional stream: one reversed answer per message, then a count.
            count = 0
            for request in requests:
                count += 1
                yield request[::-1]
            yield str(count).encode()

        raw = {"request_deserializer": None, "response_serializer": None}
        self.serve(lambda server: server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("csi.v1.Identity", {
                "GetPluginInfo": csi_unary_handler(plugin_info, "GetPluginInfo")}),
            grpc.method_handlers_generic_handler("csi.v1.Node", {
                "NodeGetCapabilities": csi_unary_handler(node_caps, "NodeGetCapabilities")}),
            grpc.method_handlers_generic_handler("csi.v1.Future", {
                "Echo": grpc.unary_unary_rpc_method_handler(echo, **raw),
                "Fail": grpc.unary_unary_rpc_method_handler(fail, **raw),
                "Chat": grpc.stream_stream_rpc_method_handler(chat, **raw)}),
        )))
        return self



def test_unknown_methods_pass_through_byte_for_byte(root):
    backend = FakeBackend(socket=root.path / "fake.sock").start()
    try:
        shim = root.shim(backend).start()
        echo = shim.channel.unary_unary("/csi.v1.Future/Echo")
        payload = b"\x0a\x03abc\x00\xff not even protobuf"
        response, call = echo.with_call(payload, metadata=(("x-test", "v"),), timeout=5)
        assert response == payload[::-1]
        assert backend.seen[0]["request"] == payload
        assert ("x-test", "v") in backend.seen[0]["metadata"]
        assert 0 < backend.seen[0]["time_remaining"] <= 5
        assert ("x-initial", "i") in call.initial_metadata()
        trailing = tuple(call.trailing_metadata())
        assert ("x-trailer", "t") in trailing and ("x-bin-bin", b"\x00\x01") in trailing

        with pytest.raises(grpc.RpcError) as info:
            shim.channel.unary_unary("/csi.v1.Future/Fail")(b"x", metadata=(("x-test", "w"),), timeout=5)
        assert (info.value.code(), info.value.details()) == (Code.RESOURCE_EXHAUSTED, "custom msg")
        assert ("x-test", "w") in backend.seen[1]["metadata"]

        # A method the backend does not have either: its UNIMPLEMENTED comes
        # back, every time (the backend answers before reading the request,
        # which used to race with the shim's write: grpc-python issue #36066).
        nope = shim.channel.unary_unary("/csi.v1.Future/Nope")
        answers = []
        for _ in range(40):
            with pytest.raises(grpc.RpcError) as info:
                nope(b"abc", timeout=5)
            answers.append((info.value.code(), info.value.details()))
        assert set(answers) == {(Code.UNIMPLEMENTED, "Method not found!")}, set(answers)

        # Streams pass through too: a caller that keeps its stream open, and an empty stream.
        def slow():
            for part in (b"one", b"two", b"three"):
                yield part
                time.sleep(0.1)

        chat = shim.channel.stream_stream("/csi.v1.Future/Chat")
        assert list(chat(slow(), timeout=5)) == [b"eno", b"owt", b"eerht", b"3"]
        assert list(chat(iter(()), timeout=5)) == [b"0"]

        # Identity passes through: the shim keeps the backend's name.
        info = shim.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5)
        assert (info.name, info.vendor_version) == ("fake.csi.example", "0.0.1")
    finally:
        backend.stop()


def test_unchanged_rpcs_answer_exactly_what_the_driver_answers(env):
    for i, cap in enumerate([mount_cap("ext4"), block_cap(), mount_cap("xfs")]):
        env.create(f"list-{i}", cap=cap, size=SIZE["xfs"])
    for method, request in [
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest()),
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest(max_entries=2)),
        ("/csi.v1.Node/NodeGetInfo", csi_pb2.NodeGetInfoRequest()),
        ("/csi.v1.Identity/GetPluginInfo", csi_pb2.GetPluginInfoRequest()),
        ("/csi.v1.Controller/ControllerGetCapabilities", csi_pb2.ControllerGetCapabilitiesRequest()),
    ]:
        raw = request.SerializeToString()
        via_shim = env.shim.channel.unary_unary(method)(raw, timeout=30)
        direct = env.driver.channel.unary_unary(method)(raw, timeout=30)
        assert via_shim == direct, method
    # The comparison above compared something: all three volumes are listed.
    raw = env.shim.channel.unary_unary("/csi.v1.Controller/ListVolumes")(b"", timeout=30)
    assert len(csi_pb2.ListVolumesResponse.FromString(raw).entries) == 3


# -- input checks --------------------------------------------------------------------------------


BAD_PATHS = ["relative/path", "/a/../b", "/a/\x00b", "/a//b"]


def test_bad_input_is_refused_naming_the_field(env):
    vid = env.create("input", "ext4")
    staging = env.staging(vid)
    for bad in BAD_PATHS:
        fails(env.shim.node.NodeStageVolume, stage_req(vid, bad, mount_cap("ext4")),
              Code.INVALID_ARGUMENT, "staging_target_path")
    fails(env.shim.node.NodeStageVolume, stage_req(vid, staging, mount_cap("btrfs")),
          Code.INVALID_ARGUMENT, "fs_type", "btrfs")
    fails(env.shim.node.NodeStageVolume, stage_req(vid, staging, mount_cap(""), volume_context={"fsType": "zfs"}),
          Code.INVALID_ARGUMENT, "volume_context.fsType", "zfs")
    fails(env.shim.node.NodeStageVolume, stage_req(vid, staging, mount_cap("ext4", flags=["noatime,dev"])),
          Code.INVALID_ARGUMENT, "mount_flags[0]")
    # Nothing reached the backend.
    assert not env.loops(vid) and not env.record_file(vid).exists() and not env.private(vid).exists()

    env.stage(vid)
    target = env.target("a")
    for bad in BAD_PATHS:
        fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, bad, mount_cap("ext4"), defer=True),
              Code.INVALID_ARGUMENT, "target_path")
        fails(env.shim.node.NodePublishVolume, publish_req(vid, bad, target, mount_cap("ext4"), defer=True),
              Code.INVALID_ARGUMENT, "staging_target_path")
        fails(env.shim.node.NodeUnpublishVolume,
              csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=bad), Code.INVALID_ARGUMENT, "target_path")
    fails(env.shim.node.NodePublishVolume,
          publish_req(vid, staging, target, mount_cap("ext4", flags=["ro,exec"]), defer=True),
          Code.INVALID_ARGUMENT, "mount_flags[0]")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, target, deferred_cap(group="wheel"), defer=True),
          Code.INVALID_ARGUMENT, "volume_supplemental_group", "wheel")
    fails(env.shim.node.NodePublishVolume, publish_req(vid, staging, target, deferred_cap(policy="Sometimes"),
                                                       defer=True),
          Code.INVALID_ARGUMENT, "volume_supplemental_group_change_policy", "Sometimes")
    assert not target.exists() and env.record(vid)["published"] == {}
    env.unstage(vid)
    env.assert_released(vid)


def test_oversized_request_is_refused(root):
    runtime = start_runtime(root)
    try:
        driver = root.driver().start()
        shim = root.shim(driver, extra=["--max-request-bytes", "65536"]).start()
        req = csi_pb2.CreateVolumeRequest(name="huge", volume_capabilities=[mount_cap("ext4")],
                                          parameters={"blob": "x" * 100_000})
        with pytest.raises(grpc.RpcError) as info:
            shim.controller.CreateVolume(req, timeout=30)
        assert info.value.code() == Code.RESOURCE_EXHAUSTED
        assert driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=30).entries == []
        # A normal request still works.
        small = csi_pb2.CreateVolumeRequest(name="small", volume_capabilities=[mount_cap("ext4")],
                                            capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE["ext4"]))
        assert shim.controller.CreateVolume(small, timeout=30).volume.capacity_bytes == SIZE["ext4"]
    finally:
        runtime.stop()


# -- capabilities ---------------------------------------------------------------------------------


def node_caps(channel_owner) -> set[int]:
    resp = channel_owner.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
    return {c.rpc.type for c in resp.capabilities}


def test_node_capabilities(root):
    driver = root.driver().start()
    backend_caps = node_caps(driver)
    # VOLUME_MOUNT_GROUP: kubelet delegates fsGroup to the shim.
    own = {RPC.STAGE_UNSTAGE_VOLUME, RPC.GET_VOLUME_STATS, RPC.EXPAND_VOLUME, RPC.VOLUME_MOUNT_GROUP}
    deferral = {RPC.DEFER_FS_OPS, RPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP,
                RPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY}
    assert {int(c) for c in deferral} == {7, 8, 9}

    shim = root.shim(driver).start()
    assert node_caps(shim) == backend_caps | own | deferral
    shim.stop()

    quiet = root.shim(driver, endpoint_name="shim-quiet.sock", extra=["--no-advertise-deferral"]).start()
    caps = node_caps(quiet)
    assert caps == backend_caps | own
    assert not caps & {7, 8, 9}
