"""The proxy's core: deferred volumes, their claims, and the handlers.

One object shared by the CSI front end, the Runtime API and the registry,
so that "stage a description" is one code path whichever door it came in by.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import weakref
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from crust.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from crust.common.recordstore import RecordStore
from crust.proxy.config import ProxyConfig
from crust.contract.mountinfo import MountInfo, digest
from crust.proxy.records import Claim, Decision, DeferredVolume
from crust.contract.volumes_dir import MirrorError, VolumesDir
from crust.sys import blockdev, proc

log = logging.getLogger(__name__)

DEFERRED_PUBLISHED = Counter("volumes_published_with_deferred_ops",
                             "NodePublishVolume calls answered with a deferred-mount description")
VOLUMES = Gauge("crust_proxy_deferred_volumes", "Deferred volumes by state", ["state"])
HANDLERS = Gauge("crust_proxy_handlers", "Registered runtime handlers", ["lease"])
SWEEP_BATCH = 64


@dataclass
class Handler:
    name: str
    endpoint: str
    filesystems: list[str]
    features: list[str]
    lease_id: str
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)

    def lease_age(self) -> float:
        return time.monotonic() - self.last_seen


class ProxyState:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.dir = VolumesDir(config.volumes_dir, config.kata_dir)
        self.volumes = RecordStore(config.state_dir / "volumes", DeferredVolume)
        self.decisions = RecordStore(config.state_dir / "decisions", Decision)
        self.handlers: dict[str, Handler] = {}
        self.started = time.monotonic()
        # Volumes in memory, by digest of the target path: 1000 volumes are
        # a dict lookup, not a directory scan, per call.
        self.by_digest: dict[str, DeferredVolume] = {}
        self._register_gauges()
        # One lock per target: stage, unstage, claim, release and the sweep
        # read a volume, await a record write, then replace the volume; two of
        # them interleaved on one target would lose (or bring back) a claim.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def _lock(self, key: str) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    # -- start-up and sweep -----------------------------------------------------

    async def reconcile(self) -> None:
        """Rebuild the volumes directory from the records for every target
        kubelet still has, drop the rest, and remove stray entries."""
        for key, volume in self.volumes.load_all():
            if not os.path.lexists(volume.target_path):
                self.dir.remove(volume.target_path)
                self.volumes.delete_sync(key)
                log.info("dropped deferred volume whose target is gone",
                         extra={"fields": {"target_path": volume.target_path}})
                continue
            self.dir.clean_temporaries(volume.target_path)
            if not self.dir.holds(volume.info):
                # Only what is missing or differs (the directory was on /run
                # and the node rebooted): rewriting every entry would cost a
                # few fsyncs per volume at each start and wake every watcher.
                await self._write_entry(volume)
            if volume.claim is not None:
                self.dir.mark_sandbox(volume.target_path, volume.claim.sandbox_id)
            self.by_digest[key] = volume
        for key, decision in self.decisions.load_all():
            if not os.path.lexists(decision.target_path):
                self.decisions.delete_sync(key)
        for name in self.dir.digests():
            if name not in self.by_digest:
                log.info("removing an entry no record explains", extra={"fields": {"digest": name}})
                self.dir.remove_digest(name)

    async def sweep(self) -> int:
        """Remove entries whose target path is gone and that no live sandbox holds."""
        removed = 0
        for i, key in enumerate(list(self.by_digest)):
            if i % SWEEP_BATCH == SWEEP_BATCH - 1:
                # Thousands of volumes: calls are served between batches
                # instead of waiting for the whole pass.
                await asyncio.sleep(0)
            volume = self.by_digest.get(key)
            if volume is None or os.path.lexists(volume.target_path):
                continue  # the common case, decided without a lock of its own
            async with self._lock(key):
                volume = self.by_digest.get(key)
                if volume is None or os.path.lexists(volume.target_path):
                    continue
                if volume.claim is not None and self.holder_alive(volume.claim):
                    continue
                await asyncio.to_thread(self._drop, key, volume.target_path)
                del self.by_digest[key]
                removed += 1
        return removed

    def _drop(self, key: str, target_path: str) -> None:
        self.dir.remove(target_path)
        self.volumes.delete_sync(key)
        self.decisions.delete_sync(key)

    def _register_gauges(self) -> None:
        """Gauges are computed when Prometheus scrapes, so stage and unstage
        stay O(1) however many volumes there are."""
        for state in ("unclaimed", "claimed", "holder-gone"):
            VOLUMES.labels(state).set_function(
                lambda state=state: sum(1 for v in self.by_digest.values() if self.volume_state(v) == state))
        HANDLERS.labels("fresh").set_function(
            lambda: sum(1 for name in self.handlers if self.lease_fresh(name)))
        HANDLERS.labels("expired").set_function(
            lambda: sum(1 for name in self.handlers if not self.lease_fresh(name)))

    # -- deferred volumes ----------------------------------------------------------

    def get(self, target_path: str) -> DeferredVolume | None:
        return self.by_digest.get(digest(target_path))

    async def _write_entry(self, volume: DeferredVolume) -> None:
        try:
            await self.dir.write(volume.info)
            volume.kata_mirror_error = ""
        except MirrorError as exc:
            volume.kata_mirror_error = str(exc)
            log.warning("kata mirror not written", extra={"fields": {"target_path": volume.target_path,
                                                                    "error": str(exc)}})

    async def stage(self, info: MountInfo) -> DeferredVolume:
        """Publish a description into the volumes directory (idempotent)."""
        key = digest(info.target_path)
        async with self._lock(key):
            return await self._stage(key, info)

    async def _stage(self, key: str, info: MountInfo) -> DeferredVolume:
        volume = self.by_digest.get(key)
        if volume is not None and volume.info == info and not volume.kata_mirror_error \
                and self.dir.read(info.target_path) == info:
            # A retried publish, or kubelet publishing again after its
            # restart: the same description is already on disk; writing it
            # again would only wake every watcher for nothing.
            return volume
        if volume is not None and volume.info.device != info.device and volume.claim is not None \
                and self.holder_alive(volume.claim):
            raise FailedPrecondition(
                f"{info.target_path} is held by sandbox {volume.claim.sandbox_id} of handler "
                f"{volume.claim.handler} with device {volume.info.device}; it cannot change to {info.device}")
        volume = DeferredVolume(target_path=info.target_path, info=info,
                                claim=volume.claim if volume is not None else None)
        # The record first: a crash after it leaves a record whose entry the
        # next start rewrites; a crash before it leaves nothing.
        await self.volumes.put(key, volume)
        await self._write_entry(volume)
        if volume.kata_mirror_error:
            await self.volumes.put(key, volume)
        self.by_digest[key] = volume
        return volume

    async def refresh_capacity(self, target_path: str) -> None:
        """After an expansion: the entry's capacity-bytes follows the grown
        device (a publish after a kubelet restart then finds it unchanged)."""
        key = digest(target_path)
        async with self._lock(key):
            volume = self.by_digest.get(key)
            if volume is None:
                return
            try:
                size = blockdev.size_of(volume.info.device_major, volume.info.device_minor)
            except (OSError, ValueError):
                return  # the device is gone: nothing truthful to write
            if size != volume.info.capacity_bytes:
                await self._stage(key, volume.info.model_copy(update={"capacity_bytes": size}))

    async def unstage(self, target_path: str) -> None:
        key = digest(target_path)
        async with self._lock(key):
            await self._unstage(key, target_path)

    async def _unstage(self, key: str, target_path: str) -> None:
        volume = self.by_digest.get(key)
        if volume is not None and volume.claim is not None and self.holder_alive(volume.claim):
            raise Unavailable(
                f"{target_path} is still held by sandbox {volume.claim.sandbox_id} of handler "
                f"{volume.claim.handler}; retry after the sandbox stops")
        self.dir.remove(target_path)
        await self.volumes.delete(key)
        self.by_digest.pop(key, None)

    # -- handlers and claims ----------------------------------------------------------

    def lease_fresh(self, name: str) -> bool:
        handler = self.handlers.get(name)
        return handler is not None and handler.lease_age() <= self.config.lease_seconds

    def holder_alive(self, claim: Claim) -> bool:
        """A claim holds while its handler's lease is fresh, or, once it is
        not, while the sandbox's process still runs. A claim of a handler not
        seen since this proxy started holds for one lease period (it may be
        re-registering)."""
        if self.lease_fresh(claim.handler):
            return True
        if claim.sandbox_pid and proc.alive(claim.sandbox_process()):
            return True
        if claim.handler not in self.handlers:
            return time.monotonic() - self.started <= self.config.lease_seconds
        return False

    def volume_state(self, volume: DeferredVolume) -> str:
        if volume.claim is None:
            return "unclaimed"
        return "claimed" if self.holder_alive(volume.claim) else "holder-gone"

    def register(self, name: str, endpoint: str, filesystems: list[str], features: list[str]) -> Handler:
        handler = Handler(name=name, endpoint=endpoint, filesystems=filesystems, features=features,
                          lease_id=secrets.token_hex(12))
        self.handlers[name] = handler
        log.info("handler registered", extra={"fields": {"handler": name, "endpoint": endpoint}})
        return handler

    def heartbeat(self, name: str, lease_id: str) -> Handler:
        handler = self.handlers.get(name)
        if handler is None or handler.lease_id != lease_id:
            raise NotFound(f"handler {name!r} is not registered (the proxy may have restarted); register again")
        handler.last_seen = time.monotonic()
        return handler

    def unregister(self, name: str, lease_id: str) -> None:
        handler = self.handlers.get(name)
        if handler is not None and handler.lease_id == lease_id:
            del self.handlers[name]

    async def claim(self, target_path: str, handler: str, sandbox_id: str, sandbox_pid: int) -> DeferredVolume:
        async with self._lock(digest(target_path)):
            return await self._claim(target_path, handler, sandbox_id, sandbox_pid)

    async def _claim(self, target_path: str, handler: str, sandbox_id: str, sandbox_pid: int) -> DeferredVolume:
        volume = self.get(target_path)
        if volume is None:
            raise NotFound(f"no deferred volume is published at {target_path}")
        if handler not in self.handlers:
            raise FailedPrecondition(f"handler {handler!r} is not registered; register before claiming")
        if volume.info.fstype not in self.handlers[handler].filesystems:
            raise FailedPrecondition(
                f"handler {handler!r} did not register file system {volume.info.fstype!r} "
                f"(it supports {', '.join(self.handlers[handler].filesystems) or 'none'})")
        current = volume.claim
        if current is not None:
            if (current.handler, current.sandbox_id) == (handler, sandbox_id):
                return volume  # the same sandbox claiming again: fine
            if self.holder_alive(current):
                raise FailedPrecondition(
                    f"{target_path} is already claimed by sandbox {current.sandbox_id} of handler "
                    f"{current.handler}; a single-writer file system mounted by two sandboxes would be corrupted")
            log.info("taking over a claim whose holder is gone",
                     extra={"fields": {"target_path": target_path, "old_sandbox": current.sandbox_id}})
        # The process is identified now, while the claimant vouches for it.
        process = proc.identify(sandbox_pid)
        volume.claim = Claim(handler=handler, sandbox_id=sandbox_id, sandbox_pid=sandbox_pid,
                             sandbox_pid_start=process.start if process is not None else 0)
        volume.abnormal_reason = ""
        await self.volumes.put(digest(target_path), volume)
        self.dir.mark_sandbox(target_path, sandbox_id)
        return volume

    async def release(self, target_path: str, handler: str, sandbox_id: str, abnormal_reason: str = "") -> None:
        async with self._lock(digest(target_path)):
            await self._release(target_path, handler, sandbox_id, abnormal_reason)

    async def _release(self, target_path: str, handler: str, sandbox_id: str, abnormal_reason: str = "") -> None:
        volume = self.get(target_path)
        if volume is None or volume.claim is None:
            return
        if (volume.claim.handler, volume.claim.sandbox_id) != (handler, sandbox_id):
            raise FailedPrecondition(
                f"{target_path} is claimed by sandbox {volume.claim.sandbox_id} of handler "
                f"{volume.claim.handler}, not by {sandbox_id} of {handler}")
        volume.claim = None
        volume.abnormal_reason = abnormal_reason
        await self.volumes.put(digest(target_path), volume)
        self.dir.mark_sandbox(target_path, None)

    # -- deferral decisions ------------------------------------------------------------

    def decision(self, target_path: str) -> Decision | None:
        return self.decisions.get(digest(target_path))

    async def record_decision(self, decision: Decision) -> None:
        await self.decisions.put(digest(decision.target_path), decision)

    async def forget_decision(self, target_path: str) -> None:
        await self.decisions.delete(digest(target_path))


def check_handler_name(name: str) -> str:
    if not name or len(name) > 63 or not all(c.isalnum() or c in "-_." for c in name):
        raise InvalidArgument("name must be 1-63 characters of letters, digits, '-', '_' or '.'")
    return name
