"""What part 1 of bench/csi/handler_bench.py needs to time the handler's index.

- entry(): a deferred volume's mountInfo.json entry, laid out as kubelet lays
  out its target path; EntryWriter writes and removes entries as the proxy
  does;
- preload(): entries written and indexed before anything is timed;
- change(): what creating, updating or removing one entry does, and how the
  index shows it has seen that;
- IndexProbe: the moment the index holds a change, stamped by a thread
  waiting on the index's own Condition;
- index_idle_cpu() and index_events(): what the index costs while nothing
  is written; watchdog_version(), the file watcher it runs on.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path

from crust.contract.mountinfo import MountInfo
from crust.contract.volumes_dir import VolumesDir
from crust.runtime_handler.index import VolumeIndex
from tests.harness.daemons import MIB


def entry(prefix: str, i: int, capacity: int = 64 * MIB) -> MountInfo:
    """A deferred volume laid out as kubelet lays out its target path."""
    target = f"/var/lib/kubelet/pods/{prefix}-{i:05d}/volumes/kubernetes.io~csi/pvc-{prefix}-{i:05d}/mount"
    return MountInfo(device=f"/dev/loop{i % 4096}", fstype="ext4", options=["noatime"], volume_id=f"vol-{prefix}-{i}",
                     target_path=target, capacity_bytes=capacity, device_major=7, device_minor=i % 4096,
                     volume_context={"storage.kubernetes.io/csiProvisionerIdentity": "bench"})


class EntryWriter:
    """The proxy's own writer (VolumesDir: temporary file, fsync, rename,
    fsync of the directories), driven from this thread: its write() is a
    coroutine the proxy awaits on its loop, so it runs here on a loop of
    its own."""

    def __init__(self, root: Path):
        self.volumes = VolumesDir(root)
        self.loop = asyncio.new_event_loop()

    def write(self, info: MountInfo) -> None:
        self.loop.run_until_complete(self.volumes.write(info))

    def remove(self, target_path: str) -> None:
        self.volumes.remove(target_path)

    def close(self) -> None:
        self.loop.close()


def preload(writer: EntryWriter, index: VolumeIndex, label: str, count: int) -> float:
    """Write count entries and wait until the index holds them all; the seconds that took."""
    started = time.monotonic()
    for i in range(count):
        writer.write(entry(f"{label}-pre", i))
    with index.lock:
        deadline = time.monotonic() + max(60.0, count * 0.1)
        while len(index.entries) < count and time.monotonic() < deadline:
            index.lock.wait(0.5)
        indexed = len(index.entries)
    if indexed < count:
        raise RuntimeError(f"the index holds {indexed} of {count} preloaded entries after "
                           f"{time.monotonic() - started:.0f}s")
    return time.monotonic() - started


def change(kind: str, writer: EntryWriter, index: VolumeIndex, info: MountInfo, key: str):
    """(predicate, action) of one change: action() makes it (create: write a
    new entry; update: rewrite it with twice the capacity; remove: remove
    it), predicate() holds once the index shows it under key."""
    if kind == "create":
        return (lambda: key in index.entries), (lambda: writer.write(info))
    if kind == "update":
        new = info.model_copy(update={"capacity_bytes": info.capacity_bytes * 2})
        return ((lambda: key in index.entries and index.entries[key].capacity_bytes == new.capacity_bytes),
                (lambda: writer.write(new)))
    return (lambda: key not in index.entries), (lambda: writer.remove(info.target_path))


class IndexProbe:
    """A thread that waits on the index's own Condition until a predicate
    holds and stamps time.perf_counter() the moment it sees it.

    The probe checks the predicate (false) and is inside Condition.wait()
    before the write starts: the index takes the same lock to store an
    entry, so no change can slip between the check and the wait."""

    def __init__(self, index: VolumeIndex):
        self.index = index
        self.jobs: queue.Queue = queue.Queue()
        self.armed = threading.Event()
        self.done = threading.Event()
        self.result: tuple[str, float] = ("", 0.0)
        self.thread = threading.Thread(target=self._run, name="index-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            predicate, timeout = job
            outcome: tuple[str, float] = ("timeout", 0.0)
            with self.index.lock:
                if predicate():
                    outcome = ("already", time.perf_counter())
                else:
                    self.armed.set()
                    deadline = time.perf_counter() + timeout
                    while True:
                        left = deadline - time.perf_counter()
                        if left <= 0:
                            break
                        self.index.lock.wait(left)
                        if predicate():
                            outcome = ("seen", time.perf_counter())
                            break
            self.result = outcome
            self.armed.set()
            self.done.set()

    def measure(self, predicate, action, timeout: float) -> tuple[float | None, float]:
        """(ms from just before action() until the index shows it, or None on
        timeout; ms action() itself took)."""
        self.armed.clear()
        self.done.clear()
        self.jobs.put((predicate, timeout))
        self.armed.wait()
        started = time.perf_counter()
        action()
        wrote = time.perf_counter()
        self.done.wait()
        kind, seen = self.result
        if kind == "already":
            raise RuntimeError("the index showed the change before it was made (a reused target?)")
        return ((seen - started) * 1e3 if kind == "seen" else None), (wrote - started) * 1e3

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(5)


def index_idle_cpu(seconds: float) -> float:
    """Share of one core this process used while nothing was written (the
    index's watcher thread: the main and probe threads are asleep)."""
    c0, t0 = time.process_time(), time.monotonic()
    time.sleep(seconds)
    return round((time.process_time() - c0) / (time.monotonic() - t0), 3)


def index_events(index: VolumeIndex, seconds: float) -> dict:
    """Watchdog events per second the index receives while nothing is
    written, by type (counted after the timed runs, so as not to perturb them)."""
    counts: dict[str, int] = {}
    original = index.on_any_event

    def counting(event):
        counts[event.event_type] = counts.get(event.event_type, 0) + 1
        original(event)

    index.on_any_event = counting  # the observer dispatches through the instance attribute
    try:
        time.sleep(seconds)
    finally:
        del index.on_any_event
    return {k: round(v / seconds) for k, v in sorted(counts.items())}


def watchdog_version() -> str:
    """The version of watchdog, which the index watches the directory with."""
    try:
        import watchdog.version as wv
        return wv.VERSION_STRING
    except Exception:  # noqa: BLE001 - informative only
        return "unknown"
