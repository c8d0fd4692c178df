"""`crust shim`: a CSI plugin in front of another CSI plugin, adding deferral.

Wiring: the Node RPCs the shim changes, the Controller RPCs whose
capabilities it translates, and a byte-level passthrough for everything else
(Identity included: the shim keeps the backend's name, so CSIDriver objects
and StorageClasses stay as they are).
"""

from __future__ import annotations

import asyncio
import logging

from crust.common import metrics
from crust.common.grpcserver import Daemon, unary_handlers
from crust.common.private import make_dirs
from crust.csi_shim import controller, freeze, node
from crust.csi_shim.backend import Backend
from crust.csi_shim.config import ShimConfig
from crust.csi_shim.passthrough import Passthrough
from crust.csi_shim.runtime_client import RuntimeClient

log = logging.getLogger(__name__)


class Shim:
    def __init__(self, config: ShimConfig):
        self.config = config
        self.backend = Backend(config.backend_endpoint)
        self.runtime = RuntimeClient(config.proxy_endpoint)
        self.node = node.NodeShim(config, self.backend, self.runtime)
        self.controller = controller.ControllerShim(
            self.backend, freeze.SnapshotFreezer(self.runtime, config.freeze_timeout_seconds))
        self.daemon = Daemon("shim", config.endpoint, [], max_request_bytes=config.max_request_bytes)
        self.passthrough: Passthrough | None = None

    async def start(self) -> None:
        make_dirs(self.config.state_dir)
        await self.backend.learn()
        self.node.reconcile()
        server = self.daemon.server
        server.add_generic_rpc_handlers((
            unary_handlers("csi.v1.Node", self.node, node.METHODS),
            unary_handlers("csi.v1.Controller", self.controller, controller.METHODS),
            unary_handlers("csi.v1.GroupController", self.controller, controller.GROUP_METHODS),
        ))
        self.passthrough = Passthrough(self.backend.channel)
        self.daemon.fallback_handlers.append(self.passthrough)
        await self.daemon.start()
        metrics.serve(self.config.metrics_port, self.config.metrics_address)

    async def stop(self, grace: float = 5.0) -> None:
        await self.daemon.stop(grace)
        if self.passthrough is not None:
            self.passthrough.close()
        await self.backend.close()
        await self.runtime.close()

    async def run(self) -> None:
        await self.start()
        self.daemon.install_signal_handlers()
        await self.daemon.stopping.wait()
        await self.stop()


def serve(config: ShimConfig) -> None:
    async def main() -> None:
        await Shim(config).run()

    asyncio.run(main())
