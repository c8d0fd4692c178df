"""An independent watch of the host's mount table while a test runs: a
thread reading /proc/self/mountinfo over and over, noting every line whose
device is one of those watched. A microVM's volumes must never show up
there: only the guest's kernel mounts them."""

from __future__ import annotations

import threading


class MountWatch:
    def __init__(self, devices: set[tuple[int, int]] = frozenset(), interval: float = 0.005):
        self.devices = {f"{major}:{minor}" for major, minor in devices}
        self.interval = interval
        self.seen: list[str] = []
        self.reads = 0   # whole reads of the table, so a test can tell the watch ran
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def watch(self, majmin: tuple[int, int]) -> None:
        self.devices.add(f"{majmin[0]}:{majmin[1]}")

    def start(self) -> "MountWatch":
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        """The lines seen; the watch is over (stopping twice is harmless)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.seen

    def _run(self) -> None:
        while not self._stop.is_set():
            with open("/proc/self/mountinfo") as table:
                for line in table:
                    if line.split(" ", 3)[2] in self.devices:
                        self.seen.append(line.strip())
            self.reads += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "MountWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
