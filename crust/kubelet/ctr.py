"""Containers run on a private containerd (crust.kubelet.containerd) through
`ctr`, from OCI runtime specs the caller writes.

`ctr run --config SPEC` runs exactly the spec given (ctr's own flags cannot
say everything a pod spec says: no user, no propagation per mount), with the
root file system of an image snapshot mounted by `ctr images mount --rw`,
one fresh snapshot per container, as a container runtime makes one per
container. Everything lives in `ctr`'s own namespace of that containerd
(CTR_NAMESPACE) and in its runc root, so the containerd's close() finds and
removes whatever a failed test left running.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from crust.kubelet.containerd import Containerd
from crust.kubelet.image import archive_name
from crust.sys import mount as sysmount


class CtrContainers:
    def __init__(self, containerd: Containerd):
        self.containerd = containerd
        self.rootfs_mounts: list[Path] = []

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.containerd.ctr(*args, check=check, timeout=timeout)

    # -- images --------------------------------------------------------------
    def import_image(self, archive: Path) -> str:
        """Import an OCI archive; its image's name."""
        self.ctr("images", "import", str(archive), timeout=600)
        return archive_name(archive)

    def mount_rootfs(self, image: str, container: str) -> Path:
        """A fresh writable snapshot of the image, mounted for one container."""
        rootfs = self.containerd.directory / "rootfs" / container
        rootfs.mkdir(parents=True)
        self.ctr("images", "mount", "--rw", image, str(rootfs))
        self.rootfs_mounts.append(rootfs)
        return rootfs

    def _unmount_rootfs(self, rootfs: Path) -> None:
        if rootfs not in self.rootfs_mounts:
            return
        if self.containerd.process is not None and self.containerd.process.poll() is None:
            self.ctr("images", "unmount", "--rm", str(rootfs), check=False)
        if sysmount.at(str(rootfs)) is not None:
            subprocess.run(["umount", "-l", str(rootfs)], capture_output=True)
        self.rootfs_mounts.remove(rootfs)

    # -- containers ----------------------------------------------------------
    def run(self, container: str, spec: dict, log: Path) -> int:
        """Start the container detached, its output into log; its pid."""
        spec_path = self.containerd.directory / "specs" / f"{container}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec, indent=1))
        self.ctr("run", "--detach", "--runc-root", str(self.containerd.runc_root), "--log-uri", f"file://{log}",
                 "--config", str(spec_path), container)
        return self.pid(container)

    def _tasks(self) -> dict[str, tuple[int, str]]:
        """container -> (pid, status) of every task."""
        tasks = {}
        for line in self.ctr("task", "ls").stdout.splitlines()[1:]:
            name, pid, status = line.split()
            tasks[name] = (int(pid), status)
        return tasks

    def pid(self, container: str) -> int:
        if container not in (tasks := self._tasks()):
            raise RuntimeError(f"no task {container}")
        return tasks[container][0]

    def status(self, container: str) -> str:
        return self._tasks().get(container, (0, "GONE"))[1]

    def exec(self, container: str, exec_id: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`ctr task exec`. Its exit status is containerd's; its output is
        ctr's own copy, which containerd 1.6's ctr sometimes drops whole for
        a process that exits at once on a loaded machine (exit 0, nothing
        printed): a check that must hold asks the exit status."""
        return self.ctr("task", "exec", "--exec-id", exec_id, container, *argv, check=False, timeout=timeout)

    def stop_container(self, container: str, grace: float) -> str:
        """SIGTERM, then SIGKILL after grace seconds (kubelet's
        terminationGracePeriodSeconds); how it ended."""
        self.ctr("task", "kill", "--signal", "SIGTERM", container, check=False)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.status(container) in ("STOPPED", "GONE"):
                self.remove(container, None)
                return "exited"
            time.sleep(0.2)
        self.remove(container, signal.SIGKILL)
        return "killed"

    def remove(self, container: str, sig: int | None) -> None:
        """Kill (when sig is given), delete the task and the container, and
        unmount its root file system."""
        if sig is not None:
            self.ctr("task", "kill", "--all", "--signal", signal.Signals(sig).name, container, check=False)
            deadline = time.monotonic() + 20
            while self.status(container) not in ("STOPPED", "GONE") and time.monotonic() < deadline:
                time.sleep(0.1)
        self.ctr("task", "delete", "--force", container, check=False)
        self.ctr("containers", "delete", container, check=False)
        self._unmount_rootfs(self.containerd.directory / "rootfs" / container)

    def close(self) -> None:
        """Every container still here, then their root file systems (the
        containerd itself is closed by its owner)."""
        if self.containerd.process is not None and self.containerd.process.poll() is None:
            for container in self._tasks():
                self.remove(container, signal.SIGKILL)
        for rootfs in reversed(list(self.rootfs_mounts)):
            self._unmount_rootfs(rootfs)
