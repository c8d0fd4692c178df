"""`crust handler`: the light runtime handler daemon (mount-namespace sandboxes)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from grpc_health.v1 import health_pb2
from pydantic import BaseModel

from crust.api import handler_pb2, handler_pb2_grpc
from crust.common.grpcserver import Daemon
from crust.common.private import make_dirs
from crust.runtime_handler.handler import RuntimeHandler
from crust.runtime_handler.registration import Registration
from crust.runtime_handler.sandbox import MountNamespaceSandbox
from crust.runtime_handler.containers import ContainerVolumes
from crust.runtime_handler.json_endpoint import JsonEndpoint
from crust.runtime_handler.service import ContainerVolumesService, HandlerService, SandboxControlService
from crust.sys import netns
from crust.sys.proc import ProcessId

log = logging.getLogger(__name__)


class HandlerConfig(BaseModel):
    name: str = "mountns"
    endpoint: str
    proxy_endpoint: str
    volumes_dir: Path
    state_dir: Path
    filesystems: list[str] = ["ext4", "xfs"]


def mount_namespace_sandbox(sandbox_id: str, workdir: Path, rootfs: Path | None, holder: ProcessId | None):
    return MountNamespaceSandbox(sandbox_id, workdir, rootfs, holder)


class HandlerDaemon:
    def __init__(self, config: HandlerConfig, make_sandbox=mount_namespace_sandbox, direct_source=None,
                 extensions=(), extra_features: tuple[str, ...] = ()):
        self.config = config
        self.make_sandbox = make_sandbox
        # The lease is kept beside the sandbox records: a restarted handler
        # takes back its name and its live sandboxes' claims with it.
        registration = Registration(config.proxy_endpoint, config.name, config.endpoint, config.filesystems,
                                    ["stats", "expand", "fsgroup", "subpath", *extra_features],
                                    lease_file=config.state_dir / "lease")
        # The light handler also serves crust's OCI runtime (containers runc runs).
        serves_containers = make_sandbox is mount_namespace_sandbox
        self.handler = RuntimeHandler(
            name=config.name, volumes_dir=config.volumes_dir, state_dir=config.state_dir,
            registration=registration, make_sandbox=make_sandbox, direct_source=direct_source,
            make_containers=(lambda handler: ContainerVolumes(handler, config.state_dir)) if serves_containers
            else None,
            on_watcher=self._watcher_health)
        services = ["Handler", "SandboxControl"] + (["ContainerVolumes"] if serves_containers else [])
        # More services on the same socket, over the same handler (the
        # microVM handler's PodRuntime): each made from the handler, with
        # its full service name, add_to(server), start() and stop().
        self.extensions = [make(self.handler) for make in extensions]
        self.daemon = Daemon("handler", config.endpoint, [
            handler_pb2.DESCRIPTOR.services_by_name[name].full_name for name in services]
            + [e.service for e in self.extensions])

    async def _watcher_health(self, working: bool) -> None:
        """Health follows the directory watcher: a handler that cannot see
        new volumes is not serving."""
        status = health_pb2.HealthCheckResponse.SERVING if working else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.daemon.service_names + [""]:
            result = self.daemon.health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def run(self) -> None:
        make_dirs(self.config.state_dir)
        handler_pb2_grpc.add_HandlerServicer_to_server(HandlerService(self.handler), self.daemon.server)
        handler_pb2_grpc.add_SandboxControlServicer_to_server(SandboxControlService(self.handler), self.daemon.server)
        json_endpoint = None
        if self.handler.containers is not None:
            containers = ContainerVolumesService(self.handler.containers)
            handler_pb2_grpc.add_ContainerVolumesServicer_to_server(containers, self.daemon.server)
            # crust-oci-runtime's way in: the same service without gRPC.
            json_endpoint = JsonEndpoint(containers, self.config.endpoint)
        for extension in self.extensions:
            extension.add_to(self.daemon.server)
        await self.daemon.start()
        await self.handler.start()
        for extension in self.extensions:
            await extension.start()
        if self.handler.containers is not None:
            self.handler.containers.start()
        if json_endpoint is not None:
            await json_endpoint.start()
        if self.make_sandbox is mount_namespace_sandbox:
            # Network namespaces of sandboxes this handler has no record of
            # (killed between making one and recording its sandbox).
            removed = await asyncio.to_thread(netns.sweep, self.config.state_dir / "run",
                                              {self.handler.workdir(s).name for s in self.handler.sandboxes})
            if removed:
                log.info("removed network namespaces of gone sandboxes", extra={"fields": {"netns": removed}})
        self.daemon.install_signal_handlers()
        await self.daemon.stopping.wait()
        # Sandboxes outlive the handler daemon (as containers outlive a
        # restarted runtime daemon); their claims stay with them.
        if json_endpoint is not None:
            await json_endpoint.stop()
        if self.handler.containers is not None:
            self.handler.containers.stop()
        for extension in self.extensions:
            await extension.stop()
        await self.handler.stop()
        await self.daemon.stop()


def serve(config: HandlerConfig) -> None:
    async def main() -> None:
        await HandlerDaemon(config).run()

    asyncio.run(main())
