"""Where a pod's VM comes from (crust.kata.supply.source): VMs start in
lanes, as many at once as it has, the rest in the order they came."""

from __future__ import annotations

import asyncio
from pathlib import Path

from crust.kata.supply.source import TakenVm, VmSource
from crust.kata.vmm.qemu import VmConfig


class _Vm:
    def __init__(self):
        self.config = VmConfig(kernel=Path("/k"), initrd=Path("/i"))


class _Sandbox:
    """A sandbox whose VM start takes a moment, counting the starts under way."""

    under_way = 0
    most = 0
    order: list[str] = []

    def __init__(self, sandbox_id: str):
        self.id = sandbox_id
        self.vm = _Vm()

    async def start(self, saved=None) -> None:
        cls = type(self)
        cls.order.append(self.id)
        cls.under_way += 1
        cls.most = max(cls.most, cls.under_way)
        await asyncio.sleep(0.05)
        cls.under_way -= 1


def test_vms_start_in_lanes_and_the_rest_in_the_order_they_came():
    source = VmSource(make_sandbox=None, start_lanes=2)

    async def burst() -> None:
        await asyncio.gather(*(source.run(TakenVm(_Sandbox(f"pod-{n}")), [], None) for n in range(6)))

    asyncio.run(burst())
    assert _Sandbox.most == 2
    assert _Sandbox.order == [f"pod-{n}" for n in range(6)]
