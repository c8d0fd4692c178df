"""The KVM probe (crust.kata.vmm.accel) and the answers it calls definite."""

from __future__ import annotations

import asyncio


def test_a_kvm_probe_whose_vm_breaks_its_agent_connection_is_a_definite_no(monkeypatch, tmp_path):
    """A KVM that aborts on start can show as a reset agent connection
    rather than as an exit seen first (on a busy machine): that is the probe
    VM failing, not an unexpected error."""
    from crust.kata.vmm import accel
    from crust.kata.vmm.qemu import Vm, VmConfig

    killed = []

    async def start(self, ready_timeout):
        raise ConnectionResetError(104, "Connection reset by peer")

    async def kill(self):
        killed.append(self.name)

    monkeypatch.setattr(Vm, "start", start)
    monkeypatch.setattr(Vm, "kill", kill)
    config = VmConfig(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd")
    works, reason, definite = asyncio.run(accel.probe_kvm(config, tmp_path / "probe"))
    assert (works, definite) == (False, True) and "probe VM" in reason and "reset" in reason, reason
    assert killed, "the probe VM is killed"
