"""How the claims of crust-runc's containers end when no `delete` says so
(crust.runtime_handler.containers): a container that ran and is over
lets go of its volumes at once; one whose preparing runtime died, after a
grace; and after a handler's (re-)registration, the recorded containers
claim again.

A container is over when its init is gone and no process is left in its
mount namespace: the kernel took the namespace's mounts with its last
member, so nothing of the pod mounts the volume any more. CRI-O has the
runtime delete a stopped container only at RemoveContainer, which kubelet
calls after it unmounted the pod's volumes: the claim cannot wait for that
delete. The reaper looks every second; the proxy's GetSandbox, asked
before it refuses an unpublish, looks at once (crust.runtime_handler.service).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Awaitable, Callable

from crust.common.errors import CrustError
from crust.runtime_handler.container_records import CREATED, ContainerRecord
from crust.runtime_handler.registration import Registration
from crust.sys import proc

log = logging.getLogger("crust.runtime_handler.containers")
# How long a container whose preparing runtime died keeps its claims
# before the reaper releases them: the runtime's own `delete` normally
# comes first.
REAP_GRACE = 5.0


def mount_namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return ""


def namespace_has_members(namespace: str) -> bool:
    if not namespace:
        return False
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and mount_namespace(int(entry.name)) == namespace:
            return True
    return False


class ContainerEnds:
    """Ends the claims no runtime released, of the containers in
    `containers` (ContainerVolumes' records, by container id): `release`
    lets go of a container's claims as its delete would (with an abnormal
    reason, or none), `holder_pid` names the process a pod's claim on a
    target holds with."""

    def __init__(self, containers: dict[str, ContainerRecord], registration: Registration,
                 release: Callable[..., Awaitable[None]], holder_pid: Callable[[str, str], int],
                 reap_grace: float = REAP_GRACE):
        self.containers = containers
        self.registration = registration
        self.release = release
        self.holder_pid = holder_pid
        self.reap_grace = reap_grace
        self.gone_since: dict[str, float] = {}   # by container: when its claims were first seen not held

    def forget(self, container_id: str) -> None:
        """A container whose claims were released."""
        self.gone_since.pop(container_id, None)

    async def reclaim(self) -> None:
        """After each (re-)registration: the claims of the recorded containers."""
        for record in list(self.containers.values()):
            for target in record.targets():
                try:
                    await self.registration.claim(
                        target, record.sandbox_id, self.holder_pid(target, record.sandbox_id))
                except CrustError as exc:
                    log.error("lost a container's claim", extra={"fields": {
                        "container": record.container_id, "target_path": target, "error": exc.message}})

    @staticmethod
    def exited(record: ContainerRecord) -> bool:
        """The container ran and is over: its init is gone and no process is
        left in its mount namespace, so the kernel took the namespace's
        mounts of its volumes with it."""
        return (record.state == CREATED and not proc.alive(record.init())
                and not namespace_has_members(record.mount_namespace))

    def gone(self, record: ContainerRecord) -> str:
        """Why a container's claims are no longer held ("" while they are)."""
        if record.state == CREATED:
            if not self.exited(record):
                return ""
            return f"container {record.container_id} exited and no runtime deleted it"
        if proc.alive(record.runtime()):
            return ""
        return f"the runtime preparing container {record.container_id} died before runc created it"

    async def release_exited(self, sandbox_id: str = "") -> list[str]:
        """Release the claims of the containers (of one pod, or all) that ran
        and are over, as their delete would: an ordinary end, not an
        abnormal one."""
        released = []
        for container_id, record in list(self.containers.items()):
            if sandbox_id and record.sandbox_id != sandbox_id:
                continue
            if not await asyncio.to_thread(self.exited, record):
                continue
            log.info("container exited: releasing its volumes before its delete", extra={"fields": {
                "container": container_id, "sandbox": record.sandbox_id}})
            try:
                await self.release(container_id)
                released.append(container_id)
            except CrustError as exc:
                log.warning("could not release an exited container's claims", extra={"fields": {
                    "container": container_id, "error": exc.message}})
        return released

    async def reap_once(self) -> list[str]:
        released = await self.release_exited()
        now = time.monotonic()
        for container_id, record in list(self.containers.items()):
            reason = await asyncio.to_thread(self.gone, record)
            if not reason:
                self.gone_since.pop(container_id, None)
                continue
            since = self.gone_since.setdefault(container_id, now)
            if now - since < self.reap_grace:
                continue
            log.warning("releasing the claims of a gone container", extra={"fields": {
                "container": container_id, "reason": reason}})
            try:
                await self.release(container_id, reason)
                released.append(container_id)
            except CrustError as exc:
                log.warning("could not release a gone container's claims", extra={"fields": {
                    "container": container_id, "error": exc.message}})
        return released

    async def reap_forever(self, interval: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.reap_once()
