"""How a daemon's allocator gives memory back after large requests.

A request of megabytes (gRPC accepts up to 4 MiB; a proxy forwards them as
they come) passes through buffers of that size in gRPC's threads and ours.
glibc keeps what they free: an allocation of at least M_MMAP_THRESHOLD bytes
(128 KiB to start with) gets its own mmap, returned to the kernel when
freed, but each such free raises the threshold to the block's size (up to
32 MiB), so later buffers of that size come from the heap arenas (one per
gRPC thread), where freed memory stays in the RSS and fragments; the
smaller slices gRPC reads a message into stay there too. A proxy forwarding
bursts of 4 MiB requests kept hundreds of MiB that way (docs/performance.md,
"Memory under large requests"). So a daemon:

- sets M_MMAP_THRESHOLD to 1 MiB at start (give_back_large_buffers): buffers
  that large are always mapped and always given back;
- notes every request of 1 MiB or more (note_request_size, called by the
  interceptor) and, at most once a second after one, asks glibc to give the
  free memory of its arenas back (malloc_trim), in a worker thread.

Small allocations, all a daemon makes in normal work, are not affected, and
a daemon that never sees a large request never trims.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
LARGE_BUFFER = 1 << 20
TRIM_INTERVAL = 1.0

_large_seen = False


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def give_back_large_buffers(threshold: int = LARGE_BUFFER) -> bool:
    """mallopt(M_MMAP_THRESHOLD, threshold); False where there is no glibc."""
    libc = _libc()
    try:
        done = libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except AttributeError:
        done = False
    if not done:
        log.debug("the allocator's mmap threshold could not be set")
    return done


PR_SET_DUMPABLE = 4


def no_core_dumps() -> list[str]:
    """A daemon may hold an encrypted volume's passphrase in its memory: no
    core dump of it, ever. RLIMIT_CORE 0 (soft and hard: the daemon and what
    it starts write none) and PR_SET_DUMPABLE 0 (no core even through a
    core_pattern pipe, and no ptrace or /proc/<pid>/mem for anyone without
    CAP_SYS_PTRACE). Returns what could not be done (logged by the caller)."""
    import resource

    failed = []
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ValueError, OSError) as exc:
        failed.append(f"RLIMIT_CORE: {exc}")
    libc = _libc()
    if libc is None or libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        failed.append(f"prctl(PR_SET_DUMPABLE): errno {ctypes.get_errno() if libc else 'no libc'}")
    return failed


def note_request_size(nbytes: int) -> None:
    """A request of nbytes arrived; one of LARGE_BUFFER or more asks for a trim."""
    global _large_seen
    if nbytes >= LARGE_BUFFER:
        _large_seen = True


def trim() -> bool:
    """malloc_trim(0): the arenas' free memory back to the kernel."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.malloc_trim(0))
    except AttributeError:
        return False


async def trim_after_large_requests(interval: float = TRIM_INTERVAL) -> None:
    """Forever: once a second, if a large request came since the last
    look, trim (in a worker thread: it walks every arena)."""
    global _large_seen
    while True:
        await asyncio.sleep(interval)
        if _large_seen:
            _large_seen = False
            await asyncio.to_thread(trim)


_trimmer: asyncio.Task | None = None


def start_trimming() -> None:
    """The one trim_after_large_requests task of this process (a daemon
    with two sockets starts it once), on the running loop."""
    global _trimmer
    if _trimmer is None or _trimmer.done():
        _trimmer = asyncio.get_running_loop().create_task(trim_after_large_requests(), name="malloc-trim")
