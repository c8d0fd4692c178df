"""A VM's connection to its guest's agent (specs/agent.proto) over the
virtio-serial port, opened when the VM boots and kept for its life (opened
again when it breaks).

`ready()` answers the connection once the agent has its port open, waiting
for that as long as its caller allows (a guest still booting), and None
when it is not open by then or the VM is gone. Whether the port is open is
QEMU's to say (query-chardev frontend-open): bytes sent before the guest
opened it are dropped by the guest's kernel.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.kata.agent.client import AgentClient, guest_text, port_state
from crust.kata.vmm.qmp import QmpClient, QmpError, QmpGone, QmpTimeout

log = logging.getLogger(__name__)

# Bounds the first call on a port the guest reports open: its agent
# answers within milliseconds when it runs at all.
OPEN_TIMEOUT = 10.0
# How long after a failed look at the port the next may be: callers in a
# hurry are told None meanwhile instead of asking QEMU again each.
LOOK_AGAIN = 0.5
# Between looks while a caller waits for the guest to open its port.
PORT_LOOK = 0.05
# How long a call waits for the agent's port on a VM whose connection is
# being opened again.
AGENT_START_WAIT = 30.0


class PortAgent:
    def __init__(self, path: str, qmp: QmpClient, vm_name: str):
        self.path = path
        self.qmp = qmp
        self.vm_name = vm_name
        self.client: AgentClient | None = None
        self.details: agent_pb2.GuestDetailsResponse | None = None
        self.dead = ""      # why the VM is gone: no connection is opened any more
        # Told why when the guest leaves a call of a stop unanswered (the VM
        # kills its QEMU: crust.kata.agent.stop_bound).
        self.on_silent: Callable[[str], Awaitable[None]] | None = None
        self._lock = asyncio.Lock()
        self._next_look = 0.0

    def has(self, capability: str) -> bool:
        return self.details is not None and capability in self.details.capabilities

    async def _port_state(self) -> str:
        """agent_client.port_state, or "unknown" when QEMU did not answer."""
        try:
            return await port_state(self.qmp)
        except (QmpError, QmpGone, QmpTimeout, OSError):
            return "unknown"

    async def ready(self, wait: float = 0.0) -> AgentClient | None:
        """The open connection; None when the guest's agent has not opened
        its port or the VM is gone. wait: how long a port the VM has but
        its guest has not opened yet (its agent still starting) is waited
        for; a VM without the port is never waited for."""
        client = self.client
        if client is not None and not client.closed:
            return client
        loop = asyncio.get_running_loop()
        if self.dead or (not wait and (self._lock.locked() or loop.time() < self._next_look)):
            return None
        async with self._lock:
            if self.client is not None and not self.client.closed:
                return self.client
            self.client, self.details = None, None
            deadline = loop.time() + wait
            state = await self._port_state()
            while state == "closed" and loop.time() < deadline and not self.dead:
                await asyncio.sleep(PORT_LOOK)
                state = await self._port_state()
            if state != "open":
                if wait and state == "closed" and not self.dead:
                    log.warning("vm %s: the guest's agent did not open its port within %.0f s",
                                self.vm_name, wait)
                self._next_look = loop.time() + LOOK_AGAIN
                return None
            try:
                self.client, self.details = await AgentClient.open(self.path, timeout=OPEN_TIMEOUT)
            except (ttrpc.TtrpcError, OSError) as exc:
                log.warning("vm %s: the guest's agent port is open but did not answer: %s", self.vm_name,
                            guest_text(str(exc)))
                self._next_look = loop.time() + LOOK_AGAIN
                return None
            self.client.on_silent = self.on_silent
            log.info("vm %s: agent %s %s on its port, capabilities %s", self.vm_name,
                     guest_text(self.details.agent_name, 100), guest_text(self.details.agent_version, 100),
                     guest_text(",".join(self.details.capabilities)))
            return self.client

    async def close(self, reason: str = "") -> None:
        """Close the connection; with a reason, for good (the VM is gone).
        The first reason stays: a VM killed because its file server died
        is then seen to exit, and the pod's record names the cause."""
        if reason and not self.dead:
            self.dead = reason
        client, self.client = self.client, None
        if client is not None:
            await client.close()
