"""File-system consistent snapshots of deferred volumes.

Before CreateSnapshot (or CreateVolumeGroupSnapshot) is forwarded, each
source volume that a sandbox on this node has mounted is frozen where it is
mounted, through the proxy's Runtime API (the claiming handler freezes it
in its sandbox); after the backend answered, failed, timed out or the call
was cancelled, it is thawed. The sandbox bounds the freeze by itself, so a
thaw that never arrives still ends it.

`crust.dev/freeze` (crust.contract.freeze_policy) says what a freeze that
cannot be done means: `best-effort` (the default: the snapshot is taken
crash-consistent, and the logs and metrics say so), `required` (the
snapshot fails FAILED_PRECONDITION), `never` (no freeze is asked for). The
snapshot class's value goes to the proxy, which applies the volume's own
(its StorageClass's) where the snapshot class names none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from prometheus_client import Counter, Histogram

from crust.common.errors import CrustError, FailedPrecondition, Forwarded
from crust.contract import freeze_policy
from crust.contract.freeze_policy import NEVER, PARAMETER, REQUIRED
from crust.csi_shim.runtime_client import RuntimeClient

log = logging.getLogger(__name__)

FREEZES = Counter("crust_shim_snapshot_freezes_total",
                  "Freezes of deferred volumes around snapshots, by outcome: done (frozen and thawed), "
                  "failed (could not freeze; the snapshot is crash-consistent or refused), timed_out (the "
                  "sandbox thawed by its own timeout before the thaw came)", ["outcome"])
FROZEN_SECONDS = Histogram("crust_shim_snapshot_frozen_seconds",
                           "How long the volumes of one snapshot stayed frozen, as the shim measures it",
                           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
for _outcome in ("done", "failed", "timed_out"):
    FREEZES.labels(_outcome)

# The calls to the proxy: a freeze syncs the file system first.
FREEZE_CALL_TIMEOUT = 20.0
THAW_CALL_TIMEOUT = 15.0


def mode_of(parameters, field: str = "parameters") -> str:
    """The snapshot class's mode; "" when it names none (the volume's applies)."""
    return freeze_policy.of(parameters, field, default="")


def without_ours(parameters, forwarded) -> None:
    """The backend never sees crust's parameter: it may refuse ones it does not know."""
    if PARAMETER in parameters:
        del forwarded[PARAMETER]


class SnapshotFreezer:
    def __init__(self, runtime: RuntimeClient, timeout_seconds: int):
        self.runtime = runtime
        # The bound each sandbox applies: longer than the slowest snapshot
        # the backend takes, short enough that a lost thaw does not stall a pod.
        self.timeout_seconds = timeout_seconds

    @contextlib.asynccontextmanager
    async def frozen(self, volume_ids, mode: str, what: str):
        """Freeze every volume in a sandbox of this node (in sorted order, so
        two group snapshots sharing volumes cannot wait on each other), run
        the block, thaw them all whatever the block did."""
        # By volume, the targets frozen ([]: not known, all of them).
        held: dict[str, list[str]] = {}
        if mode != NEVER:
            try:
                for volume_id in sorted(set(volume_ids)):
                    # Held before the answer: a freeze cancelled midway (the
                    # CO gave up) may still land in the sandbox, and is thawed.
                    held[volume_id] = []
                    try:
                        frozen = await self._freeze(volume_id, mode, what)
                    except CrustError:
                        del held[volume_id]   # refused: the proxy left nothing frozen
                        raise
                    if frozen:
                        held[volume_id] = frozen
                    else:
                        del held[volume_id]
            except BaseException:
                await asyncio.shield(self._thaw(held, time.monotonic(), what))
                raise
        start = time.monotonic()
        try:
            yield sorted(held)
        finally:
            if held:
                # Shielded: a cancelled call (the CO gave up) still thaws.
                await asyncio.shield(self._thaw(held, start, what))

    async def _freeze(self, volume_id: str, mode: str, what: str) -> list[str]:
        """The targets frozen."""
        fields = {"volume": volume_id, "snapshot": what, "mode": mode or "the volume's"}
        try:
            answer = await self.runtime.freeze(volume_id, self.timeout_seconds, mode, FREEZE_CALL_TIMEOUT)
        except CrustError as exc:
            FREEZES.labels("failed").inc()
            # The proxy answered an error only for a target whose policy
            # (the snapshot class's or the volume's) is required; an
            # unreachable proxy (a controller on another node) is refused
            # only when the snapshot class asks for it.
            if isinstance(exc, Forwarded) or mode == REQUIRED:
                log.error("could not freeze the volume; the snapshot is refused",
                          extra={"fields": {**fields, "error": exc.message}})
                raise FailedPrecondition(f"volume {volume_id} could not be frozen for snapshot {what} and "
                                         f"{PARAMETER} is {REQUIRED}: {exc.message}") from None
            log.warning("could not freeze the volume; the snapshot is crash-consistent",
                        extra={"fields": {**fields, "error": exc.message}})
            return []
        for target in answer:
            if target.error:
                FREEZES.labels("failed").inc()
                log.warning("could not freeze the volume; the snapshot is crash-consistent",
                            extra={"fields": {**fields, "target": target.volume_target_path,
                                              "sandbox": target.sandbox_id, "error": target.error}})
        frozen = [t for t in answer if t.frozen]
        if not frozen:
            if not answer:
                log.info("the volume is in no sandbox on this node: nothing to freeze", extra={"fields": fields})
            return []
        log.info("volume frozen for a snapshot", extra={"fields": {
            **fields, "targets": [t.volume_target_path for t in frozen],
            "sandboxes": [t.sandbox_id for t in frozen]}})
        return [t.volume_target_path for t in frozen]

    async def _thaw(self, held: dict[str, list[str]], start: float, what: str) -> None:
        for volume_id in sorted(held, reverse=True):
            fields = {"volume": volume_id, "snapshot": what}
            try:
                thawed = await self.runtime.thaw(volume_id, held[volume_id], THAW_CALL_TIMEOUT)
            except CrustError as exc:
                FREEZES.labels("failed").inc()
                log.error("thaw failed; the sandbox's own timeout ends the freeze",
                          extra={"fields": {**fields, "error": exc.message}})
                continue
            if any(not t.was_frozen for t in thawed):
                FREEZES.labels("timed_out").inc()
                log.warning("the freeze had already ended by its timeout before the thaw: the snapshot may be "
                            "only crash-consistent", extra={"fields": fields})
            else:
                FREEZES.labels("done").inc()
        if held:
            FROZEN_SECONDS.observe(time.monotonic() - start)
            log.info("volumes thawed after a snapshot", extra={"fields": {
                "volumes": sorted(held), "snapshot": what, "frozen_seconds": round(time.monotonic() - start, 3)}})
