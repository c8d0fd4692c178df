"""The shim's client of the microVM handler's PodRuntime, in ttrpc.

The handler serves PodRuntime (specs/handler.proto) in gRPC on its
endpoint and in ttrpc on `<endpoint path>.ttrpc` (crust.kata.pod.ttrpc_endpoint).
The shim, a process that lives as long as its pod, speaks the latter: it
speaks ttrpc to containerd already, and importing grpc would be a third of
its memory. Unary calls share one connection (made again once it broke);
each output stream has a connection of its own, read only as fast as the
shim writes the fifos, so a stalled reader holds back its own stream and
nothing else. A handler that is not there (restarting) is UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from google.protobuf import message_factory

from crust.api import handler_pb2
from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError
from crust.common.ttrpc_client import Client

TTRPC_SUFFIX = ".ttrpc"
SERVICE = handler_pb2.DESCRIPTOR.services_by_name["PodRuntime"]
# OutputChunks a stream's connection keeps for the shim (each at most the
# guest's largest read, 1 MiB), and about half of what it reads ahead of
# them; beyond that the socket's buffers, then the handler waits.
STREAM_QUEUE = 2
STREAM_BUFFER = 1 << 20


def ttrpc_path(endpoint: str) -> str:
    """The ttrpc socket of the handler whose gRPC endpoint this is."""
    return endpoint.removeprefix("unix://") + TTRPC_SUFFIX


class HandlerClient:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.path = ttrpc_path(endpoint)
        self._responses = {m.name: message_factory.GetMessageClass(m.output_type) for m in SERVICE.methods}
        self._client: Client | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self, **options) -> Client:
        try:
            return await Client.connect(self.path, **options)
        except OSError as exc:
            raise TtrpcError(ttrpc.UNAVAILABLE, f"the handler's ttrpc socket {self.path}: {exc}") from None

    async def _shared(self) -> Client:
        async with self._connecting:
            if self._client is None or self._client.closed:
                if self._client is not None:
                    await self._client.close()
                    self._client = None
                self._client = await self._connect()
            return self._client

    async def call(self, method: str, request, timeout: float | None = None):
        """One unary PodRuntime call; the handler's status as a TtrpcError."""
        client = await self._shared()
        return await client.call(SERVICE.full_name, method, request, self._responses[method], timeout)

    async def read_output(self, request: handler_pb2.ReadOutputRequest) -> AsyncIterator[handler_pb2.OutputChunk]:
        """ReadOutput's chunks, on a connection of their own."""
        client = await self._connect(buffer=STREAM_BUFFER)
        try:
            async for chunk in client.stream(SERVICE.full_name, "ReadOutput", request, handler_pb2.OutputChunk,
                                             queue=STREAM_QUEUE):
                yield chunk
        finally:
            await client.close()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
