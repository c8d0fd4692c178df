"""One microVM from the handler's image, outside any handler: disks
hot-plugged from image files, requests to its agent, shell scripts run in
the guest. For tests of what the guest itself does."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
from pathlib import Path

from crust.kata.agent import AgentRefused, b64
from crust.kata.image import DEFAULT_CACHE, build
from crust.kata.qemu import SharedDir, Vm, VmConfig
from crust.kata.template import restore_config
from crust.sys import loop as sysloop


def guest_config(disk_bus: str = "virtio-blk", shared_dirs: tuple[SharedDir, ...] = ()) -> VmConfig:
    """The VM config of the handler's image (built if needed)."""
    cache = Path(os.environ.get("CRUST_TEST_KATA_CACHE") or DEFAULT_CACHE)
    image = build(cache)
    return VmConfig(kernel=image.kernel, initrd=image.initrd, disk_bus=disk_bus, shared_dirs=shared_dirs)


class Guest:
    """One microVM from the handler's image, its files under base; disks
    hot-plugged from image files, requests to its agent; the VM stopped and
    the loop devices detached on leaving the context."""

    def __init__(self, base: Path, name: str = "guest", disk_bus: str = "virtio-blk",
                 shared_dirs: tuple[SharedDir, ...] = (), saved: Path | None = None,
                 config: VmConfig | None = None):
        """saved: restore the VM from a template's state (crust.kata.template)
        instead of booting it; its shares are plugged after (plug_shared_dir).
        config: what guest_config answered, for a caller that makes many
        guests (it checks the image on each call); each guest gets a copy."""
        self.base = base
        self.loops: dict[str, str] = {}   # serial -> loop device
        self.vm = Vm(name, base / "vm", dataclasses.replace(config) if config else guest_config(disk_bus, shared_dirs))
        if saved is not None:
            self.vm.config = restore_config(self.vm.config)
        self.saved = saved
        self.runs = 0

    async def __aenter__(self) -> Guest:
        await self.vm.start(saved=self.saved)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.vm.stop()
        for device in self.loops.values():
            sysloop.detach_sync(device)

    async def attach(self, image: Path, serial: str) -> str:
        device = sysloop.attach_sync(image)
        self.loops[serial] = device
        await self.vm.attach_disk(device, serial)
        return device

    async def request(self, *words: str) -> str:
        try:
            return "ok " + " ".join((await self.vm.agent.request(*words, timeout=120)).words)
        except AgentRefused as exc:
            return "err " + exc.message

    async def sh(self, script: str, timeout: float = 300) -> tuple[int, str]:
        """Run a shell script in the guest; (exit code, its stdout then stderr)."""
        self.runs += 1
        name = f"sh{self.runs}"
        pid = (await self.vm.agent.request("spawn", name, b64(script))).int("pid")
        code = await self.vm.agent.wait_exit(pid, timeout=timeout)
        out = b""
        for stream in ("out", "err"):
            got = b""
            while True:
                answer = await self.vm.agent.request("readout", name, stream, str(len(got)), "32768")
                if answer.fields.get("data", "-") == "-":
                    break
                got += base64.urlsafe_b64decode(answer.fields["data"])
            out += got
        await self.vm.agent.request("forget", name)
        return code, out.decode(errors="replace")


def guest(root, coro_fn, kind: type[Guest] | None = None):
    """Run coro_fn(guest) on a fresh guest (of kind, a Guest by default),
    torn down however it ends."""
    async def main():
        async with (kind or Guest)(root.path) as g:
            return await coro_fn(g)
    return asyncio.run(main())


class ScsiGuest(Guest):
    """A Guest whose disks are LUNs of a virtio-scsi controller."""

    def __init__(self, base: Path, name: str = "guest"):
        super().__init__(base, name, disk_bus="virtio-scsi")
