"""An index of the watched directory, kept current with watchdog.

An initial scan plus file system events keep a map digest -> MountInfo. A
bad entry (partial, garbage, vanished between event and read) is logged and
skipped; it never crashes the handler. An entry of a newer format than this
handler reads is refused: logged as an error naming the file and both
versions, and kept out of the map with its reason, which a sandbox asking
for the volume gets back instead of a guess at what the file means. Readers may wait for an entry that is
about to appear (the proxy answers kubelet only after writing it, but the
runtime may be asked to start the sandbox at the same moment): an asyncio
caller registers a future for the names it awaits, and the watcher thread
completes it on the caller's loop the moment one of them is loaded; no one
polls.

The watcher is supervised. watchdog reads inotify in threads of its own,
and one that dies on an exception (watchdog 7 raised KeyError in its shared
inotify thread after an entry directory was swapped and removed) leaves the
observer reporting itself alive while no event arrives any more. A death is
noticed three ways: a hook on uncaught exceptions of watchdog's threads, a
look at whether its threads still run, and whether the watched path is
still the directory being watched (it may have been removed and made
again). supervise() then rebuilds the watch and rescans the directory; the
handler asks it every second and reports NOT_SERVING on its health until it
succeeds.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Iterable

from pydantic import ValidationError
from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from crust.common import saferead
from crust.common.formats import NewerFormat
from crust.common.private import make_dirs
from crust.contract.mountinfo import MountInfo, is_digest

log = logging.getLogger(__name__)

MOUNT_INFO = "mountInfo.json"
MAX_ENTRY_BYTES = 1 << 20
# Our own reads of an entry raise these inotify events: reacting to them
# would read the entry again, forever.
READ_EVENTS = frozenset({"opened", "closed_no_write"})

# Indexes that want to hear of a watchdog thread's death.
_WATCHING: "weakref.WeakSet[VolumeIndex]" = weakref.WeakSet()
_previous_excepthook = None


def _install_death_hook() -> None:
    """Uncaught exceptions of watchdog's threads end here, logged in one
    line each and told to every index (not printed as a raw traceback);
    other threads' go on to the previous hook."""
    global _previous_excepthook
    if _previous_excepthook is not None:
        return
    _previous_excepthook = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        thread = args.thread
        if thread is None or not type(thread).__module__.startswith("watchdog."):
            _previous_excepthook(args)
            return
        reason = f"watchdog's thread {type(thread).__name__} died: {args.exc_type.__name__}: {args.exc_value}"
        log.error("the directory watcher lost a thread", extra={"fields": {"error": reason[:500]}})
        for index in list(_WATCHING):
            index.lose(reason)

    threading.excepthook = hook


def _shared_reader():
    """watchdog's inotify reader thread shared by the process (watchdog 7),
    or None (older versions read per emitter)."""
    try:
        from watchdog.observers.inotify_c import InotifyFD
    except ImportError:
        return None
    return getattr(InotifyFD, "_instance", None)


def _forget_dead_reader() -> None:
    """A dead shared reader stays watchdog's singleton: every new watch
    would go to it, deaf. Forget it (and release its descriptors) so the
    next watch starts a new one."""
    try:
        from watchdog.observers.inotify_c import InotifyFD
    except ImportError:
        return
    lock = getattr(InotifyFD, "_global_lock", None)
    if lock is None:
        return
    with lock:
        reader = getattr(InotifyFD, "_instance", None)
        if reader is None or reader.is_alive():
            return
        InotifyFD._instance = None
    try:
        reader.close()
    except Exception as exc:  # noqa: BLE001 - its book-keeping is what broke
        log.debug("closing the dead inotify reader", extra={"fields": {"error": str(exc)[:200]}})


class VolumeIndex(FileSystemEventHandler):
    def __init__(self, root: Path):
        self.root = root
        self.entries: dict[str, MountInfo] = {}
        self.refused: dict[str, str] = {}  # digest -> why (a newer format)
        self.lock = threading.Condition()
        self.observer: Observer | None = None
        self._watched: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the directory watched
        self.lost = ""  # why the watcher stopped working, until it is rebuilt
        self.skipped = 0
        # digest -> futures of asyncio callers waiting for that entry, each
        # with the loop it belongs to (completed from the watcher thread).
        self._awaited: dict[str, set[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> "VolumeIndex":
        make_dirs(self.root)
        _install_death_hook()
        _WATCHING.add(self)
        self._watch()
        self.rescan()  # after the watch starts, so nothing falls between the two
        return self

    def _watch(self) -> None:
        watched = os.stat(self.root)
        observer = Observer()
        observer.schedule(self, str(self.root), recursive=True)
        observer.start()
        with self.lock:
            self.observer, self._watched, self.lost = observer, (watched.st_dev, watched.st_ino), ""

    def stop(self) -> None:
        _WATCHING.discard(self)
        self._stop_observer()

    def _stop_observer(self) -> None:
        observer, self.observer = self.observer, None
        if observer is None:
            return
        try:
            observer.stop()
            observer.join(5)
        except Exception as exc:  # noqa: BLE001 - a broken watcher may fail to stop; it is dropped anyway
            log.warning("stopping the old watcher", extra={"fields": {"error": str(exc)[:200]}})

    # -- supervision -----------------------------------------------------------------

    def lose(self, reason: str) -> None:
        """Called (from any thread) when a thread of the watcher died."""
        with self.lock:
            if not self.lost:
                self.lost = reason

    def watching(self) -> str:
        """"" while the watcher works; otherwise why it does not."""
        observer = self.observer
        if self.lost:
            return self.lost
        if observer is None or not observer.is_alive():
            return "the watcher's observer thread is not running"
        if not all(emitter.is_alive() for emitter in observer.emitters):
            return "a thread of the watcher stopped"
        reader = _shared_reader()
        if reader is not None and not reader.is_alive():
            return "watchdog's inotify reader thread is not running"
        try:
            st = os.stat(self.root)
        except OSError as exc:
            return f"{self.root}: {exc.strerror}"
        if (st.st_dev, st.st_ino) != self._watched:
            return f"{self.root} is no longer the directory being watched (removed and made again?)"
        return ""

    def rebuild(self) -> bool:
        """A new watch on the directory, then a rescan (entries that came,
        changed or went meanwhile are caught up). False when that is not
        possible yet (the directory is gone): the caller tries again."""
        self._stop_observer()
        _forget_dead_reader()
        try:
            if not self.root.is_dir() or self.root.is_symlink():
                raise NotADirectoryError(f"{self.root} is not a directory")
            self._watch()
            self.rescan()
        except OSError as exc:
            self._stop_observer()
            with self.lock:
                self.lost = self.lost or f"cannot watch {self.root}: {exc}"
            log.warning("the watcher cannot be rebuilt yet", extra={"fields": {"error": str(exc)[:300]}})
            return False
        log.info("the watcher is rebuilt and the directory rescanned", extra={"fields": {
            "entries": len(self.entries)}})
        return True

    # -- reading -------------------------------------------------------------------

    def rescan(self) -> None:
        seen = set()
        for entry in self.root.iterdir():
            if is_digest(entry.name):
                seen.add(entry.name)
                self._load(entry.name)
        with self.lock:
            for gone in set(self.entries) - seen:
                self._drop(gone)
            for gone in set(self.refused) - seen:
                del self.refused[gone]

    def _read_entry(self, digest: str) -> bytes:
        """An entry's mountInfo.json: a regular file reached without following
        a symlink (neither the entry directory nor the file), and read without
        blocking (a FIFO planted there must not hang the handler), through
        crust.common.saferead."""
        try:
            dir_fd = os.open(self.root / digest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise ValueError(f"{digest} is a symlink or not a directory") from None
            raise
        try:
            return saferead.read_bounded(MOUNT_INFO, MAX_ENTRY_BYTES, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)

    def _load(self, digest: str) -> None:
        try:
            info = MountInfo.model_validate_json(self._read_entry(digest))
        except FileNotFoundError:
            with self.lock:
                self._drop(digest)
                self.refused.pop(digest, None)
            return
        except NewerFormat as exc:
            refusal = exc.at(self.root / digest / MOUNT_INFO)
            with self.lock:
                self._drop(digest)
                self.refused[digest] = str(refusal)
            log.error("refusing an entry of a newer format", extra={"fields": {
                "digest": digest, "found": refusal.found, "known": refusal.known, "error": str(refusal)}})
            return
        except (OSError, ValueError, ValidationError) as exc:
            self.skipped += 1
            log.warning("skipping a bad entry", extra={"fields": {"digest": digest, "error": str(exc)[:200]}})
            return
        from crust.contract.mountinfo import digest as digest_of

        if digest_of(info.target_path) != digest:
            self.skipped += 1
            log.warning("skipping an entry whose target path does not match its directory",
                        extra={"fields": {"digest": digest}})
            return
        with self.lock:
            self.refused.pop(digest, None)
            self.entries[digest] = info
            self.lock.notify_all()
            waiting = self._awaited.pop(digest, ())
        for loop, future in waiting:
            loop.call_soon_threadsafe(_complete, future)

    def _drop(self, digest: str) -> None:
        if self.entries.pop(digest, None) is not None:
            self.lock.notify_all()

    def problem(self, digest: str) -> str | None:
        """Why the entry named digest is not indexed, read afresh (None: it
        reads fine, or there is no such entry)."""
        if not os.path.lexists(self.root / digest):
            return None
        from crust.contract.mountinfo import digest as digest_of

        try:
            info = MountInfo.model_validate_json(self._read_entry(digest))
        except FileNotFoundError:
            return f"{digest}/{MOUNT_INFO} is missing"
        except NewerFormat as exc:
            return str(exc.at(self.root / digest / MOUNT_INFO))
        except (OSError, ValueError, ValidationError) as exc:
            return " ".join(line.strip() for line in str(exc).splitlines()[:2])[:300]
        if digest_of(info.target_path) != digest:
            return "its target path does not match its directory"
        return None

    def get(self, digest: str) -> MountInfo | None:
        with self.lock:
            return self.entries.get(digest)

    def items(self) -> list[tuple[str, MountInfo]]:
        """Every entry now indexed, by digest (a copy)."""
        with self.lock:
            return list(self.entries.items())

    def refusal(self, digest: str) -> str | None:
        """Why the entry is not used, when its format is newer than ours."""
        with self.lock:
            return self.refused.get(digest)

    def wait_for(self, digest: str, timeout: float) -> MountInfo | None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while digest not in self.entries:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(left)
            return self.entries[digest]

    def awaiting(self, digests: Iterable[str]) -> asyncio.Future:
        """A future of the running loop, done as soon as one of these
        entries is loaded (created or changed). Call forget() with it when
        done waiting; check the index after this call, not before, so that an
        entry loaded in between is not missed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.lock:
            for name in digests:
                self._awaited.setdefault(name, set()).add((loop, future))
        return future

    def forget(self, digests: Iterable[str], future: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        with self.lock:
            for name in digests:
                waiting = self._awaited.get(name)
                if waiting is not None:
                    waiting.discard((loop, future))
                    if not waiting:
                        del self._awaited[name]

    # -- watchdog events -------------------------------------------------------------

    def _digest_of_event(self, path: str) -> str | None:
        try:
            rel = Path(path).relative_to(self.root)
        except ValueError:
            return None
        parts = rel.parts
        if not parts or not is_digest(parts[0]):
            return None
        if len(parts) == 1 or parts[1] == MOUNT_INFO:
            return parts[0]
        return None  # temporaries and other files inside an entry

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in READ_EVENTS:
            return
        try:
            for path in (event.src_path, getattr(event, "dest_path", "")):
                if not path:
                    continue
                digest = self._digest_of_event(str(path))
                if digest is not None:
                    self._load(digest)
        except Exception:  # noqa: BLE001 - the watcher thread must survive anything
            log.exception("index update failed")


def _complete(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
