"""A small Runtime API server for tests (a stand-in for the crust proxy).

It is a real gRPC server on a real unix socket that answers
RuntimeGetVolumeStats and RuntimeExpandVolume from a table the test fills,
and records every call, so tests can assert what the shim asked for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import csi_pb2, runtime_pb2, runtime_pb2_grpc
from tests.harness.daemons import UnixGrpcServer


@dataclass
class RuntimeServer(runtime_pb2_grpc.RuntimeServicer, UnixGrpcServer):
    socket: Path
    stats: dict[str, runtime_pb2.RuntimeGetVolumeStatsResponse] = field(default_factory=dict)
    expanded_to: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    server: grpc.Server | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> "RuntimeServer":
        self.serve(lambda server: runtime_pb2_grpc.add_RuntimeServicer_to_server(self, server))
        return self


    def RuntimeGetVolumeStats(self, request, context):
        with self.lock:
            self.calls.append(("stats", request.volume_target_path))
        answer = self.stats.get(request.volume_target_path)
        if answer is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox holds {request.volume_target_path}")
        return answer

    def RuntimeExpandVolume(self, request, context):
        with self.lock:
            self.calls.append(("expand", request.volume_target_path))
        size = request.capacity_range.required_bytes
        self.expanded_to[request.volume_target_path] = size
        return runtime_pb2.RuntimeExpandVolumeResponse(capacity_bytes=size)


def usage_response(total: int, used: int, abnormal: bool = False) -> runtime_pb2.RuntimeGetVolumeStatsResponse:
    Usage = csi_pb2.VolumeUsage
    return runtime_pb2.RuntimeGetVolumeStatsResponse(
        usage=[Usage(unit=Usage.BYTES, total=total, used=used, available=total - used)],
        volume_condition=csi_pb2.VolumeCondition(abnormal=abnormal, message="from the sandbox"),
    )
