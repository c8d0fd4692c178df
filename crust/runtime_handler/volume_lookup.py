"""Which deferred volume a mount's source is: the runtime handler's
lookup, public to the runtimes (crust-runc's sandboxes, the microVM's
containers). The proxy's entries in the watched directory first (the
handler's index), then a second source's (Kata's direct-volume layout); a
CSI target kubelet published a moment ago is waited for, woken by the
index, and one that holds the shim's placeholder without an entry is
refused rather than bound empty.

A mixin of crust.runtime_handler.handler.RuntimeHandler: index and
direct_source are the handler's.
"""

from __future__ import annotations

import asyncio
import time

from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.contract.mountinfo import PLACEHOLDER_SOURCE, digest
from crust.runtime_handler.resolve import CSI_DIR, SubpathEscapes, candidates, resolve
from crust.sys import mount as sysmount

ENTRY_WAIT = 5.0  # how long a CSI mount source may take to appear in the index


class VolumeLookup:
    async def find_volume(self, source: str):
        """(Resolved, direct?) of the deferred (or direct) volume a mount's
        source is or lies in; (None, False) when it is none. A CSI target
        published a moment ago is given ENTRY_WAIT for its entry; one that
        holds the shim's placeholder and has none is refused
        (FailedPrecondition), a subpath that leaves its volume too
        (InvalidArgument)."""
        try:
            resolved, direct = self.resolve(source)
            if resolved is None and CSI_DIR in source.split("/"):
                # kubelet published just now: give the entry a moment.
                resolved, direct = await self.wait_resolve(source)
        except SubpathEscapes as exc:
            raise InvalidArgument(str(exc)) from None
        if resolved is None and CSI_DIR in source.split("/"):
            self._refuse_unseen_deferred(source)
        return resolved, direct

    def _refuse_unseen_deferred(self, source: str) -> None:
        """A CSI target that holds the shim's placeholder was deferred to a
        sandbox: without its entry there is nothing to mount, and binding
        the placeholder would start the pod on an empty read-only directory
        instead of its volume."""
        for probe in candidates(source):
            entry = sysmount.at(probe)
            if entry is not None and entry.fs_type == "tmpfs" and entry.source == PLACEHOLDER_SOURCE:
                lost = self.index.watching()
                raise FailedPrecondition(
                    f"mount source {source}: {probe} was published deferred to a sandbox, but this handler sees no "
                    f"entry for it in {self.index.root}"
                    + (f" (its directory watcher is not working: {lost})" if lost else "")
                    + "; the placeholder is never bound in its place")

    def resolve(self, source: str):
        """(Resolved, direct?): the proxy's entry first, then the direct source's."""
        resolved = resolve(source, self.index)
        if resolved is not None or self.direct_source is None:
            return resolved, False
        resolved = self.direct_source.resolve(source)
        return resolved, resolved is not None

    async def wait_resolve(self, source: str):
        """Wait (up to ENTRY_WAIT) for an entry for source or a parent to be
        indexed: woken by the index's own update, never polling. A direct
        volume is read from its file when asked (Kata's drivers add it before
        the pod starts), so it is looked for again at each wake-up and at the
        end."""
        names = [digest(probe) for probe in candidates(source)]
        deadline = time.monotonic() + ENTRY_WAIT
        while True:
            woken = self.index.awaiting(names)
            try:
                resolved, direct = self.resolve(source)
                left = deadline - time.monotonic()
                if resolved is not None or left <= 0:
                    return resolved, direct
                try:
                    await asyncio.wait_for(woken, left)
                except asyncio.TimeoutError:
                    pass
            finally:
                self.index.forget(names, woken)
