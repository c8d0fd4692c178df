"""PodRuntime on the microVM handler's socket: the gRPC side of
crust.kata.pod.pods, containers and processes (what containerd's crust shim
asks; the contract is specs/handler.proto), and the objects that serve it,
each given what it uses."""

from __future__ import annotations

from crust.api import handler_pb2, handler_pb2_grpc
from crust.common import csi_input
from crust.common.errors import CrustError
from crust.kata.pod.containers import Containers
from crust.kata.pod.network import PodNetworks
from crust.kata.pod.pods import Pods
from crust.kata.pod.processes import Processes
from crust.kata.pod.registry import PodRegistry
from crust.kata.pod.volumes import PodVolumes
from crust.kata.supply.pool import VmPool
from crust.kata.supply.source import VmSource
from crust.kata.supply.template import VmTemplate

SERVICE = handler_pb2.DESCRIPTOR.services_by_name["PodRuntime"].full_name


class PodRuntimeService(handler_pb2_grpc.PodRuntimeServicer):
    def __init__(self, pods: Pods, containers: Containers, processes: Processes):
        self.pods = pods
        self.containers = containers
        self.processes = processes

    async def CreatePod(self, request: handler_pb2.CreatePodRequest, context):
        pid = await self.pods.create_pod(csi_input.required(request.sandbox_id, "sandbox_id"), request.bundle)
        return handler_pb2.CreatePodResponse(pid=pid)

    async def CreateContainer(self, request: handler_pb2.CreateContainerRequest, context):
        await self.containers.create_container(csi_input.required(request.sandbox_id, "sandbox_id"),
                                         csi_input.required(request.container_id, "container_id"),
                                         csi_input.required(request.bundle, "bundle"), stdin=request.stdin)
        return handler_pb2.CreateContainerResponse()

    async def StartProcess(self, request: handler_pb2.StartProcessRequest, context):
        pid = await self.processes.start_process(csi_input.required(request.container_id, "container_id"),
                                            request.exec_id,
                                            request.process if request.HasField("process") else None)
        return handler_pb2.StartProcessResponse(pid=pid)

    async def ReadOutput(self, request: handler_pb2.ReadOutputRequest, context):
        # A server stream: the interceptor maps no errors here, so a
        # refusal is this call's status.
        try:
            async for chunk in self.processes.read_output(csi_input.required(request.container_id, "container_id"),
                                                     request.exec_id, request.stdout_offset,
                                                     request.stderr_offset):
                yield chunk
        except CrustError as exc:
            await context.abort(exc.code, exc.message)

    async def GetProcess(self, request: handler_pb2.GetProcessRequest, context):
        return await self.processes.get_process(csi_input.required(request.container_id, "container_id"),
                                           request.exec_id, request.wait)

    async def SignalProcess(self, request: handler_pb2.SignalProcessRequest, context):
        await self.processes.signal_process(csi_input.required(request.container_id, "container_id"),
                                       request.exec_id, request.signal, request.all)
        return handler_pb2.SignalProcessResponse()

    async def DeleteProcess(self, request: handler_pb2.DeleteProcessRequest, context):
        state = await self.processes.delete_process(csi_input.required(request.container_id, "container_id"),
                                               request.exec_id)
        return handler_pb2.DeleteProcessResponse(state=state)

    async def DeleteContainer(self, request: handler_pb2.DeleteContainerRequest, context):
        state = await self.containers.delete_container(csi_input.required(request.container_id, "container_id"))
        return handler_pb2.DeleteContainerResponse(state=state)

    async def DeletePod(self, request: handler_pb2.DeletePodRequest, context):
        await self.pods.delete_pod(csi_input.required(request.sandbox_id, "sandbox_id"))
        return handler_pb2.DeletePodResponse()

    async def ListPods(self, request: handler_pb2.ListPodsRequest, context):
        return handler_pb2.ListPodsResponse(pods=self.pods.list_pods())

    async def WriteInput(self, request: handler_pb2.WriteInputRequest, context):
        length = await self.processes.write_input(csi_input.required(request.container_id, "container_id"),
                                             request.exec_id, request.offset, request.data, request.close)
        return handler_pb2.WriteInputResponse(length=length)

    async def ResizeTerminal(self, request: handler_pb2.ResizeTerminalRequest, context):
        await self.processes.resize_terminal(csi_input.required(request.container_id, "container_id"),
                                        request.exec_id, request.width, request.height)
        return handler_pb2.ResizeTerminalResponse()

    async def ContainerStats(self, request: handler_pb2.ContainerStatsRequest, context):
        return await self.processes.container_stats(csi_input.required(request.container_id, "container_id"))


class PodRuntimeExtension:
    """What HandlerDaemon needs to serve PodRuntime beside Handler and
    SandboxControl."""

    service = SERVICE

    def __init__(self, handler, pool: VmPool | None = None, template: VmTemplate | None = None,
                 endpoint: str = ""):
        """endpoint: the handler's gRPC endpoint; PodRuntime is served in
        ttrpc beside it (crust.kata.pod.ttrpc_endpoint) for the shim."""
        self.vm_source = VmSource(handler.make_sandbox, pool, template)
        registry = PodRegistry(handler)
        self.processes = Processes(registry)
        volumes = PodVolumes(registry, handler)
        self.containers = Containers(registry, handler, self.processes, volumes)
        self.pods = Pods(handler, registry, self.processes, volumes, PodNetworks(), self.vm_source)
        self.servicer = PodRuntimeService(self.pods, self.containers, self.processes)
        self.ttrpc = None
        if endpoint:
            from crust.kata.pod.ttrpc_endpoint import TtrpcEndpoint

            self.ttrpc = TtrpcEndpoint(self.servicer, endpoint)

    def add_to(self, server) -> None:
        handler_pb2_grpc.add_PodRuntimeServicer_to_server(self.servicer, server)
        if self.ttrpc is not None:
            # Bound with the gRPC socket: a shim that dials meanwhile (the
            # handler restarting under running pods) waits in the backlog.
            self.ttrpc.bind()

    async def start(self) -> None:
        if self.ttrpc is not None:
            await self.ttrpc.start()
        await self.pods.start()
        await self.vm_source.start()

    async def stop(self) -> None:
        if self.ttrpc is not None:
            await self.ttrpc.stop()
        await self.vm_source.stop()
        await self.pods.stop()
