"""VMs booted ahead of their pods: RunPodSandbox takes one instead of waiting for a boot.

Kata's VM factory keeps such a cache (`vm_cache_number`); under software
emulation a boot is most of a microVM pod's start. The handler
keeps `size` VMs booted, each in a directory of its own below the pool's
(`<state>/pool/crust-pool-<id>/`), laid out as a pod's: its two shared
directories (crust.kata.vmm.share), still empty, each served by its virtiofsd
and mounted by the guest, the pod's /dev/shm tmpfs made in the guest, one
throwaway container run by crun (the agent's warm) and a small disk of the
pool's own plugged, mounted, unmounted and unplugged (under emulation a
guest's first container start and first disk each cost more than the
next, the code they run translated once), and no NIC. A pod that
takes one (take()):

- renames the VM's directory to its own: its shares come along (their
  mounts move with the directory, each virtiofsd serves the same tree, now
  the pod's), QEMU and the daemons keep their open files, and the VM's
  sockets are in a directory of their own, recorded in its vm.json, so a
  restarted handler finds them;
- hot-plugs its NIC (the tap's descriptor through QMP getfd, as
  crust.kata.vmm.qemu.Vm.plug_nic does), when it has a network of its own;
- then goes on as with a VM it booted: the pod's sysctls, hostname and
  network in the guest, its containers into the shares.

A VM serves one pod, once: it leaves the pool when taken and is stopped
with its pod, never given back. The pool refills in the background, one
boot at a time, so a burst of pods never starts many boots at once. VMs
the pool still holds when the handler stops are stopped; those a killed
handler left behind are found at the next start (their directories below
the pool's) and stopped, never taken (nothing says what they went through
meanwhile).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.errors import CrustError
from crust.common.private import make_dirs
from crust.kata.agent import calls, volume_calls
from crust.kata.agent.client import AgentClient, handler_error
from crust.kata.agent.calls import SHM_TMPFS
from crust.kata.vmm.qemu import (
    SHORT_SOCKET_ROOT,
    SharedDir,
    Vm,
    VmConfig,
    VmError,
    read_identity,
)
from crust.kata.vmm.qmp import QmpError, QmpGone
from crust.kata.vmm.share import PodShare, ShareError
from crust.sys import fs, proc
from crust.sys.run import CommandError

log = logging.getLogger(__name__)

NAME_PREFIX = "crust-pool-"
POOL_NICE = 10
# After a failed boot, the next try waits this long (doubling, up to the
# maximum): a pool never spins on a machine where VMs cannot start.
RETRY_FIRST, RETRY_MAX = 2.0, 60.0
# The disk a waiting VM plugs and mounts once (warm_disk): its serial (no
# volume's: those are digests), its guest mount point, its image in the pool's directory.
WARM_DISK, WARM_DISK_MOUNT, WARM_DISK_IMAGE = "crust-warm", "/run/crust/warm-disk", "warm-disk.img"
WARM_DISK_BYTES = 4 * 1024 * 1024
# How long a VM booted at POOL_NICE (a pool's, the template's) may take to
# its guest's agent: nobody waits for it, and on a node busy with pods it
# gets only what they leave (minutes under emulation); a boot cut short
# starts again from nothing.
NICE_BOOT_TIMEOUT = 900.0
WARM_TIMEOUT = 60.0


class VmPool:
    def __init__(self, size: int, directory: Path, config: VmConfig):
        if size < 0:
            raise ValueError(f"pool size {size}: 0 or more")
        self.size = size
        self.directory = directory
        # Each pooled VM's own config (a plugged share or NIC changes it).
        self.config = config
        self.ready: list[Vm] = []
        self._booting = 0
        self._wanted = asyncio.Event()
        self._filler: asyncio.Task | None = None
        self.boots = 0          # VMs booted for the pool
        self.taken = 0          # VMs pods took

    def _vm_config(self, shared: tuple[SharedDir, ...]) -> VmConfig:
        # At nice 10 while it waits: a boot here never slows a pod starting
        # meanwhile on a busy machine; the pod that takes it gives it the
        # handler's priority back.
        return dataclasses.replace(self.config, shared_dirs=shared, nic=None, shared_memory=True, nice=POOL_NICE)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Stop what an earlier handler process left in the pool, then fill it."""
        make_dirs(self.directory)
        left = await asyncio.to_thread(_stop_leftovers, self.directory)
        if left:
            log.info("stopped the VMs an earlier handler left in its pool", extra={"fields": {"vms": left}})
        if self.size:
            self._filler = asyncio.create_task(self._fill(), name="vm-pool")
            self._wanted.set()

    async def stop(self) -> None:
        if self._filler is not None:
            self._filler.cancel()
            try:
                await self._filler
            except asyncio.CancelledError:
                pass
            self._filler = None
        ready, self.ready = self.ready, []
        for vm in ready:
            await _discard(vm)
        # The warm-up disk's image too (or its part, when a boot was cut
        # short): a stopped pool leaves its directory empty.
        for name in (WARM_DISK_IMAGE, WARM_DISK_IMAGE + ".partial"):
            (self.directory / name).unlink(missing_ok=True)

    # -- taking ------------------------------------------------------------------------

    def take(self) -> Vm | None:
        """A booted VM for a pod (it leaves the pool for good), or None."""
        while self.ready:
            vm = self.ready.pop(0)
            self._wanted.set()
            if vm.alive() and not vm.port.dead:
                self.taken += 1
                return vm
            log.warning("a pooled VM died while it waited; discarded", extra={"fields": {"vm": vm.name}})
            asyncio.get_running_loop().create_task(_discard(vm))
        return None

    async def discard(self, vm: Vm) -> None:
        """A VM taken but not used (its move into a pod's directory failed):
        stopped, its shares and directory removed, wherever it is."""
        await _discard(vm)

    def status(self) -> dict:
        return {"size": self.size, "ready": len(self.ready), "booting": self._booting, "boots": self.boots,
                "taken": self.taken}

    # -- filling -----------------------------------------------------------------------

    async def _fill(self) -> None:
        delay = RETRY_FIRST
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            while len(self.ready) + self._booting < self.size:
                self._booting += 1
                try:
                    vm = await self._boot()
                except (VmError, CrustError, ConnectionError, QmpError, QmpGone, CommandError, OSError) as exc:
                    log.error("a pooled VM did not boot; trying again later", extra={"fields": {
                        "error": str(exc)[:500], "retry_s": delay}})
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX)
                    continue
                finally:
                    self._booting -= 1
                delay = RETRY_FIRST
                self.ready.append(vm)

    async def _boot(self) -> Vm:
        name = NAME_PREFIX + secrets.token_hex(6)
        workdir = self.directory / name
        # Sockets out of the directory, which the pod renames.
        sockets = SHORT_SOCKET_ROOT / hashlib.sha256(f"{self.directory}/{name}".encode()).hexdigest()[:24]
        shares = (PodShare(workdir, "share"), PodShare(workdir, "live"))
        started = time.monotonic()
        served = [await asyncio.to_thread(share.set_up) for share in shares]
        vm = Vm(name, workdir, self._vm_config(tuple(
            SharedDir(share.tag, path, share.cache) for share, path in zip(shares, served))), socket_dir=sockets)
        try:
            await vm.start(NICE_BOOT_TIMEOUT)   # its guest's agent connected
            client = await vm.port.ready()
            for share in shares:
                await calls.mount_share(client, share.tag)
            # Every container of a pod binds the pod's /dev/shm: made now,
            # while the VM waits, not in the pod's first container's create.
            await calls.mount_pod_tmpfs(client, SHM_TMPFS, "")
            # And the guest's first container start and first disk (crun's
            # code and the kernel's, translated once under emulation) are
            # paid now, not by the pod.
            warm_started = time.monotonic()
            if vm.port.has("warm"):
                await port_warm(client)
            await warm_disk(vm, client, self.directory)
            warm_s = time.monotonic() - warm_started
        except BaseException:
            await _discard(vm)
            raise
        self.boots += 1
        log.info("pooled VM ready", extra={"fields": {"vm": name, "pid": vm.pid, "boot_s":
                                                      round(time.monotonic() - started, 2),
                                                      "warm_s": round(warm_s, 2)}})
        return vm


async def port_warm(client: AgentClient) -> None:
    """One throwaway container through the guest's crun (Warm)."""
    try:
        await client.call("Warm", agent_pb2.WarmRequest(), timeout=WARM_TIMEOUT)
    except ttrpc.TtrpcError as exc:
        raise handler_error(exc, "warm-up") from None


async def warm_disk(vm: Vm, client: AgentClient, directory: Path) -> None:
    """A small disk of crust's own hot-plugged read-only, mounted by the
    guest, unmounted and unplugged: the paths a pod's first volume takes
    (the hot-plug on the VM's disk bus, the disk's probe, a file system's
    mount), run once. Its image is made in directory, once. The host only
    writes the image (mkfs), never mounts it."""
    image = directory / WARM_DISK_IMAGE
    if not image.exists():
        partial = image.with_name(image.name + ".partial")
        await asyncio.to_thread(_sized_file, partial, WARM_DISK_BYTES)
        await fs.make(str(partial), "ext4")
        os.replace(partial, image)
    await vm.attach_disk(str(image), WARM_DISK, readonly=True, kind="file")
    try:
        await volume_calls.mount(client, volume_calls.storage(WARM_DISK, "ext4", [], True, WARM_DISK_MOUNT, None))
        await volume_calls.unmount(client, WARM_DISK_MOUNT)
    finally:
        await vm.detach_disk(WARM_DISK)


def _sized_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


async def _discard(vm: Vm) -> None:
    """A pooled VM stopped (nothing of a pod is in it), its shares unmounted
    and its directory removed."""
    try:
        await vm.kill()
    except Exception as exc:  # noqa: BLE001 - a VM that will not die is logged, its directory kept
        log.error("a pooled VM could not be stopped", extra={"fields": {"vm": vm.name, "error": str(exc)}})
        return
    await asyncio.to_thread(_remove, vm.workdir)


def _remove(workdir: Path) -> None:
    """A pool VM's directory: its shares' mounts first, then the tree (never through a mount)."""
    try:
        for name in ("share", "live"):
            PodShare(workdir, name).tear_down()
    except (ShareError, OSError) as exc:
        log.error("a pooled VM's shares could not be removed", extra={"fields": {
            "dir": str(workdir), "error": str(exc)}})
        return
    shutil.rmtree(workdir, ignore_errors=True)


def is_virtiofsd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"virtiofsd")
    except OSError:
        return False


def _stop_leftovers(directory: Path) -> list[str]:
    """VMs of the pool an earlier handler process left running: each one
    killed (only the QEMU its pid file and vm.json name), its directory and
    socket directory removed."""
    stopped = []
    for workdir in sorted(directory.iterdir()) if directory.is_dir() else []:
        if not workdir.name.startswith(NAME_PREFIX) or not workdir.is_dir() or workdir.is_symlink():
            continue
        identity = read_identity(workdir)
        try:
            pid = int((workdir / "qemu.pid").read_text().strip())
        except (OSError, ValueError):
            pid = 0
        qemu = proc.identify(pid) if pid > 0 else None
        if identity is not None and qemu is not None:
            def is_it(pid: int = qemu.pid, name: bytes = identity[0].encode()) -> bool:
                try:
                    return name in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    return False

            proc.signal_if(qemu.pid, is_it)
            deadline = time.monotonic() + 10
            while proc.alive(qemu) and time.monotonic() < deadline:
                time.sleep(0.05)
            # Its file servers end with QEMU's connection; those that do
            # not (a daemon wedged) are stopped as they were recorded.
            for record in workdir.glob("virtiofsd*.json"):
                try:
                    data = json.loads(record.read_text())
                    daemon = proc.ProcessId(int(data["pid"]), int(data["start"]))
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                proc.signal_if(daemon.pid, lambda d=daemon: proc.alive(d) and is_virtiofsd(d.pid))
        if identity is not None and identity[1].parent == SHORT_SOCKET_ROOT:
            shutil.rmtree(identity[1], ignore_errors=True)
        _remove(workdir)
        stopped.append(workdir.name)
    try:
        os.rmdir(SHORT_SOCKET_ROOT)
    except OSError:
        pass
    return stopped
