"""A microVM pod's network on the host: the interface CNI made in the pod's
namespace, the VM's tap there (crust.sys.podnet), and the port forwarding
to the pod's address (crust.kata.pod.tcp_forward); undone when the pod goes,
leaving the namespace as CNI left it."""

from __future__ import annotations

import asyncio
import logging

from crust.common.errors import FailedPrecondition
from crust.kata.pod.records import PodNetwork
from crust.kata.pod.tcp_forward import PortForwarder
from crust.sys import podnet

log = logging.getLogger("crust.kata.pod.pods")

TAP = "crust0"                # the VM's tap in the pod's network namespace


class PodNetworks:
    def __init__(self):
        self.forwarders: dict[str, PortForwarder] = {}   # by pod, for those with a network

    async def close(self) -> None:
        for forwarder in self.forwarders.values():
            await forwarder.stop()

    @staticmethod
    async def interface(sandbox_id: str, netns_path: str) -> podnet.Interface | None:
        """The interface CNI made in the pod's namespace (None: no namespace
        of its own, or only its loopback)."""
        if not netns_path:
            return None
        try:
            return await asyncio.to_thread(podnet.read_interface, netns_path)
        except (podnet.PodNetworkError, OSError) as exc:
            raise FailedPrecondition(f"pod {sandbox_id}: linux.namespaces network {netns_path}: {exc}") from None

    @staticmethod
    async def open_tap(sandbox_id: str, network: PodNetwork, interface: podnet.Interface) -> int:
        try:
            return await asyncio.to_thread(podnet.open_tap, network.netns, TAP, interface)
        except (podnet.PodNetworkError, OSError) as exc:
            raise FailedPrecondition(f"pod {sandbox_id}: the VM's tap in {network.netns}: {exc}") from None

    async def forward_ports(self, sandbox_id: str, network: PodNetwork) -> None:
        if network.address:
            forwarder = PortForwarder(sandbox_id, network.netns, network.address)
            await forwarder.start()
            self.forwarders[sandbox_id] = forwarder

    async def disconnect(self, sandbox_id: str, network: PodNetwork | None) -> None:
        """The pod's namespace as CNI left it: no port forwarding, no redirect
        (its tap went with QEMU). Nothing to do once the namespace is gone."""
        forwarder = self.forwarders.pop(sandbox_id, None)
        if forwarder is not None:
            await forwarder.stop()
        if network is not None:
            try:
                await podnet.remove_redirect(network.netns)
                await asyncio.to_thread(podnet.restore, network.netns, network.interface)
            except (podnet.PodNetworkError, OSError) as exc:
                log.warning("the pod's network namespace not restored", extra={"fields": {
                    "sandbox": sandbox_id, "error": str(exc)}})
