"""The proxy's core: deferred volumes, their claims, and the handlers.

One object shared by the CSI front end, the Runtime API and the registry,
so that "stage a description" is one code path whichever door it came in by.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import time
import weakref
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from crust.common.errors import (AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied,
                                 ResourceExhausted, Unavailable)
from crust.common.peergate import PeerCredentials
from crust.common.recordstore import RecordStore
from crust.contract import encryption
from crust.proxy.config import ProxyConfig
from crust.contract.mountinfo import MountInfo, digest
from crust.proxy.records import Claim, Decision, DeferredVolume, HandlerRecord
from crust.contract.volumes_dir import MirrorError, VolumesDir
from crust.sys import blockdev, proc

log = logging.getLogger(__name__)

DEFERRED_PUBLISHED = Counter("volumes_published_with_deferred_ops",
                             "NodePublishVolume calls answered with a deferred-mount description")
VOLUMES = Gauge("crust_proxy_deferred_volumes", "Deferred volumes by state", ["state"])
HANDLERS = Gauge("crust_proxy_handlers", "Registered runtime handlers", ["lease"])
SWEEP_BATCH = 64

# Bounds of the registry: a caller (even an allowed one) cannot grow the
# proxy's memory, its records or ListHandlers' answer without limit.
MAX_HANDLERS = 64
MAX_ENDPOINT_BYTES = 107  # a unix socket path (sun_path holds 108 bytes with its NUL)
MAX_LIST_ENTRIES = 16  # filesystems, features
MAX_LIST_ITEM = 32
# A handler whose lease expired this many lease periods ago, and that holds
# no claim, is forgotten (its record removed).
FORGET_AFTER_LEASES = 20


def lease_hash(lease_id: str) -> str:
    return hashlib.sha256(lease_id.encode()).hexdigest()


@dataclass
class Handler:
    name: str
    endpoint: str
    filesystems: list[str]
    features: list[str]
    # SHA-256 of the lease: the lease itself is known only to its holder.
    lease_sha256: str
    registered_by: PeerCredentials | None = None
    # Bumped by each registration, also one that keeps the lease (a
    # restarted handler): the router then connects afresh.
    generation: int = 0
    registered_at: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)

    def lease_age(self) -> float:
        return time.monotonic() - self.last_seen

    def holds(self, lease_id: str) -> bool:
        return bool(lease_id) and hmac.compare_digest(lease_hash(lease_id), self.lease_sha256)

    def record(self) -> HandlerRecord:
        by = self.registered_by
        return HandlerRecord(name=self.name, endpoint=self.endpoint, filesystems=self.filesystems,
                             features=self.features, lease_sha256=self.lease_sha256,
                             registered_by_uid=by.uid if by else -1, registered_by_pid=by.pid if by else 0)


class ProxyState:
    def __init__(self, config: ProxyConfig):
        self.config = config
        self.dir = VolumesDir(config.volumes_dir, config.kata_dir)
        belongs = lambda key, record: _target_belongs(key, record, config.kubelet_root)  # noqa: E731
        self.volumes = RecordStore(config.state_dir / "volumes", DeferredVolume, belongs)
        self.decisions = RecordStore(config.state_dir / "decisions", Decision, belongs)
        self.handler_records = RecordStore(config.state_dir / "handlers", HandlerRecord,
                                           lambda key, r: "" if r.name == key else f"it describes handler {r.name!r}")
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
        # Passphrases of encrypted volumes, by target path: in this process's
        # memory only (never a record, the entry, a log line or a metric);
        # lost with the process, brought again by kubelet's next publish.
        self._passphrases: dict[str, bytearray] = {}

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
                self._mark(volume, volume.claim.sandbox_id)
            self.by_digest[key] = volume
        for key, decision in self.decisions.load_all():
            if not os.path.lexists(decision.target_path):
                self.decisions.delete_sync(key)
        for key, record in self.handler_records.load_all():
            if key != record.name or len(self.handlers) >= MAX_HANDLERS:
                log.warning("ignoring a handler record", extra={"fields": {"record": key}})
                continue
            # Its lease counts from this start: the handler has one lease
            # period to come back with it before the name is free again.
            by = PeerCredentials(pid=record.registered_by_pid, uid=record.registered_by_uid, gid=-1) \
                if record.registered_by_uid >= 0 else None
            self.handlers[record.name] = Handler(
                name=record.name, endpoint=record.endpoint, filesystems=record.filesystems,
                features=record.features, lease_sha256=record.lease_sha256, registered_by=by)
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
        await self.forget_gone_handlers()
        return removed

    async def forget_gone_handlers(self) -> None:
        """Handlers whose lease expired long ago and that hold no claim are
        dropped, records and all (the registry stays bounded)."""
        holding = {v.claim.handler for v in self.by_digest.values() if v.claim is not None}
        limit = FORGET_AFTER_LEASES * self.config.lease_seconds
        for name, handler in list(self.handlers.items()):
            if name not in holding and handler.lease_age() > limit:
                del self.handlers[name]
                await self.handler_records.delete(name)
                log.info("forgot a handler gone for long", extra={"fields": {
                    "handler": name, "s": round(handler.lease_age())}})

    def _drop(self, key: str, target_path: str) -> None:
        self.drop_passphrase(target_path)
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

    def _mark(self, volume: DeferredVolume, sandbox_id: str | None) -> None:
        """Kata's claim marker in the mirror; a mirror that cannot be marked
        is reported like one that cannot be written (it is Kata's view only)."""
        try:
            self.dir.mark_sandbox(volume.target_path, sandbox_id)
        except MirrorError as exc:
            volume.kata_mirror_error = str(exc)
            log.warning("kata mirror not marked", extra={"fields": {"target_path": volume.target_path,
                                                                   "error": str(exc)}})

    async def stage(self, info: MountInfo) -> DeferredVolume:
        """Publish a description into the volumes directory (idempotent)."""
        key = digest(info.target_path)
        async with self._lock(key):
            return await self._stage(key, info)

    async def _stage(self, key: str, info: MountInfo) -> DeferredVolume:
        volume = self.by_digest.get(key)
        if volume is not None and volume.info == info and not volume.kata_mirror_error \
                and self.dir.holds(info):
            # A retried publish, or kubelet publishing again after its
            # restart: the same description is already on disk; writing it
            # again would only wake every watcher for nothing.
            return volume
        if volume is not None and volume.claim is not None and self.holder_alive(volume.claim) and \
                (volume.info.device, volume.info.device_major, volume.info.device_minor) != \
                (info.device, info.device_major, info.device_minor):
            raise FailedPrecondition(
                f"{info.target_path} is held by sandbox {volume.claim.sandbox_id} of handler "
                f"{volume.claim.handler} with device {volume.info.device}; it cannot change to {info.device}")
        previous = volume
        volume = DeferredVolume(target_path=info.target_path, info=info,
                                claim=volume.claim if volume is not None else None)
        # The record first: a crash after it leaves a record whose entry the
        # next start rewrites; a crash before it leaves nothing.
        await self.volumes.put(key, volume)
        try:
            await self._write_entry(volume)
            if volume.claim is not None:
                self._mark(volume, volume.claim.sandbox_id)  # a mirror written again lost Kata's marker
            if volume.kata_mirror_error:
                await self.volumes.put(key, volume)
        except BaseException:
            # The entry could not be written (a full watched directory): the
            # record goes back to what it was, so no record describes an
            # entry that is not there.
            await self._restore(key, info.target_path, previous)
            raise
        self.by_digest[key] = volume
        return volume

    async def _restore(self, key: str, target_path: str, previous: DeferredVolume | None) -> None:
        try:
            if previous is None:
                await asyncio.to_thread(self.dir.remove, target_path)
                await self.volumes.delete(key)
                log.info("a deferred volume whose entry could not be written was not kept",
                         extra={"fields": {"target_path": target_path}})
            else:
                await self.volumes.put(key, previous)
        except Exception as exc:  # noqa: BLE001 - the first failure is the one answered
            log.warning("could not put a deferred volume back as it was", extra={"fields": {
                "digest": key, "error": str(exc)}})

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
        self.drop_passphrase(target_path)
        self.dir.remove(target_path)
        await self.volumes.delete(key)
        self.by_digest.pop(key, None)

    # -- passphrases of encrypted volumes ------------------------------------------------

    def keep_passphrase(self, target_path: str, passphrase: bytearray) -> None:
        """Keep a copy (the caller wipes its own); an older one is wiped."""
        encryption.wipe(self._passphrases.get(target_path))
        self._passphrases[target_path] = bytearray(passphrase)

    def drop_passphrase(self, target_path: str) -> None:
        encryption.wipe(self._passphrases.pop(target_path, None))

    def passphrase(self, target_path: str) -> bytearray | None:
        return self._passphrases.get(target_path)

    # -- handlers and claims ----------------------------------------------------------

    def lease_fresh(self, name: str) -> bool:
        handler = self.handlers.get(name)
        return handler is not None and handler.lease_age() <= self.config.lease_seconds

    def claim_current(self, claim: Claim) -> bool:
        """The claim was made under the lease its handler holds now (or before
        leases were recorded in claims)."""
        handler = self.handlers.get(claim.handler)
        return handler is not None and (not claim.lease_sha256 or claim.lease_sha256 == handler.lease_sha256)

    def holder_alive(self, claim: Claim) -> bool:
        """A claim holds while its handler's lease is fresh and is the one it
        was made under, or, once it is not, while the sandbox's process still
        runs. A claim of a handler not seen since this proxy started holds
        for one lease period (it may be re-registering)."""
        if self.lease_fresh(claim.handler) and self.claim_current(claim):
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

    def _holder(self, name: str, lease_id: str) -> Handler:
        """The handler registered as name, if lease_id is its lease: the
        lease, not the name, says who is calling. A call that proves its
        lease renews it."""
        handler = self.handlers.get(name)
        if handler is None:
            raise NotFound(f"handler {name!r} is not registered (its registration was forgotten); register again")
        if not handler.holds(lease_id):
            raise PermissionDenied(f"lease_id is not the lease of handler {name!r}"
                                   if lease_id else f"lease_id is required to act as handler {name!r}")
        handler.last_seen = time.monotonic()
        return handler

    async def register(self, name: str, endpoint: str, filesystems: list[str], features: list[str],
                       lease_id: str = "", peer: PeerCredentials | None = None) -> tuple[Handler, str]:
        """Register name; returns the handler and its lease. With the lease of
        the current holder: the same handler again (a restart), lease kept.
        Without it: refused while the holder is alive, a new holder with a
        new lease once it is gone."""
        if len(endpoint.encode()) > MAX_ENDPOINT_BYTES:
            raise InvalidArgument(f"endpoint is longer than a unix socket path can be ({MAX_ENDPOINT_BYTES} bytes)")
        for field_name, values in (("filesystems", filesystems), ("features", features)):
            if len(values) > MAX_LIST_ENTRIES:
                raise InvalidArgument(f"{field_name} has {len(values)} entries; at most {MAX_LIST_ENTRIES}")
            for value in values:
                if not value or len(value) > MAX_LIST_ITEM or not value.isascii() or not value.isprintable():
                    raise InvalidArgument(f"{field_name} entries must be 1-{MAX_LIST_ITEM} printable ASCII "
                                          f"characters")
        async with self._lock("handler/" + name):
            current = self.handlers.get(name)
            if current is not None and current.holds(lease_id):
                changed = (current.endpoint, current.filesystems, current.features) != (endpoint, filesystems,
                                                                                        features)
                current.endpoint, current.filesystems, current.features = endpoint, filesystems, features
                current.last_seen = time.monotonic()
                current.generation += 1
                if changed:
                    await self.handler_records.put(name, current.record())
                log.info("handler registered again with its lease", extra={"fields": {
                    "handler": name, "endpoint": endpoint, "peer": str(peer) if peer else ""}})
                return current, lease_id
            if current is not None and self.lease_fresh(name):
                by = f" by {current.registered_by}" if current.registered_by else ""
                raise AlreadyExists(
                    f"handler name {name!r} is held by a live handler (registered{by}, last renewed "
                    f"{current.lease_age():.0f}s ago); register with its lease_id, or after its lease expires "
                    f"({self.config.lease_seconds}s without a heartbeat)")
            if current is None and len(self.handlers) >= MAX_HANDLERS:
                await self.forget_gone_handlers()
                if len(self.handlers) >= MAX_HANDLERS:
                    raise ResourceExhausted(f"the registry holds {MAX_HANDLERS} handlers, its limit; "
                                            "unregister one first")
            lease = secrets.token_hex(32)
            handler = Handler(name=name, endpoint=endpoint, filesystems=filesystems, features=features,
                              lease_sha256=lease_hash(lease), registered_by=peer)
            await self.handler_records.put(name, handler.record())
            self.handlers[name] = handler
            if current is not None:
                log.warning("replaced a handler whose lease expired", extra={"fields": {
                    "handler": name, "lease_age_s": round(current.lease_age(), 1), "peer": str(peer) if peer else ""}})
            log.info("handler registered", extra={"fields": {"handler": name, "endpoint": endpoint,
                                                             "peer": str(peer) if peer else ""}})
            return handler, lease

    def heartbeat(self, name: str, lease_id: str) -> Handler:
        return self._holder(name, lease_id)

    async def unregister(self, name: str, lease_id: str) -> None:
        async with self._lock("handler/" + name):
            handler = self.handlers.get(name)
            if handler is None:
                return  # idempotent
            self._holder(name, lease_id)
            await self.handler_records.delete(name)
            del self.handlers[name]
            log.info("handler unregistered", extra={"fields": {"handler": name}})

    async def claim(self, target_path: str, handler: str, sandbox_id: str, sandbox_pid: int,
                    lease_id: str) -> DeferredVolume:
        async with self._lock(digest(target_path)):
            return await self._claim(target_path, handler, sandbox_id, sandbox_pid, lease_id)

    async def _claim(self, target_path: str, handler: str, sandbox_id: str, sandbox_pid: int,
                     lease_id: str) -> DeferredVolume:
        holder = self._holder(handler, lease_id)
        volume = self.get(target_path)
        if volume is None:
            raise NotFound(f"no deferred volume is published at {target_path}")
        if volume.info.fstype not in holder.filesystems:
            raise FailedPrecondition(
                f"handler {handler!r} did not register file system {volume.info.fstype!r} "
                f"(it supports {', '.join(holder.filesystems) or 'none'})")
        missing = [f for f in encryption.required_features(volume.info.encryption, volume.info.integrity)
                   if f not in holder.features]
        if missing:
            # Its key goes only to a handler that opens it inside a VM guest,
            # as it was made (with its integrity, if any).
            raise FailedPrecondition(
                f"{target_path} is an encrypted volume ({volume.info.encryption}"
                f"{', integrity ' + volume.info.integrity if volume.info.integrity else ''}): handler {handler!r} "
                f"did not register the feature {missing[0]!r} (it opens no such volume); only a microVM handler "
                "opens it, inside its guest")
        current = volume.claim
        again = current is not None and (current.handler, current.sandbox_id) == (handler, sandbox_id)
        if volume.info.encryption and not again and target_path not in self._passphrases:
            raise Unavailable(
                f"{target_path} is an encrypted volume and the proxy holds no passphrase for it: it keeps "
                "passphrases in memory only and was restarted since kubelet published the volume; kubelet's "
                "next NodePublishVolume of it brings the node-publish secret again")
        if current is not None:
            if (current.handler, current.sandbox_id) == (handler, sandbox_id):
                if current.lease_sha256 == holder.lease_sha256 and current.sandbox_pid == sandbox_pid:
                    return volume  # the same sandbox claiming again: fine
                if current.lease_sha256 and current.lease_sha256 != holder.lease_sha256:
                    raise PermissionDenied(
                        f"{target_path} was claimed for sandbox {sandbox_id} under another lease of handler "
                        f"{handler!r}; a claim is renewed only under the lease it was made with")
                # A claim written before leases (adopted now) or a new pid.
            elif self.holder_alive(current):
                raise FailedPrecondition(
                    f"{target_path} is already claimed by sandbox {current.sandbox_id} of handler "
                    f"{current.handler}; a single-writer file system mounted by two sandboxes would be corrupted")
            else:
                log.info("taking over a claim whose holder is gone",
                         extra={"fields": {"target_path": target_path, "old_sandbox": current.sandbox_id}})
        # Everything the claim needs first (the entry and its mirror as the
        # record says, Kata's marker), the record last: a claim that failed
        # half-way is never recorded.
        if not self.dir.holds(volume.info):
            log.warning("rewriting a damaged entry before a claim", extra={"fields": {"target_path": target_path}})
            await self._write_entry(volume)
        self._mark(volume, sandbox_id)
        # The process is identified now, while the claimant vouches for it.
        process = proc.identify(sandbox_pid)
        claim = Claim(handler=handler, sandbox_id=sandbox_id, sandbox_pid=sandbox_pid,
                      sandbox_pid_start=process.start if process is not None else 0,
                      lease_sha256=holder.lease_sha256)
        updated = volume.model_copy(update={"claim": claim, "abnormal_reason": ""})
        try:
            await self.volumes.put(digest(target_path), updated)
        except BaseException:
            self._mark(volume, current.sandbox_id if current is not None else None)
            raise
        self.by_digest[digest(target_path)] = updated
        return updated

    async def release(self, target_path: str, handler: str, sandbox_id: str, abnormal_reason: str = "",
                      lease_id: str = "") -> None:
        async with self._lock(digest(target_path)):
            await self._release(target_path, handler, sandbox_id, abnormal_reason, lease_id)

    async def _release(self, target_path: str, handler: str, sandbox_id: str, abnormal_reason: str,
                       lease_id: str) -> None:
        holder = self._holder(handler, lease_id)
        volume = self.get(target_path)
        if volume is None or volume.claim is None:
            return
        if (volume.claim.handler, volume.claim.sandbox_id) != (handler, sandbox_id):
            raise FailedPrecondition(
                f"{target_path} is claimed by sandbox {volume.claim.sandbox_id} of handler "
                f"{volume.claim.handler}, not by {sandbox_id} of {handler}")
        if volume.claim.lease_sha256 and volume.claim.lease_sha256 != holder.lease_sha256:
            raise PermissionDenied(f"{target_path} was claimed under another lease of handler {handler!r}; "
                                   "only that lease releases it")
        updated = volume.model_copy(update={"claim": None, "abnormal_reason": abnormal_reason})
        await self.volumes.put(digest(target_path), updated)
        self.by_digest[digest(target_path)] = updated
        self._mark(updated, None)

    # -- deferral decisions ------------------------------------------------------------

    def decision(self, target_path: str) -> Decision | None:
        return self.decisions.get(digest(target_path))

    async def record_decision(self, decision: Decision) -> None:
        await self.decisions.put(digest(decision.target_path), decision)

    async def forget_decision(self, target_path: str) -> None:
        await self.decisions.delete(digest(target_path))


def check_handler_name(name: str) -> str:
    """A handler's name: it names the handler's record file too."""
    if not name or len(name) > 63 or not name[0].isascii() or not name[0].isalnum() \
            or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in name):
        raise InvalidArgument("name must be 1-63 characters of letters, digits, '-', '_' or '.', "
                              "starting with a letter or digit")
    return name


def _target_belongs(key: str, record: DeferredVolume | Decision, kubelet_root) -> str:
    """A volume's or decision's record is stored under its target's digest,
    and its target is a normalised path inside the kubelet root (where every
    target the proxy accepts lies): a record that names another place never
    becomes an entry of the watched directory."""
    if digest(record.target_path) != key:
        return f"it describes {record.target_path!r}, whose record is not {key!r}"
    root = os.path.normpath(str(kubelet_root))
    if os.path.normpath(record.target_path) != record.target_path or \
            not record.target_path.startswith(root.rstrip("/") + "/"):
        return f"its target {record.target_path!r} is not inside the kubelet root {root}"
    if isinstance(record, DeferredVolume) and record.info.target_path != record.target_path:
        return f"its description is of {record.info.target_path!r}, not of its target {record.target_path!r}"
    return ""
