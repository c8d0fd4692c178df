"""Bytes that are not the method's message, on every crust server.

gRPC parses a request before any interceptor runs; a parse failure used to
end as UNKNOWN with a traceback in the daemon's log. Each socket of a real
stack (driver, shim, proxy CSI and runtime sockets, a mount-namespace
handler, the proxy's kubelet registration socket) gets, for every method it
serves, a bad varint, a string that is not UTF-8 and unknown groups nested
past the parser's limit: each must answer INVALID_ARGUMENT (or UNIMPLEMENTED
for a method the socket does not serve), no daemon logs a traceback, and
each still answers a valid request afterwards.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.internal.encoder import _VarintBytes
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from crust.api import csi_pb2, handler_pb2, pluginregistration_pb2, registry_pb2, runtime_pb2

Code = grpc.StatusCode

CSI = [csi_pb2.DESCRIPTOR.services_by_name[n] for n in
       ("Identity", "Controller", "GroupController", "Node", "SnapshotMetadata")]
# Every daemon also serves health (unary and server-streaming) and
# reflection (a bidirectional stream).
COMMON = [health_pb2.DESCRIPTOR.services_by_name["Health"],
          reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
SERVICES = {
    "driver": CSI + COMMON,
    "shim": CSI + COMMON,
    "proxy": CSI + COMMON,
    "runtime": [runtime_pb2.DESCRIPTOR.services_by_name["Runtime"],
                registry_pb2.DESCRIPTOR.services_by_name["Registry"], *COMMON],
    "handler": [handler_pb2.DESCRIPTOR.services_by_name["Handler"],
                handler_pb2.DESCRIPTOR.services_by_name["SandboxControl"], *COMMON],
    "registration": [pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"]],
}


def payloads(method) -> dict[str, bytes]:
    start, end = _VarintBytes((99 << 3) | 3), _VarintBytes((99 << 3) | 4)
    found = {
        # A varint of eleven continuation bytes (at most ten are allowed).
        "bad varint": _VarintBytes((1 << 3) | 0) + b"\xff" * 11,
        "nested 200 deep": start * 200 + end * 200,
    }
    strings = [f.number for f in method.input_type.fields if f.type == f.TYPE_STRING]
    if strings:  # (a request without string fields keeps such bytes as an unknown field)
        found["not UTF-8"] = _VarintBytes((strings[0] << 3) | 2) + b"\x02\xff\xfe"
    return found


def call_raw(channel: grpc.Channel, path: str, data: bytes, client_streaming: bool, server_streaming: bool):
    """Send raw bytes as one request of the method; returns the status code."""
    try:
        if client_streaming and server_streaming:
            list(channel.stream_stream(path)(iter([data]), timeout=10))
        elif server_streaming:
            list(channel.unary_stream(path)(data, timeout=10))
        elif client_streaming:
            channel.stream_unary(path)(iter([data]), timeout=10)
        else:
            channel.unary_unary(path)(data, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return Code.OK, ""


@pytest.fixture
def sockets(root):
    driver, shim, proxy = root.stack(proxy_extra=["--kubelet-registration-dir", str(root.path / "registry")])
    handler = root.handler(proxy).start()
    registration = root.path / "registry" / "loop.csi.crust.dev-reg.sock"
    return {"driver": driver.socket, "shim": shim.socket, "proxy": proxy.socket,
            "runtime": proxy.runtime_socket, "handler": handler.socket, "registration": registration}


def test_undecodable_requests_answer_invalid_argument_on_every_server(root, sockets):
    wrong = []
    for name, services in SERVICES.items():
        with grpc.insecure_channel(f"unix://{sockets[name]}") as channel:
            for service in services:
                for method in service.methods:
                    path = f"/{service.full_name}/{method.name}"
                    streaming = (method.client_streaming, method.server_streaming)
                    for what, data in payloads(method).items():
                        code, details = call_raw(channel, path, data, *streaming)
                        if code not in (Code.INVALID_ARGUMENT, Code.UNIMPLEMENTED):
                            wrong.append(f"{name} {path} {what}: {code.name} {details}")
                        elif code is Code.INVALID_ARGUMENT and "does not decode" not in details \
                                and name not in ("shim", "proxy"):
                            # The shim and the proxy forward methods they do not
                            # read; the backend answers for them.
                            wrong.append(f"{name} {path} {what}: refused for another reason: {details}")
            # Still serving, and answering valid requests.
            health = health_pb2_grpc.HealthStub(channel)
            if name != "registration":
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING
    assert not wrong, "\n".join(wrong)
    tracebacks = [f"{log.name}: {line[:300]}" for log in root.path.glob("*.log")
                  for line in log.read_text(errors="replace").splitlines() if "Traceback" in line]
    assert not tracebacks, "\n".join(tracebacks)


def test_undecodable_request_is_named_in_the_answer(root, sockets):
    method = csi_pb2.DESCRIPTOR.services_by_name["Node"].methods_by_name["NodeStageVolume"]
    with grpc.insecure_channel(f"unix://{sockets['driver']}") as channel:
        code, details = call_raw(channel, "/csi.v1.Node/NodeStageVolume", payloads(method)["not UTF-8"], False, False)
    assert code is Code.INVALID_ARGUMENT
    assert "csi.v1.NodeStageVolumeRequest" in details
