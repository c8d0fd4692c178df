"""`crust driver`: wire the CSI services of the loop driver onto a unix socket.

The mode decides what runs: `controller` registers Identity + Controller and
never touches a device; `node` registers Identity + Node and keeps no
controller state; `all` runs both for a single machine.
"""

from __future__ import annotations

import asyncio
import logging

from crust.api import csi_pb2, csi_pb2_grpc
from crust.common.endpoint import clear_stale_socket, socket_path
from crust.common import metrics
from crust.common.grpcserver import Daemon
from crust.common.private import make_dirs
from crust.driver.catalog import Catalog
from crust.driver.config import DriverConfig
from crust.driver.controller import ControllerService
from crust.driver.group_controller import GroupControllerService
from crust.driver import metrics as pool_metrics
from crust.driver.identity import IdentityService
from crust.driver.node import NodeService

log = logging.getLogger(__name__)


class Driver:
    def __init__(self, config: DriverConfig):
        self.config = config
        self.ready = False
        self.catalog: Catalog | None = None
        self.controller: ControllerService | None = None
        self.node: NodeService | None = None
        services = [csi_pb2.DESCRIPTOR.services_by_name["Identity"].full_name]
        if config.mode.controller:
            services.append(csi_pb2.DESCRIPTOR.services_by_name["Controller"].full_name)
            services.append(csi_pb2.DESCRIPTOR.services_by_name["GroupController"].full_name)
        if config.mode.node:
            services.append(csi_pb2.DESCRIPTOR.services_by_name["Node"].full_name)
        self.daemon = Daemon("driver", config.endpoint, services)

    def prepare(self) -> None:
        """Load and reconcile state before the socket accepts calls."""
        make_dirs(self.config.data_dir)
        server = self.daemon.server
        identity = IdentityService(controller=self.config.mode.controller, ready=lambda: self.ready)
        csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)
        if self.config.mode.node:
            # The node goes first so that, in `all` mode, its pool exists when
            # the controller loads the catalog.
            self.node = NodeService(self.config)
            self.node.register_pool()
            self.node.reconcile()
            csi_pb2_grpc.add_NodeServicer_to_server(self.node, server)
        if self.config.mode.controller:
            self.catalog = Catalog(self.config.data_dir)
            self.catalog.load()
            self.controller = ControllerService(self.config, self.catalog)
            csi_pb2_grpc.add_ControllerServicer_to_server(self.controller, server)
            csi_pb2_grpc.add_GroupControllerServicer_to_server(GroupControllerService(self.controller), server)
        if self.config.distributed:
            self.node.grow_volume = self.controller.grow_volume
        if self.config.metrics_port:
            if self.catalog is not None:
                pool_metrics.register(self.catalog)
            metrics.serve(self.config.metrics_port, self.config.metrics_address)

    async def start(self) -> None:
        # Refuse a socket another server is listening on before any state is
        # touched: a second driver must not reconcile (roll back creates,
        # detach devices) what the live one is in the middle of.
        clear_stale_socket(socket_path(self.config.endpoint))
        self.prepare()
        await self.daemon.start()
        self.ready = True

    async def stop(self, grace: float = 5.0) -> None:
        self.ready = False
        await self.daemon.stop(grace)

    async def run(self) -> None:
        await self.start()
        self.daemon.install_signal_handlers()
        await self.daemon.stopping.wait()
        await self.stop()


def serve(config: DriverConfig) -> None:
    async def main() -> None:
        # The gRPC server binds to the running loop, so it is built inside it.
        await Driver(config).run()

    asyncio.run(main())
