"""PodRuntime in ttrpc on the microVM handler's `<socket>.ttrpc`
(crust.kata.pod.ttrpc_endpoint), as the shim's client (crust.containerd_shim.
handler_client) calls it: the servicer's answers and its errors' codes, an
output stream whole and then its error, a missing or too long field
named, the socket
0600 and gone after stop, and a handler that is not there UNAVAILABLE."""

from __future__ import annotations

import os
import stat

import pytest

from crust.api import handler_pb2
from crust.common import ttrpc
from crust.common.errors import DataLoss, NotFound
from crust.common.ttrpc import TtrpcError
from crust.containerd_shim.handler_client import HandlerClient
from crust.kata.pod.service import PodRuntimeService
from crust.kata.pod.ttrpc_endpoint import TtrpcEndpoint


class _Pods:
    """What the servicer calls here of the pod runtime's objects (Pods: list_pods,
    Containers: delete_container, Processes: read_output), one stand-in for the three."""

    def list_pods(self):
        return [handler_pb2.PodInfo(sandbox_id="p1")]

    async def delete_container(self, container_id: str):
        raise NotFound(f"container_id {container_id!r}: no such container")

    async def read_output(self, container_id, exec_id, stdout_offset, stderr_offset):
        for n in range(3):
            yield handler_pb2.OutputChunk(stream=handler_pb2.OutputChunk.STDOUT, offset=stdout_offset + n,
                                          data=bytes([n]))
        if exec_id == "cut":
            raise DataLoss("the output of cut was cut after 3 bytes of stdout and 0 of stderr: the VM is gone")


@pytest.fixture
async def endpoint(tmp_path):
    served = TtrpcEndpoint(PodRuntimeService(pods := _Pods(), containers=pods, processes=pods), f"unix://{tmp_path}/kata.sock")
    served.bind()
    await served.start()
    yield served
    await served.stop()


async def test_pod_runtime_over_ttrpc_answers_as_the_grpc_service_does(endpoint, tmp_path):
    assert stat.S_IMODE(os.stat(endpoint.path).st_mode) == 0o600
    client = HandlerClient(f"unix://{tmp_path}/kata.sock")
    try:
        pods = await client.call("ListPods", handler_pb2.ListPodsRequest(), timeout=5)
        assert [p.sandbox_id for p in pods.pods] == ["p1"]
        with pytest.raises(TtrpcError) as missing:
            await client.call("DeleteContainer", handler_pb2.DeleteContainerRequest(container_id="c9"), timeout=5)
        assert missing.value.code == ttrpc.NOT_FOUND and "c9" in missing.value.message
        with pytest.raises(TtrpcError) as empty:
            await client.call("DeleteContainer", handler_pb2.DeleteContainerRequest(), timeout=5)
        assert empty.value.code == ttrpc.INVALID_ARGUMENT and "container_id" in empty.value.message
        with pytest.raises(TtrpcError) as long:   # crust.common.limits, as on the gRPC socket
            await client.call("DeleteContainer", handler_pb2.DeleteContainerRequest(container_id="c" * 5000),
                              timeout=5)
        assert long.value.code == ttrpc.INVALID_ARGUMENT and "container_id" in long.value.message

        chunks = [c async for c in client.read_output(handler_pb2.ReadOutputRequest(container_id="c",
                                                                                     stdout_offset=10))]
        assert [(c.offset, c.data) for c in chunks] == [(10, b"\0"), (11, b"\1"), (12, b"\2")]
        got = []
        with pytest.raises(TtrpcError) as cut:
            async for chunk in client.read_output(handler_pb2.ReadOutputRequest(container_id="c", exec_id="cut")):
                got.append(chunk.data)
        assert got == [b"\0", b"\1", b"\2"]
        assert cut.value.code == ttrpc.DATA_LOSS and "cut after 3 bytes" in cut.value.message
        with pytest.raises(TtrpcError) as nameless:
            async for _chunk in client.read_output(handler_pb2.ReadOutputRequest()):
                pass
        assert nameless.value.code == ttrpc.INVALID_ARGUMENT and "container_id" in nameless.value.message
    finally:
        await client.close()
    await endpoint.stop()
    assert not os.path.exists(endpoint.path)
    gone = HandlerClient(f"unix://{tmp_path}/kata.sock")
    with pytest.raises(TtrpcError) as away:
        await gone.call("ListPods", handler_pb2.ListPodsRequest(), timeout=5)
    assert away.value.code == ttrpc.UNAVAILABLE
