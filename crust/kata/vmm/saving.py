"""How a VM is saved and restored (crust.kata.supply.template): its devices'
state through QEMU's migration to and from a file of ours, its guest RAM
apart (crust.kata.vmm.saved_ram), and a restored guest made its own (the
host's clock, fresh entropy) before anyone uses it. A mixin of
crust.kata.vmm.qemu.Vm."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path

from crust.api import agent_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc
from crust.common.private import open_new
from crust.kata.vmm import saved_ram
from crust.kata.vmm.devices import VmError, VmHung

log = logging.getLogger("crust.kata.vmm.qemu")

# What a restored VM's kernel is given from the host's getrandom to reseed
# its random number generator (the agent's Resume): 512 bits credited.
RESEED_BYTES = 64
# How long a restored VM's agent port is waited for (saved open: at once
# but for a machine short of CPU).
RESTORED_PORT_WAIT = 10.0
# Before a save, the guest's free page reporting is let finish: it reports
# what was freed in blocks of 2 MiB, two seconds after the frees, and QEMU
# punches each block out of the RAM memfd, which the save then skips. The
# RAM's allocation is read until it held still for REPORT_SETTLE seconds
# (longer than the guest's delay), at most REPORT_WAIT.
REPORT_SETTLE = 3.0
REPORT_WAIT = 20.0
REPORT_LOOK = 0.25


class VmSaving:
    def _incoming_args(self) -> list[str]:
        if self._incoming_fd is None:
            return []
        # With RAM apart, QEMU waits for its capability first (_load).
        return ["-incoming", "defer" if self.config.ram_apart else f"fd:{self._incoming_fd}"]

    def _close_passed(self) -> None:
        """Our descriptors of what QEMU inherits, closed (their numbers kept)."""
        if self._incoming_fd is not None:
            os.close(self._incoming_fd)
            self._incoming_number, self._incoming_fd = self._incoming_fd, None
        if self._ram_open is not None:
            os.close(self._ram_open)
            self._ram_open = None

    async def _resume(self) -> None:
        """A VM restored from a template made its own: the host's clock and
        fresh entropy, through the agent's port (its agent was saved with
        the port open: it answers at once)."""
        client = await self.port.ready(wait=RESTORED_PORT_WAIT)
        if client is None or not self.port.has(caps.RESUME):
            raise VmError(f"vm {self.name}: its restored guest's agent "
                          f"{'does not answer on its port' if client is None else 'cannot resume'}: save it again")
        now = time.time_ns()
        try:
            answer = await client.call("Resume", agent_pb2.ResumeRequest(
                seconds=now // 1_000_000_000, nanos=now % 1_000_000_000,
                seed=secrets.token_bytes(RESEED_BYTES)), timeout=RESTORED_PORT_WAIT)
        except (ttrpc.TtrpcError, ConnectionError) as exc:
            raise VmError(f"vm {self.name}: its restored guest was not made its own: {exc}") from None
        log.info("vm %s: resumed (clock moved %.3f s)", self.name, answer.clock_step_nanos / 1e9)

    async def _load(self, timeout: float) -> None:
        """Until QEMU has read the saved state, then run the guest (it was
        saved stopped, and a restored VM stays as it was saved)."""
        if self.config.ram_apart:
            await self._ignore_shared()
            await self.qmp.execute("migrate-incoming", {"uri": f"fd:{self._incoming_number}"})
        await self._migrated("its saved state did not load", timeout, 0.01)
        await self.qmp.execute("cont")

    async def _migrated(self, failure: str, timeout: float, interval: float) -> None:
        """Until QEMU's migration (out to a file, or in from one) completed;
        VmError with QEMU's reason if it failed, VmHung after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            answer = await self.qmp.execute("query-migrate")
            status = answer.get("status", "none")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                reason = answer.get("error-desc") or self._qemu_log_text() or status
                raise VmError(f"vm {self.name}: {failure}: {reason}")
            if time.monotonic() > deadline:
                raise VmHung(f"vm {self.name}: {failure} within {timeout:.0f}s ({status})")
            await asyncio.sleep(interval)

    async def _ignore_shared(self) -> None:
        await self.qmp.execute("migrate-set-capabilities", {"capabilities": [
            {"capability": "x-ignore-shared", "state": True}]})

    def ram_held(self) -> int:
        """Bytes of the RAM memfd that hold pages (ram_apart)."""
        return os.stat(f"/proc/{self.pid}/fd/{self.ram_fd}").st_blocks * 512

    async def reported(self) -> int:
        """Until the guest's free page reporting held still (see
        REPORT_SETTLE); the RAM memfd's bytes then."""
        deadline = time.monotonic() + REPORT_WAIT
        held, still_since = self.ram_held(), time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - still_since < REPORT_SETTLE:
            await asyncio.sleep(REPORT_LOOK)
            now = self.ram_held()
            if now != held:
                held, still_since = now, time.monotonic()
        return held

    async def save(self, path: Path, timeout: float = 300.0) -> tuple[int, int]:
        """The VM stopped and its whole state (devices and RAM) written to
        path, a new file, for start(saved=) to load; with RAM apart, its
        RAM to saved_ram.ram_path(path) instead. Returns the state's size
        and the bytes of RAM saved apart. The VM stays stopped: the caller
        ends it. QEMU writes through a descriptor of ours (getfd), so
        nothing runs a shell on the path."""
        await self.qmp.execute("stop")
        if self.config.ram_apart:
            await self._ignore_shared()
        fd = open_new(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            await self.qmp.execute_with_fd("getfd", {"fdname": "saved-state"}, fd)
        finally:
            os.close(fd)
        await self.qmp.execute("migrate", {"uri": "fd:saved-state"})
        await self._migrated("not saved", timeout, 0.02)
        ram_bytes = 0
        if self.config.ram_apart:
            ram_bytes = await asyncio.to_thread(saved_ram.save_ram, f"/proc/{self.pid}/fd/{self.ram_fd}",
                                                saved_ram.ram_path(path), self.config.memory_mib * saved_ram.MIB)
        return path.stat().st_size, ram_bytes

