"""The runtime's side of the handler's ContainerVolumes service."""

from __future__ import annotations

import os

import grpc

from crust.api import handler_pb2, handler_pb2_grpc
from crust.common.channel import local_channel
from crust.oci_runtime.main import RuntimeFailure

# A claim goes through the proxy's registry; a deferred entry kubelet just
# published may take the handler a few seconds to see.
PREPARE_TIMEOUT = 60.0
CALL_TIMEOUT = 30.0


class HandlerClient:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.channel = local_channel(endpoint)
        self.stub = handler_pb2_grpc.ContainerVolumesStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def _call(self, method: str, request, timeout: float = CALL_TIMEOUT):
        try:
            return getattr(self.stub, method)(request, timeout=timeout, wait_for_ready=False)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise RuntimeFailure(f"the crust handler at {self.endpoint} is unreachable ({exc.details()}): "
                                     "deferred volumes cannot be mounted without it") from None
            raise RuntimeFailure(f"crust handler: {exc.code().name}: {exc.details()}") from None

    def prepare(self, container_id: str, sandbox_id: str, bundle: str, mounts: list[dict]):
        request = handler_pb2.PrepareContainerRequest(
            container_id=container_id, sandbox_id=sandbox_id, bundle=bundle, runtime_pid=os.getpid(),
            mounts=[handler_pb2.ContainerMount(destination=m.get("destination", ""), type=m.get("type", ""),
                                               source=m.get("source", ""), options=m.get("options") or [])
                    for m in mounts])
        return list(self._call("PrepareContainer", request, PREPARE_TIMEOUT).mounts)

    def created(self, container_id: str, pid: int) -> None:
        self._call("ContainerCreated", handler_pb2.ContainerCreatedRequest(container_id=container_id, pid=pid))

    def release(self, container_id: str) -> None:
        self._call("ReleaseContainer", handler_pb2.ReleaseContainerRequest(container_id=container_id))
