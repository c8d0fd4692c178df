"""A small runtime handler for tests: a real crust.handler.v1.Handler gRPC
server on a real unix socket (specs/handler.proto).

It answers from what the test sets (stats per target, sandbox states) and
records every call, so a test can check both what the proxy asked and that
the numbers kubelet got are the handler's. `register()` and `claim()` talk
to the proxy's registry like a real handler would.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc, registry_pb2, registry_pb2_grpc
from tests.harness.daemons import UnixGrpcServer

Usage = csi_pb2.VolumeUsage
SandboxState = handler_pb2.GetSandboxResponse


def stats_response(total: int, used: int, inodes: int = 0, inodes_used: int = 0, abnormal: bool = False,
                   message: str = "from the test handler") -> handler_pb2.GetVolumeStatsResponse:
    usage = [Usage(unit=Usage.BYTES, total=total, used=used, available=total - used)]
    if inodes:
        usage.append(Usage(unit=Usage.INODES, total=inodes, used=inodes_used, available=inodes - inodes_used))
    return handler_pb2.GetVolumeStatsResponse(
        usage=usage, volume_condition=csi_pb2.VolumeCondition(abnormal=abnormal, message=message))


@dataclass
class HandlerServer(handler_pb2_grpc.HandlerServicer, UnixGrpcServer):
    socket: Path
    name: str = "test-handler"
    filesystems: list[str] = field(default_factory=lambda: ["ext4", "xfs"])
    features: list[str] = field(default_factory=lambda: ["stats", "expand"])
    # Answer per target path; `default_stats` for any other target (None: NOT_FOUND).
    stats: dict[str, handler_pb2.GetVolumeStatsResponse] = field(default_factory=dict)
    default_stats: handler_pb2.GetVolumeStatsResponse | None = None
    # Sandbox id -> state; unknown sandboxes answer `default_sandbox_state`.
    sandboxes: dict[str, int] = field(default_factory=dict)
    default_sandbox_state: int = SandboxState.RUNNING
    # (method, target path or sandbox id, sandbox id or "") of every call.
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    expand_requests: list[handler_pb2.ExpandVolumeRequest] = field(default_factory=list)
    lease_id: str = ""
    server: grpc.Server | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> "HandlerServer":
        self.serve(lambda server: handler_pb2_grpc.add_HandlerServicer_to_server(self, server))
        return self


    def __enter__(self) -> "HandlerServer":
        return self.start() if self.server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- the Handler service ----------------------------------------------------------

    def GetVolumeStats(self, request, context):
        with self.lock:
            self.calls.append(("GetVolumeStats", request.target_path, request.sandbox_id))
        answer = self.stats.get(request.target_path, self.default_stats)
        if answer is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox of {self.name} mounts {request.target_path}")
        return answer

    def ExpandVolume(self, request, context):
        with self.lock:
            self.calls.append(("ExpandVolume", request.target_path, request.sandbox_id))
            self.expand_requests.append(request)
        return handler_pb2.ExpandVolumeResponse(capacity_bytes=request.capacity_range.required_bytes)

    def GetSandbox(self, request, context):
        with self.lock:
            self.calls.append(("GetSandbox", request.sandbox_id, ""))
        return handler_pb2.GetSandboxResponse(state=self.sandboxes.get(request.sandbox_id,
                                                                      self.default_sandbox_state))

    # -- talking to the proxy's registry ------------------------------------------------

    def register(self, channel: grpc.Channel, keep_lease: bool = False) -> registry_pb2.RegisterHandlerResponse:
        """Register; with keep_lease, present the lease of the last
        registration (a restarted handler coming back)."""
        rsp = registry_pb2_grpc.RegistryStub(channel).RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name=self.name, endpoint=self.endpoint, filesystems=self.filesystems, features=self.features,
            lease_id=self.lease_id if keep_lease else ""), timeout=10)
        self.lease_id = rsp.lease_id
        return rsp

    def heartbeat(self, channel: grpc.Channel) -> registry_pb2.HeartbeatResponse:
        return registry_pb2_grpc.RegistryStub(channel).Heartbeat(
            registry_pb2.HeartbeatRequest(name=self.name, lease_id=self.lease_id), timeout=10)

    def claim(self, channel: grpc.Channel, target: str | Path, sandbox_id: str,
              sandbox_pid: int = 0) -> registry_pb2.ClaimVolumeResponse:
        return registry_pb2_grpc.RegistryStub(channel).ClaimVolume(registry_pb2.ClaimVolumeRequest(
            target_path=str(target), handler=self.name, sandbox_id=sandbox_id, sandbox_pid=sandbox_pid,
            lease_id=self.lease_id), timeout=10)

    def release(self, channel: grpc.Channel, target: str | Path, sandbox_id: str) -> None:
        registry_pb2_grpc.RegistryStub(channel).ReleaseVolume(registry_pb2.ReleaseVolumeRequest(
            target_path=str(target), handler=self.name, sandbox_id=sandbox_id, lease_id=self.lease_id),
            timeout=10)
