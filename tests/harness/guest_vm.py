"""One microVM from the handler's image, outside any handler: disks
hot-plugged from image files, calls to its agent on its port, shell scripts
run in the guest. For tests of what the guest itself does."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.kata.agent.client import AgentClient
from crust.kata.image.build import DEFAULT_CACHE, build
from crust.kata.vmm.qemu import SharedDir, Vm, VmConfig
from crust.kata.supply.template import restore_config
from crust.sys import loop as sysloop
from tests.harness import loops

# How long a call waits for the guest's agent to open its port (its
# interpreter starts in seconds, slower under emulation on a busy host).
PORT_WAIT = 120.0
SCRIPT_ENV = ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
READ_BYTES = 1 << 20
# A call about a process that runs already answers within moments.
CALL_TIMEOUT = 60.0


def guest_config(disk_bus: str = "virtio-blk", shared_dirs: tuple[SharedDir, ...] = ()) -> VmConfig:
    """The VM config of the handler's image (built if needed)."""
    cache = Path(os.environ.get("CRUST_TEST_KATA_CACHE") or DEFAULT_CACHE)
    image = build(cache)
    return VmConfig(kernel=image.kernel, initrd=image.initrd, disk_bus=disk_bus, shared_dirs=shared_dirs)


class Guest:
    """One microVM from the handler's image, its files under base; disks
    hot-plugged from image files, calls to its agent on its port; the VM
    stopped and the loop devices detached on leaving the context."""

    def __init__(self, base: Path, name: str = "guest", disk_bus: str = "virtio-blk",
                 shared_dirs: tuple[SharedDir, ...] = (), saved: Path | None = None,
                 config: VmConfig | None = None):
        """saved: restore the VM from a template's state (crust.kata.supply.template)
        instead of booting it; its shares are plugged after (plug_shared_dir).
        config: what guest_config answered, for a caller that makes many
        guests (it checks the image on each call); each guest gets a copy."""
        self.base = base
        self.loops: dict[str, str] = {}   # serial -> loop device
        self.images: dict[str, Path] = {}   # loop device -> its image
        self.vm = Vm(name, base / "vm", dataclasses.replace(config) if config else guest_config(disk_bus, shared_dirs))
        if saved is not None:
            self.vm.config = restore_config(self.vm.config)
        self.saved = saved
        self.runs = 0

    async def __aenter__(self) -> Guest:
        await self.vm.start(saved=self.saved)
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.vm.stop()
        finally:
            # Each released even when the VM's stop or another release
            # failed; a device that does not go fails the test (loops.release).
            loops.release_each((device, self.images[device]) for device in self.loops.values())

    async def attach(self, image: Path, serial: str) -> str:
        device = sysloop.attach_sync(image)
        self.loops[serial], self.images[device] = device, image
        await self.vm.attach_disk(device, serial)
        return device

    async def port(self) -> AgentClient:
        """The VM's connection to its guest's agent: the port takes one host
        connection at a time, so every call of a test goes on this one."""
        client = await self.vm.port.ready(wait=PORT_WAIT)
        if client is None:
            raise RuntimeError(f"vm {self.vm.name}: its guest's agent did not answer on its port")
        return client

    async def sh(self, script: str, timeout: float = 300) -> tuple[int, str]:
        """Run a shell script in the guest; (exit code, its stdout then stderr)."""
        self.runs += 1
        code, out, err = await run_script(await self.port(), f"guest-sh-{self.runs}", script, timeout)
        return code, (out + err).decode(errors="replace")


async def run_script(client: AgentClient, exec_id: str, script: str, timeout: float) -> tuple[int, bytes, bytes]:
    """A shell script run by the guest's agent as a process of the guest
    itself (no container); (exit code, stdout, stderr), the process
    forgotten after. One still running after timeout seconds is killed,
    and TimeoutError raised."""
    process = {"args": ["/bin/sh", "-c", script], "env": SCRIPT_ENV, "cwd": "/"}
    request = agent_pb2.ExecProcessRequest(exec_id=exec_id, process=json.dumps(process).encode())
    await client.call("ExecProcess", request, timeout=CALL_TIMEOUT)
    try:
        ended = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=exec_id), timeout=timeout)
    except ttrpc.TtrpcError as exc:
        if exc.code != ttrpc.DEADLINE_EXCEEDED:
            raise
        # Killed and forgotten: the guest is left as it was for what follows.
        await client.call("SignalProcess", agent_pb2.SignalProcessRequest(exec_id=exec_id, signal=9),
                          timeout=CALL_TIMEOUT)
        await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=exec_id), timeout=CALL_TIMEOUT)
        await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id=exec_id), timeout=CALL_TIMEOUT)
        raise TimeoutError(f"the guest's script {exec_id} ran longer than {timeout:g} s: {script[:200]!r}") from None
    out = await _read_all(client, "ReadStdout", exec_id)
    err = await _read_all(client, "ReadStderr", exec_id)
    await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id=exec_id), timeout=CALL_TIMEOUT)
    return ended.exit_code, out, err


async def _read_all(client: AgentClient, method: str, exec_id: str) -> bytes:
    """One stream of an exited process, from its start to its end."""
    got = bytearray()
    while True:
        answer = await client.call(method, agent_pb2.ReadStreamRequest(exec_id=exec_id, offset=len(got),
                                                                       max_bytes=READ_BYTES), timeout=CALL_TIMEOUT)
        got += answer.data
        if answer.eof:
            return bytes(got)


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
