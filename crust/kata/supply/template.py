"""A VM saved once and restored for each pod: RunPodSandbox without a boot.

Kata's VM templating (`enable_template`) is the model: a VM is booted once,
stopped, and its state saved; each pod's VM is QEMU loading that state and
running on from where the template stopped. Under software emulation QEMU
loading a saved guest and its agent answering takes a fraction of a boot
to the agent.

What the template is: the handler's VM config with guest RAM shareable
and kept apart (crust.kata.vmm.saved_ram) and nothing of a pod, booted at nice
10, with the pool's warm-up run in it (/dev/shm's tmpfs made, one throwaway
container through crun, a disk of its own plugged, mounted and unplugged),
then stopped and saved: its devices (QMP `migrate` to a descriptor of ours)
to `<dir>/vm.state`, the pages of its RAM that hold anything to the sparse
`<dir>/vm.state.ram`, with a record (`template.json`) of what it was made
from. Kata maps one template's RAM into every clone, copy on write; that
needs RAM QEMU maps privately, and virtio-fs needs it shared with the file
server, so each VM here gets its own copy of the saved pages, and only of
those.

What a restored VM has to be given, because the file cannot hold it:
- its shares and NIC, hot-plugged after the restore (QEMU 7.2 does not
  save a vhost-user-fs device; a pooled VM's NIC is plugged the same way);
- its own clock and random numbers. Every VM restored from one file wakes
  with the template's wall clock and the same kernel random number
  generator state. Before anything of a pod runs, the agent sets the clock
  from the host and credits 64 bytes of the host's getrandom to the kernel,
  then reseeds its generator at once (the agent's Resume; qemu.Vm.start). The
  guest kernel has no vmgenid driver, which would do the reseed by itself.
  What stays the same in every clone: the kernel's address layout (KASLR)
  and what the kernel drew before the save (boot_id is drawn on first read:
  nothing reads it before the save).

Before the save, the guest's free page reporting is let finish (its
freed memory punched out of the RAM memfd: crust.kata.vmm.saving), so the
RAM file holds what the guest uses, not what it once touched.

The template is rebuilt when what it was made from changes (the image's
kernel, initramfs and root, QEMU, the VM's size, accelerator, disk bus or kernel
command line, the host's kernel or CPU: template_key); a pod that comes meanwhile boots its VM, as
without a template. A restore that fails drops the template (rebuilt in the
background) and fails that RunPodSandbox (kubelet retries; the retry boots).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from pydantic import BaseModel

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.atomicfile import write_atomic
from crust.common.errors import CrustError
from crust.common.formats import NewerFormat, decode, encode
from crust.common.private import make_dirs
from crust.kata.agent import calls
from crust.kata.vmm.saved_ram import MIB, ram_path
from crust.kata.agent.calls import SHM_TMPFS
from crust.kata.supply.pool import (
    NICE_BOOT_TIMEOUT,
    POOL_NICE,
    RETRY_FIRST,
    RETRY_MAX,
    WARM_DISK_IMAGE,
    port_warm,
    warm_disk,
)
from crust.kata.vmm.qemu import (
    Vm,
    VmConfig,
    VmError,
    is_qemu_under,
    qemu_pids_under,
)
from crust.kata.vmm.config import DEVICE_LAYOUT, guest_cpu
from crust.kata.vmm.qmp import QmpError, QmpGone
from crust.sys import proc
from crust.sys.run import CommandError, run

log = logging.getLogger(__name__)

STATE_FILE = "vm.state"
RECORD_FILE = "template.json"
BUILD_DIR = "build"
# What a stopped or killed build leaves beside the template: a part of a
# state, the warm-up disk's image or its part.
PARTIAL_STATE = STATE_FILE + ".partial"
BUILD_LEFTOVERS = (PARTIAL_STATE, ram_path(Path(PARTIAL_STATE)).name, WARM_DISK_IMAGE, WARM_DISK_IMAGE + ".partial")
# What ends one making of the template and has the keeper try again later.
MAKING_FAILURES = (VmError, CrustError, ConnectionError, QmpError, QmpGone, CommandError, OSError)


class TemplateNotMade(CrustError):
    """A making of the template ended without a saved VM: why, and its
    guest's last console lines, read before the build's directory went."""

    def __init__(self, reason: str, console: str = ""):
        # The error of a QEMU that exited names its console already.
        super().__init__(reason if console in reason else f"{reason}; console: {console}")
        self.console = console


class TemplateRecord(BaseModel):
    """What the saved VM was made from (template.json)."""

    key: str             # template_key of the config it was saved with
    saved_bytes: int     # the state file's size
    ram_bytes: int = 0   # the data in its RAM file (the rest of the guest's RAM is holes)
    boot_s: float        # its boot to the agent
    guest_uptime_s: float = 0.0   # the guest's uptime just before the save (a restored guest's goes on from it)
    saved_at: float      # seconds since the epoch


def restore_config(config: VmConfig) -> VmConfig:
    """The config a template is saved with and restored into: the handler's,
    guest RAM shareable and apart, no share and no NIC (plugged after)."""
    return dataclasses.replace(config, shared_dirs=(), nic=None, shared_memory=True, ram_apart=True, nice=0,
                               extra_args=())


async def template_key(config: VmConfig) -> str:
    """A digest of everything the saved state must match to be loaded: the
    guest's kernel and initramfs (their paths name the image's hash), QEMU
    (its binary and version), the machine the config describes, and the
    host's kernel and CPU (under KVM the guest's CPU is the host's, `-cpu
    host`: a state saved on another CPU may not load, or not run right)."""
    qemu = shutil.which(config.qemu_binary) or config.qemu_binary
    version = (await run([qemu, "--version"], timeout=30)).stdout.splitlines()[0]
    facts = [version, f"memory={config.memory_mib}", f"maxmem={config.max_memory_mib}", f"cpus={config.cpus}",
             f"accel={config.accel}", f"guest_cpu={guest_cpu(config)}",
             f"bus={config.disk_bus}", f"cmdline={config.cmdline}", f"devices={DEVICE_LAYOUT}", "ram=apart",
             f"host={os.uname().release}",
             f"cpu={await asyncio.to_thread(_host_cpu)}"]
    for path in (qemu, str(config.kernel), str(config.initrd), str(config.root_image)):
        st = os.stat(path)
        facts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()


class VmTemplate:
    def __init__(self, directory: Path, config: VmConfig):
        self.directory = directory
        # The handler's config: its accelerator is decided before start().
        self.config = config
        self.state = directory / STATE_FILE
        self.ram = ram_path(self.state)
        self.record_path = directory / RECORD_FILE
        self._ready = False
        self._keeper: asyncio.Task | None = None
        # The end of the making under way, or of the last one (built()).
        self._ended = asyncio.Event()
        self._failure: Exception | None = None
        self.builds = 0

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """A template an earlier handler process saved is used if it still
        fits; otherwise one is made in the background."""
        make_dirs(self.directory)
        # What a stopped or killed build left: its VM and directory, its files.
        await asyncio.to_thread(_remove_build, self.directory / BUILD_DIR)
        for name in BUILD_LEFTOVERS:
            (self.directory / name).unlink(missing_ok=True)
        self._begin()

    async def stop(self) -> None:
        """The saved template stays for the next handler process."""
        if self._keeper is not None:
            self._keeper.cancel()
            try:
                await self._keeper
            except asyncio.CancelledError:
                pass
            self._keeper = None

    def saved(self) -> Path | None:
        """The state file to restore a pod's VM from, or None (none fits yet)."""
        return self.state if self._ready else None

    async def built(self) -> Path:
        """Until the making under way ends: the state file, saved now or
        kept from before (saved() returns it from then on); or the error
        that ended the making, raised (TemplateNotMade when the build's VM
        failed, with its console's last lines, or stop() cut it short); the
        keeper tries again later, and between two tries this raises the
        last one's error. It waits as long as the making takes, which
        bounds itself: its boot by NICE_BOOT_TIMEOUT, each step after by
        a timeout of its own."""
        await self._ended.wait()
        if self._failure is not None:
            raise self._failure
        return self.state

    def discard(self, reason: str) -> None:
        """A restore from the template failed: it is made again."""
        log.warning("VM template discarded; making it again", extra={"fields": {"reason": reason[:500]}})
        self._ready = False
        for path in (self.record_path, self.state, self.ram):
            path.unlink(missing_ok=True)
        if self._keeper is None or self._keeper.done():
            self._begin()

    # -- making ------------------------------------------------------------------------

    def _begin(self) -> None:
        self._ended.clear()
        self._keeper = asyncio.create_task(self._keep(), name="vm-template")

    def _end(self, failure: Exception | None) -> None:
        self._ready = failure is None
        self._failure = failure
        self._ended.set()

    async def _keep(self) -> None:
        delay = RETRY_FIRST
        while True:
            self._ended.clear()
            try:
                key = await template_key(self.config)
                if await asyncio.to_thread(self._fits, key):
                    self._end(None)
                    log.info("VM template ready", extra={"fields": {"state": str(self.state), "made": False}})
                    return
                await self._build(key)
                self._end(None)
                return
            except MAKING_FAILURES as exc:
                fields = {"error": str(exc)[:500], "retry_s": delay}
                if isinstance(exc, TemplateNotMade):
                    fields["console"] = exc.console
                log.error("the VM template was not made; trying again later", extra={"fields": fields})
                self._end(exc)
            except BaseException as exc:
                # Stopped, or an error the keeper does not try again after:
                # it ends here, and built()'s waiters learn why.
                stopped = TemplateNotMade("the VM template's making was stopped")
                self._end(exc if isinstance(exc, Exception) else stopped)
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    def _fits(self, key: str) -> bool:
        try:
            record = decode(TemplateRecord, self.record_path.read_bytes(), self.record_path)
            size = self.state.stat().st_size
            ram_size = self.ram.stat().st_size
        except (OSError, ValueError, NewerFormat):
            return False
        return record.key == key and record.saved_bytes == size and ram_size == self.config.memory_mib * MIB

    async def _build(self, key: str) -> None:
        for path in (self.record_path, self.state, self.ram):
            path.unlink(missing_ok=True)
        workdir = self.directory / BUILD_DIR
        partial = self.directory / PARTIAL_STATE
        for path in (partial, ram_path(partial)):
            path.unlink(missing_ok=True)
        vm = Vm("crust-template-" + secrets.token_hex(6), workdir,
                dataclasses.replace(restore_config(self.config), nice=POOL_NICE))
        started = time.monotonic()
        try:
            boot_s = await vm.start(NICE_BOOT_TIMEOUT)   # its guest's agent connected
            client = await vm.port.ready()
            await calls.mount_pod_tmpfs(client, SHM_TMPFS, "")
            if vm.port.has("warm"):
                await port_warm(client)
            await warm_disk(vm, client, self.directory)
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=30)
            uptime = details.uptime_ms / 1000
            # Saved with the guest's agent running and its port open
            # (the connection closed: a restored VM's host opens its own):
            # a restored VM's agent answers at once, its imports long done.
            await vm.port.close()
            held = await vm.reported()
            log.info("VM template: guest RAM held before the save", extra={"fields": {"bytes": held}})
            size, ram_bytes = await vm.save(partial)
        except (*MAKING_FAILURES, ttrpc.TtrpcError) as exc:
            raise TemplateNotMade(str(exc), vm.console_tail()) from exc
        finally:
            await vm.kill()
            await asyncio.to_thread(_remove_build, workdir)
        await asyncio.to_thread(_settle, ram_path(partial), self.ram)
        await asyncio.to_thread(_settle, partial, self.state)
        record = TemplateRecord(key=key, saved_bytes=size, ram_bytes=ram_bytes, boot_s=round(boot_s, 3),
                                guest_uptime_s=uptime, saved_at=time.time())
        write_atomic(self.record_path, encode(record), mode=0o600)
        (self.directory / WARM_DISK_IMAGE).unlink(missing_ok=True)
        self.builds += 1
        log.info("VM template ready", extra={"fields": {"state": str(self.state), "made": True, "bytes": size,
                                                        "ram_bytes": ram_bytes,
                                                        "seconds": round(time.monotonic() - started, 2)}})


def _host_cpu() -> str:
    """The host CPU's model and feature flags (its first processor's)."""
    model = flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = value.strip()
            elif not line.strip() and (model or flags):
                break
    return hashlib.sha256(f"{model}\n{flags}".encode()).hexdigest()[:16]


def remove_saved(directory: Path) -> list[str]:
    """A handler that no longer restores VMs frees what an earlier one
    saved: the files of a template in directory (only those, a build's
    QEMU killed first), then the directory if that empties it. Returns the
    names removed."""
    if not directory.is_dir() or directory.is_symlink():
        return []
    _remove_build(directory / BUILD_DIR)
    removed = []
    for name in (STATE_FILE, ram_path(Path(STATE_FILE)).name, RECORD_FILE, *BUILD_LEFTOVERS):
        try:
            (directory / name).unlink()
            removed.append(name)
        except FileNotFoundError:
            pass
    try:
        directory.rmdir()
    except OSError:
        pass   # something not a template's is in it: kept
    return removed


def _settle(partial: Path, final: Path) -> None:
    fd = os.open(partial, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, final)


def _remove_build(workdir: Path) -> None:
    """A template's build directory: a QEMU an earlier handler process left
    running there killed first (only one whose command line names it)."""
    for pid in qemu_pids_under(workdir):
        identity = proc.identify(pid)
        if identity is not None:
            proc.signal_if(pid, lambda p=identity: proc.alive(p) and is_qemu_under(p.pid, workdir))
            deadline = time.monotonic() + 10
            while proc.alive(identity) and time.monotonic() < deadline:
                time.sleep(0.05)
    shutil.rmtree(workdir, ignore_errors=True)
