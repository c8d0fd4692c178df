"""Client of the proxy's Runtime API (specs/runtime.proto).

The shim cannot see the file system of a deferred volume; it asks the proxy,
which asks the runtime handler that mounted the volume in its sandbox.
"""

from __future__ import annotations

import grpc

from crust.api import csi_pb2, runtime_pb2, runtime_pb2_grpc
from crust.common.channel import local_aio_channel
from crust.common.errors import Forwarded, Unavailable
from crust.csi_shim.passthrough import forward_timeout

_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE}


class RuntimeClient:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.channel = local_aio_channel(endpoint)
        self.stub = runtime_pb2_grpc.RuntimeStub(self.channel)

    async def _call(self, method, request, context, timeout: float | None = None):
        if timeout is None:
            timeout = forward_timeout(context) if context is not None else 30.0
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            # A connected channel means the proxy itself answered UNAVAILABLE
            # (the handler holding the volume did not answer): its words, not ours.
            answered = self.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY
            if exc.code() in _UNREACHABLE and not answered:
                raise Unavailable(f"the crust proxy at {self.endpoint} is unreachable ({exc.details()}); "
                                  "stats, expansion and freezes of a deferred volume need it") from None
            raise Forwarded.from_rpc_error(exc) from None

    async def stats(self, target_path: str, context) -> runtime_pb2.RuntimeGetVolumeStatsResponse:
        return await self._call(self.stub.RuntimeGetVolumeStats,
                                runtime_pb2.RuntimeGetVolumeStatsRequest(volume_target_path=target_path), context)

    async def expand(self, target_path: str, capacity_range: csi_pb2.CapacityRange | None, context) -> int:
        request = runtime_pb2.RuntimeExpandVolumeRequest(volume_target_path=target_path)
        if capacity_range is not None:
            request.capacity_range.CopyFrom(capacity_range)
        response = await self._call(self.stub.RuntimeExpandVolume, request, context)
        return response.capacity_bytes

    async def freeze(self, volume_id: str, timeout_seconds: int, policy: str, call_timeout: float) -> list:
        """The volume's targets in sandboxes of this node, frozen or not (none: no sandbox has it)."""
        response = await self._call(self.stub.RuntimeFreezeVolume, runtime_pb2.RuntimeFreezeVolumeRequest(
            volume_id=volume_id, timeout_seconds=timeout_seconds, policy=policy), None, call_timeout)
        return list(response.frozen)

    async def thaw(self, volume_id: str, targets: list[str], call_timeout: float) -> list:
        response = await self._call(self.stub.RuntimeThawVolume, runtime_pb2.RuntimeThawVolumeRequest(
            volume_id=volume_id, volume_target_paths=targets), None, call_timeout)
        return list(response.thawed)

    async def close(self) -> None:
        await self.channel.close()
