"""The CSI calls the shim and the proxy forward unchanged, through real
`crust shim` and `crust proxy` processes in front of a small gRPC backend
that shows what reached it: bytes, metadata both ways, deadline, status,
metrics, and a graceful stop that lets a forwarded call finish.

(Unknown methods and streams, which take the passthrough's other path, are
covered in tests/integration/test_shim_passthrough.py.)
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2
from crust.csi_shim.passthrough import PLUGIN_ANSWER_SECONDS, unary_methods
from tests.harness.daemons import UnixGrpcServer, csi_unary_handler, scrape_metrics

Code = grpc.StatusCode
RPC = csi_pb2.NodeServiceCapability.RPC
LIST = "/csi.v1.Controller/ListVolumes"
GET = "/csi.v1.Controller/ControllerGetVolume"
INFO = "/csi.v1.Node/NodeGetInfo"


@dataclass
class Backend(UnixGrpcServer):
    """A CSI backend whose ListVolumes, ControllerGetVolume and NodeGetInfo
    are raw (bytes in, bytes out) and record what they were sent."""

    socket: Path
    info_delay: float = 0.0
    seen: list[dict] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    server: grpc.Server | None = None

    def start(self) -> Backend:
        def plugin_info(request, context):
            return csi_pb2.GetPluginInfoResponse(name="raw.csi.example", vendor_version="1.2.3")

        def node_caps(request, context):
            return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
                csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=RPC.STAGE_UNSTAGE_VOLUME))])

        def record(request: bytes, context) -> None:
            self.seen.append({"request": request, "metadata": list(context.invocation_metadata()),
                              "time_remaining": context.time_remaining()})

        def list_volumes(request: bytes, context):
            record(request, context)
            context.send_initial_metadata((("x-initial", "i"),))
            context.set_trailing_metadata((("x-trailer", "t"), ("x-bin-bin", b"\x00\xff")))
            return b"\x12\x04next" + request  # any bytes: nobody between parses them

        def get_volume(request: bytes, context):
            record(request, context)
            context.set_trailing_metadata((("x-why", "gone"),))
            context.abort(Code.NOT_FOUND, "volume vol-x: not here")

        def node_info(request: bytes, context):
            record(request, context)
            self.started.set()
            time.sleep(self.info_delay)
            return csi_pb2.NodeGetInfoResponse(node_id="slow-node").SerializeToString()

        raw = {"request_deserializer": None, "response_serializer": None}
        self.serve(lambda server: server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("csi.v1.Identity", {
                "GetPluginInfo": csi_unary_handler(plugin_info, "GetPluginInfo")}),
            grpc.method_handlers_generic_handler("csi.v1.Node", {
                "NodeGetCapabilities": csi_unary_handler(node_caps, "NodeGetCapabilities"),
                "NodeGetInfo": grpc.unary_unary_rpc_method_handler(node_info, **raw)}),
            grpc.method_handlers_generic_handler("csi.v1.Controller", {
                "ListVolumes": grpc.unary_unary_rpc_method_handler(list_volumes, **raw),
                "ControllerGetVolume": grpc.unary_unary_rpc_method_handler(get_volume, **raw)}),
        )))
        return self



@pytest.fixture
def backend(root):
    b = Backend(socket=root.path / "raw.sock").start()
    yield b
    b.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calls(metrics: dict, component: str, method: str, code: str) -> float:
    return metrics.get(("crust_rpc_duration_seconds_count",
                        (("code", code), ("component", component), ("method", method))), 0)


def test_the_csi_methods_forwarded_as_unary_calls_are_all_but_the_streaming_ones():
    methods = unary_methods()
    assert LIST in methods and GET in methods and "/csi.v1.Node/NodePublishVolume" in methods
    assert "/csi.v1.SnapshotMetadata/GetMetadataAllocated" not in methods
    assert "/csi.v1.SnapshotMetadata/GetMetadataDelta" not in methods
    declared = sum(len(s.methods) for s in csi_pb2.DESCRIPTOR.services_by_name.values())
    assert len(methods) == len(set(methods)) == declared - 2


def test_known_methods_cross_both_hops_unchanged_and_are_counted(root, backend):
    shim_port, proxy_port = free_port(), free_port()
    shim = root.shim(backend, extra=["--metrics-port", str(shim_port)]).start()
    proxy = root.proxy(shim, extra=["--metrics-port", str(proxy_port)]).start()
    payload = b"\x08\x05\x12\x03abc"  # ListVolumesRequest(max_entries=5, starting_token="abc")

    for door in (shim, proxy):
        before = len(backend.seen)
        response, call = door.channel.unary_unary(LIST).with_call(
            payload, metadata=(("x-test", door.endpoint_name),), timeout=5)
        assert response == b"\x12\x04next" + payload
        seen = backend.seen[before]
        assert seen["request"] == payload
        assert ("x-test", door.endpoint_name) in seen["metadata"]
        # Each hop forwards a little less than what it had left, never more.
        assert 3 < seen["time_remaining"] < 5
        assert ("x-initial", "i") in call.initial_metadata()
        trailing = tuple(call.trailing_metadata())
        assert ("x-trailer", "t") in trailing and ("x-bin-bin", b"\x00\xff") in trailing

        with pytest.raises(grpc.RpcError) as info:
            door.channel.unary_unary(GET)(b"\x0a\x05vol-x", timeout=5)
        assert (info.value.code(), info.value.details()) == (Code.NOT_FOUND, "volume vol-x: not here")
        assert ("x-why", "gone") in tuple(info.value.trailing_metadata())

    # Identity passes through both: the backend's name, unchanged.
    assert proxy.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=5).name == "raw.csi.example"

    # Counted like served calls, by method and final code (the shim saw
    # each call twice: once directly, once from the proxy).
    at_shim, at_proxy = scrape_metrics(shim_port), scrape_metrics(proxy_port)
    assert calls(at_shim, "shim", LIST, "OK") == 2 and calls(at_shim, "shim", GET, "NOT_FOUND") == 2
    assert calls(at_proxy, "proxy-csi", LIST, "OK") == 1 and calls(at_proxy, "proxy-csi", GET, "NOT_FOUND") == 1


def test_a_stopping_shim_lets_a_forwarded_call_finish(root, backend):
    backend.info_delay = 1.0
    shim = root.shim(backend).start()
    pending = shim.channel.unary_unary(INFO).future(b"", timeout=10)
    assert backend.started.wait(5)
    shim.proc.send_signal(signal.SIGTERM)
    answer = csi_pb2.NodeGetInfoResponse.FromString(pending.result(timeout=10))
    assert answer.node_id == "slow-node"
    assert shim.proc.wait(15) == 0


CTRL_CAPS = "/csi.v1.Controller/ControllerGetCapabilities"
PROBE = "/csi.v1.Identity/Probe"
CtrlRPC = csi_pb2.ControllerServiceCapability.RPC


@dataclass
class PluginBackend(UnixGrpcServer):
    """A CSI backend that counts the calls reaching it and answers
    ControllerGetCapabilities with the capabilities it is started with."""

    socket: Path
    controller_caps: tuple[int, ...]
    reached: dict[str, int] = field(default_factory=dict)
    server: grpc.Server | None = None

    def start(self) -> PluginBackend:
        def counted(name, answer):
            def handler(request, context):
                self.reached[name] = self.reached.get(name, 0) + 1
                return answer()
            return csi_unary_handler(handler, name)

        self.serve(lambda server: server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler("csi.v1.Identity", {
                "GetPluginInfo": counted("GetPluginInfo", lambda: csi_pb2.GetPluginInfoResponse(
                    name="counted.csi.example", vendor_version="1")),
                "Probe": counted("Probe", csi_pb2.ProbeResponse)}),
            grpc.method_handlers_generic_handler("csi.v1.Node", {
                "NodeGetCapabilities": counted("NodeGetCapabilities", csi_pb2.NodeGetCapabilitiesResponse)}),
            grpc.method_handlers_generic_handler("csi.v1.Controller", {
                "ControllerGetCapabilities": counted("ControllerGetCapabilities", lambda: (
                    csi_pb2.ControllerGetCapabilitiesResponse(capabilities=[
                        csi_pb2.ControllerServiceCapability(rpc=CtrlRPC(type=cap))
                        for cap in self.controller_caps])))}),
        )))
        return self


def controller_caps(door) -> set[int]:
    answer = door.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest(), timeout=5)
    return {c.rpc.type for c in answer.capabilities}


def wait_for(predicate, timeout: float) -> float:
    """Seconds until predicate() held; fails after timeout."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - started


def test_the_plugins_own_answers_are_kept_per_connection_and_renewed_after_a_restart(root):
    """ControllerGetCapabilities (asked before nearly every call by
    csi-sanity, like NodeGetCapabilities by kubelet) is answered by the hop in
    front of the plugin while its connection lasts: a restarted plugin's new
    answer is served at once by the shim, whose connection it broke, and
    within PLUGIN_ANSWER_SECONDS by the proxy, whose connection to the shim
    did not break. Probe and errors are never kept."""
    old_caps, new_caps = (CtrlRPC.CREATE_DELETE_VOLUME,), (CtrlRPC.CREATE_DELETE_VOLUME, CtrlRPC.EXPAND_VOLUME)
    backend = PluginBackend(socket=root.path / "plugin.sock", controller_caps=old_caps).start()
    restarted = None
    try:
        shim = root.shim(backend).start()
        proxy = root.proxy(shim).start()
        started = time.monotonic()
        for _ in range(20):
            assert controller_caps(proxy) == set(old_caps)
            assert controller_caps(shim) == set(old_caps)
            proxy.identity.Probe(csi_pb2.ProbeRequest(), timeout=5)
        # The first answers over each hop are asked for while the watch on
        # the connection is being set up; from then on they are kept, and
        # asked for again (by each hop) once PLUGIN_ANSWER_SECONDS passed.
        renewals = int((time.monotonic() - started) // PLUGIN_ANSWER_SECONDS)
        assert 1 <= backend.reached["ControllerGetCapabilities"] <= 3 + 2 * renewals  # of 40 asked
        # Probe asks the plugin every time (the proxy's own start probes once more).
        assert backend.reached["Probe"] >= 20
        # A request with fields (none of these methods has any: a newer CSI,
        # or junk) is forwarded every time, never kept: nothing grows with
        # what callers send.
        before = backend.reached["ControllerGetCapabilities"]
        for junk in (b"\x08\x01", b"\x08\x02", b"\x08\x02"):
            shim.channel.unary_unary(CTRL_CAPS)(junk, timeout=5)
        assert backend.reached["ControllerGetCapabilities"] == before + 3

        backend.stop()
        wait_for(lambda: shim.channel is not None and not shim_reaches(shim), 10)
        restarted = PluginBackend(socket=backend.socket, controller_caps=new_caps).start()
        # The shim's connection to the plugin broke: its first answer once it
        # reconnects (gRPC's backoff) is the new one.
        answers = []
        wait_for(lambda: answers.append(caps_or_none(shim)) or answers[-1] is not None, 10)
        assert answers[-1] == set(new_caps)
        assert restarted.reached["ControllerGetCapabilities"] == 1
        # The proxy's connection to the shim did not: the new answer reaches
        # it once its kept one is older than PLUGIN_ANSWER_SECONDS.
        waited = wait_for(lambda: controller_caps(proxy) == set(new_caps), 10)
        assert waited <= PLUGIN_ANSWER_SECONDS + 1
    finally:
        for server in (backend, restarted):
            if server is not None:
                server.stop()


def caps_or_none(door) -> set[int] | None:
    """The controller capabilities, or None while the plugin is unreachable."""
    try:
        return controller_caps(door)
    except grpc.RpcError as exc:
        assert exc.code() == Code.UNAVAILABLE
        return None


def shim_reaches(shim) -> bool:
    """Whether the shim still reaches a plugin (its Probe is forwarded)."""
    try:
        shim.identity.Probe(csi_pb2.ProbeRequest(), timeout=2)
        return True
    except grpc.RpcError:
        return False
