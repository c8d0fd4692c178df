"""A VM's port to its agent (crust.kata.vmm.agent_port): why it was lost."""

from __future__ import annotations

import asyncio


def test_a_vms_port_keeps_the_first_reason_it_was_lost_for():
    """A VM killed because its file server died is then seen to exit: the
    pod's record must name the file server, not the exit that followed."""
    from crust.kata.vmm.agent_port import PortAgent

    async def scenario() -> PortAgent:
        port = PortAgent("/nonexistent/port.sock", qmp=None, vm_name="vm")
        await port.close()
        assert port.dead == ""
        await port.close("its virtiofsd (virtiofsd, cache=auto) was killed by signal 9")
        await port.close("QEMU exited with code -9")
        assert await port.ready(wait=1.0) is None   # gone: nothing is opened any more
        return port

    assert asyncio.run(scenario()).dead == "its virtiofsd (virtiofsd, cache=auto) was killed by signal 9"
