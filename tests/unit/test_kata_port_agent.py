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


class _PortGivingUp:
    """A port whose QMP closed: it gives up at once, long before the wait."""

    async def ready(self, wait: float = 0.0):
        await asyncio.sleep(0.01)
        return None


class _Running:
    returncode = None


def test_a_port_that_gives_up_while_qemu_exits_fails_the_boot_with_qemus_exit(tmp_path):
    """QEMU exiting closes its monitor before its exit is reaped: the port
    gives up at once and the VM still looks alive. The boot fails naming
    QEMU's exit (seen moments later), not an agent silent for the whole
    wait."""
    from crust.kata.vmm.qemu import Vm, VmConfig, VmError

    async def scenario() -> str:
        vm = Vm("vm-exiting", tmp_path / "vm", VmConfig(kernel=tmp_path / "k", initrd=tmp_path / "i"))
        vm.port = _PortGivingUp()
        vm._proc = _Running()

        async def exits_later() -> int:
            await asyncio.sleep(0.3)
            return 1

        vm._exited = asyncio.ensure_future(exits_later())
        try:
            await vm._guarded(vm._agent_answers(600.0), "boot")
        except VmError as exc:
            return str(exc)
        raise AssertionError("the boot did not fail")

    message = asyncio.run(scenario())
    assert message.startswith("vm vm-exiting: QEMU exited (1) during boot"), message
    assert "within 600 s" not in message, message
