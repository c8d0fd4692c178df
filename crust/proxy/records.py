"""The proxy's own records, kept in --state-dir on persistent storage.

The volumes directory may live on /run and vanish with a reboot; these
records survive it, and on start the proxy rebuilds the directory from them
for every target kubelet still has published.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from crust.contract.mountinfo import MountInfo
from crust.sys.proc import ProcessId, recorded


class Claim(BaseModel):
    handler: str
    sandbox_id: str
    sandbox_pid: int = 0
    # When that process started (ticks since boot, read at the claim): with
    # the pid, the sandbox's process for good, so a reused pid never holds
    # the claim. 0 in records written before it was kept.
    sandbox_pid_start: int = 0
    claimed_at: float = Field(default_factory=time.time)
    # SHA-256 (hex) of the lease the claim was made under; empty in a claim
    # written before leases were identities (adopted by its handler's next
    # claim of the same sandbox).
    lease_sha256: str = ""

    def sandbox_process(self) -> ProcessId | None:
        """The sandbox's process this claim names (None: none to trust)."""
        return recorded(self.sandbox_pid, self.sandbox_pid_start, self.claimed_at)


class HandlerRecord(BaseModel):
    """A registered runtime handler, kept so that its lease (its identity)
    survives a restart of the proxy. The lease itself is never stored."""

    name: str
    endpoint: str
    filesystems: list[str] = Field(default_factory=list)
    features: list[str] = Field(default_factory=list)
    lease_sha256: str
    registered_at: float = Field(default_factory=time.time)
    registered_by_uid: int = -1
    registered_by_pid: int = 0


class DeferredVolume(BaseModel):
    """A deferred volume the proxy published into the volumes directory."""

    target_path: str
    info: MountInfo
    staged_at: float = Field(default_factory=time.time)
    claim: Claim | None = None
    kata_mirror_error: str = ""
    # Why the last holder let go abnormally (its sandbox crashed), if it did.
    abnormal_reason: str = ""


class Decision(BaseModel):
    """Whether NodePublishVolume of this target was deferred, and why: later
    calls for the target (stats, expand, unpublish) carry the same flag, as
    kubelet keeps deferFSMount in vol_data.json."""

    target_path: str
    volume_id: str
    deferred: bool
    reason: str
    decided_at: float = Field(default_factory=time.time)
