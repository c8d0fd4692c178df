"""A microVM pod's deferred volumes, as a whole: mounted ahead of its
containers when the pod starts, and given back (unmounted in the guest,
unplugged, released) once no container of the pod binds them. Claiming,
checking, hot-plugging and mounting one is the RuntimeHandler's machinery
(crust.runtime_handler.handler)."""

from __future__ import annotations

import asyncio
import logging
import time

from crust.common.errors import CrustError
from crust.kata.pod.registry import PodRegistry
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord
from crust.runtime_handler.resolve import pod_volumes
from crust.sys.run import rpc_deadline

log = logging.getLogger("crust.kata.pod.pods")


class PodVolumes:
    def __init__(self, registry: PodRegistry, handler: RuntimeHandler):
        self.registry = registry
        self.handler = handler
        self._ahead: dict[str, asyncio.Task] = {}   # by pod: its deferred volumes being mounted ahead

    async def close(self) -> None:
        if self._ahead:
            # A mount ahead ends with its volume recorded (or given back):
            # the next handler adopts it like any other.
            await asyncio.wait(list(self._ahead.values()), timeout=30)

    def mount_ahead(self, sandbox_id: str, uid: str) -> None:
        """The pod's deferred volumes mounted in the background (_mount_ahead)."""
        task = asyncio.create_task(self._mount_ahead(sandbox_id, uid))
        self._ahead[sandbox_id] = task
        task.add_done_callback(lambda t: self._ahead.pop(sandbox_id, None) if self._ahead.get(sandbox_id) is t
                               else None)

    async def _mount_ahead(self, sandbox_id: str, uid: str) -> None:
        """The pod's deferred volumes are published before kubelet runs the
        pod: each is claimed, hot-plugged and mounted in the guest now, while
        kubelet goes on to the pod's containers (their CreateContainer waits
        for this), so a container's start only binds it. A volume that fails
        here is given back and left to the CreateContainer of the container
        that binds it, which mounts it (or fails) as if this had not run."""
        rpc_deadline.set(None)   # this task's own: it outlives the CreatePod that started it
        started = time.monotonic()
        mounted = []
        async with self.registry.locks[sandbox_id]:
            try:
                sandbox, record, _ = self.registry.live(sandbox_id)
            except CrustError:
                return   # stopped or deleted meanwhile
            for resolved in pod_volumes(uid, self.handler.index):
                key = resolved.digest
                if key in record.volumes:
                    continue
                try:
                    with self.handler.inflight.hold(sandbox_id):
                        await self.handler.mount_volume(sandbox, record, key, resolved.info, [])
                        await self.handler.save(record)
                    mounted.append(resolved.info.target_path)
                except Exception as exc:  # noqa: BLE001 - nobody awaits this task: every failure is logged here
                    log.warning("volume not mounted ahead; its container's create mounts it", extra={"fields": {
                        "sandbox": sandbox_id, "target_path": resolved.info.target_path,
                        "error": str(exc)[:500]}})
                    try:
                        await self.give_back(sandbox, record, key)
                    except CrustError as undo:
                        log.error("could not give back a volume whose mount ahead failed", extra={"fields": {
                            "sandbox": sandbox_id, "target_path": resolved.info.target_path,
                            "error": undo.message}})
                    await self.handler.save(record)
        if mounted:
            log.info("volumes mounted ahead", extra={"fields": {
                "sandbox": sandbox_id, "target_paths": mounted, "seconds": round(time.monotonic() - started, 3)}})

    async def settled(self, sandbox_id: str) -> None:
        """Wait for the pod's mounts ahead, if they still run."""
        task = self._ahead.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)

    async def give_back(self, sandbox: KataSandbox | None, record: SandboxRecord, key: str) -> None:
        """Unmount a volume of the pod in the guest (sandbox None: the VM is
        gone), unplug it, release its claim, forget it. Every step may run
        again."""
        volume = record.volumes.get(key)
        if volume is None:
            return
        if sandbox is not None:
            await sandbox.unmount(volume.mount_point)
            if volume.encrypted_name:
                await sandbox.close_encrypted(volume.encrypted_name)
            await sandbox.detach(volume.device)
        await self.handler.release_volume(volume, record.sandbox_id, "")
        record.volumes.pop(key, None)
