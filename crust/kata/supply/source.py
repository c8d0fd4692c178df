"""Where a pod's VM comes from, as Kata's VM factory: the pod asks for one,
and gets a VM the pool booted ahead (crust.kata.supply.pool), else one
restored from the template (crust.kata.supply.template), else one booted for
it. Asked in two steps, because a pod's shares live in its VM's directory:
take() gives the pod its sandbox (a pooled VM's directory already moved to
be the pod's), start() makes it run with the pod's shares and NIC, given at
boot or hot-plugged into a VM that runs already or was restored without
them."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path
from typing import Callable

from crust.common.errors import Unavailable
from crust.common.private import make_dirs
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.kata.supply.pool import VmPool
from crust.kata.supply.template import VmTemplate, restore_config
from crust.kata.vmm.devices import Nic
from crust.kata.vmm.qemu import SharedDir, Vm, VmError
from crust.kata.vmm.qmp import QmpError, QmpGone, QmpTimeout

log = logging.getLogger("crust.kata.pod.pods")

# What the handler makes a microVM sandbox with: its id, its work
# directory, no root file system, no process to adopt, and a VM that was
# booted already (None: one of its own).
MakeSandbox = Callable[..., KataSandbox]


@dataclasses.dataclass
class TakenVm:
    """A pod's VM, taken: not started yet unless it came from the pool."""
    sandbox: KataSandbox
    pooled: bool = False        # booted ahead by the pool, running
    saved: Path | None = None   # the template's state it is restored from


class VmSource:
    def __init__(self, make_sandbox: MakeSandbox, pool: VmPool | None = None, template: VmTemplate | None = None):
        self.make_sandbox = make_sandbox
        self.pool = pool   # VMs booted ahead; a pod takes one when it can
        self.template = template   # a VM saved once; restored when the pool has none
        self.handler_nice = os.getpriority(os.PRIO_PROCESS, 0)   # what a taken VM runs at

    async def start(self) -> None:
        if self.pool is not None:
            await self.pool.start()
        if self.template is not None:
            await self.template.start()

    async def stop(self) -> None:
        if self.template is not None:
            await self.template.stop()
        if self.pool is not None:
            await self.pool.stop()

    async def take(self, sandbox_id: str, workdir: Path) -> TakenVm:
        """The pod's sandbox, in its work directory (which must not exist
        yet, or be empty): a pooled VM moved there, else one to restore
        from the template, else one to boot."""
        pooled = await self._take_pooled_vm(sandbox_id, workdir)
        saved = self.template.saved() if pooled is None and self.template is not None else None
        sandbox = self.make_sandbox(sandbox_id, workdir, None, None, vm=pooled)
        return TakenVm(sandbox, pooled=pooled is not None, saved=saved)

    async def run(self, taken: TakenVm, shared: list[SharedDir], nic: Nic | None) -> None:
        """The taken VM running with the pod's shares and NIC. A restore that
        fails drops the template (the pod's retry boots)."""
        sandbox = taken.sandbox
        if taken.saved is not None:
            # Restored (the saved VM's config: no share, no NIC), then
            # given both as a pooled VM is.
            sandbox.vm.config = restore_config(sandbox.vm.config)
            try:
                await sandbox.start(saved=taken.saved)
            except Unavailable as exc:
                self.template.discard(str(exc))
                raise
        if taken.pooled or taken.saved is not None:
            # Booted already, serving the shares that came with its
            # directory (plugging them is then nothing), or restored
            # without them: they and the NIC are plugged in.
            try:
                for shared_dir in shared:
                    await sandbox.vm.plug_shared_dir(shared_dir)
                if nic is not None:
                    await sandbox.vm.plug_nic(nic)
            except (VmError, QmpError, QmpGone, QmpTimeout) as exc:
                raise Unavailable(f"pod {sandbox.id}: the VM booted for it took no device: {exc}") from None
        else:
            # This VM's own config: the handler's is shared by all its sandboxes.
            sandbox.vm.config = dataclasses.replace(sandbox.vm.config, shared_dirs=tuple(shared), nic=nic)
            await sandbox.start()

    async def _take_pooled_vm(self, sandbox_id: str, workdir: Path) -> Vm | None:
        """A VM the pool booted, moved into the pod's work directory; None
        without a pool, when it is empty, or when the move fails (that VM
        is discarded)."""
        vm = self.pool.take() if self.pool is not None else None
        if vm is None:
            return None
        try:
            await asyncio.to_thread(make_dirs, workdir.parent)
            await asyncio.to_thread(os.rename, vm.workdir, workdir)
            vm.relocate(workdir)
            vm.renice(self.handler_nice)
        except (OSError, VmError) as exc:
            log.warning("a pooled VM could not become the pod's; booting one", extra={"fields": {
                "sandbox": sandbox_id, "vm": vm.name, "error": str(exc)}})
            await self.pool.discard(vm)
            return None
        log.info("pod takes a pooled VM", extra={"fields": {"sandbox": sandbox_id, "vm": vm.name, "pid": vm.pid}})
        return vm
