"""A containerd of the test's own, and containers run on it with runc
through `ctr`, from OCI runtime specs the test writes.

The daemon gets its own root, state, socket and config under the test's
directory, so it runs beside any other containerd on the machine and is
the only one the test ever talks to. Stopping it (also when the test fails)
kills the tasks it still runs, deletes them, unmounts the root file systems
mounted for them and the snapshotter's mounts, and stops the daemon.

`ctr run --config SPEC` runs exactly the spec given (ctr's own flags cannot
say everything a pod spec says: no user, no propagation per mount), with the
root file system of an image snapshot mounted by `ctr images mount --rw`,
one fresh snapshot per container, as a container runtime makes one per
container.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

from crust.sys import mount as sysmount

NAMESPACE = "crust-test"
SHIM_SOCKETS = Path("/run/containerd/s")
CONFIG = """\
version = 2
root = "{root}"
state = "{state}"
disabled_plugins = [{disabled}]
[grpc]
  address = "{address}"
[ttrpc]
  address = "{address}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
"""


def available() -> str:
    """Why containerd cannot run here, or "" when it can."""
    missing = [b for b in ("containerd", "ctr", "runc", "containerd-shim-runc-v2") if shutil.which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (apt-get install containerd runc)"
    return ""


class Containerd:
    def __init__(self, directory: Path, cri: bool = False):
        self.directory = directory
        self.root = directory / "root"
        self.state = directory / "state"
        self.address = directory / "containerd.sock"
        self.config = directory / "config.toml"
        self.log = directory / "containerd.log"
        self.cri = cri
        self.proc: subprocess.Popen | None = None
        self.rootfs_mounts: list[Path] = []
        self.running: list[str] = []
        self.started: list[str] = []

    # -- the daemon ----------------------------------------------------------
    def start(self, timeout: float = 20.0) -> "Containerd":
        self.directory.mkdir(parents=True, exist_ok=True)
        disabled = "" if self.cri else '"io.containerd.grpc.v1.cri"'
        self.config.write_text(CONFIG.format(root=self.root, state=self.state, address=self.address,
                                             disabled=disabled))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["containerd", "--config", str(self.config)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"containerd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if self.address.is_socket() and self.ctr("version", check=False).returncode == 0:
                return self
            time.sleep(0.1)
        raise RuntimeError(f"containerd did not serve within {timeout} s: {self.log.read_text()[-2000:]}")

    def ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run(["ctr", "--address", str(self.address), "--namespace", NAMESPACE, *args],
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
        return result

    def stop(self) -> None:
        """Everything the daemon runs for the test, then the daemon; what
        was mounted for it under its directory is unmounted."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                for container in list(self.running):
                    self.remove(container, signal.SIGKILL)
        finally:
            for rootfs in reversed(self.rootfs_mounts):
                self._unmount_rootfs(rootfs)
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            self._remove_shims()
            # The snapshotter's own mounts, if the daemon left any.
            prefix = str(self.directory) + "/"
            for entry in sorted(sysmount.mounts(), key=lambda m: -len(m.mount_point)):
                if entry.mount_point.startswith(prefix):
                    subprocess.run(["umount", "-l", entry.mount_point], capture_output=True)

    def _remove_shims(self) -> None:
        """The runc shims of our containers outlive containerd by design:
        those still serving our socket are killed, and the sockets
        containerd 1.6 gives them in /run/containerd/s (named by the hash of
        our address, namespace and container id) are removed."""
        ours = str(self.address).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and ours in argv:
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for container in self.started:
            name = hashlib.sha256(f"{self.address}/{NAMESPACE}/{container}".encode()).hexdigest()
            (SHIM_SOCKETS / name).unlink(missing_ok=True)

    # -- images --------------------------------------------------------------
    def import_image(self, archive: Path) -> str:
        """Import an OCI archive; its image's name."""
        self.ctr("images", "import", str(archive), timeout=600)
        return image_name(archive)

    # -- containers ----------------------------------------------------------
    def mount_rootfs(self, image: str, container: str) -> Path:
        """A fresh writable snapshot of the image, mounted for one container."""
        rootfs = self.directory / "rootfs" / container
        rootfs.mkdir(parents=True)
        self.ctr("images", "mount", "--rw", image, str(rootfs))
        self.rootfs_mounts.append(rootfs)
        return rootfs

    def _unmount_rootfs(self, rootfs: Path) -> None:
        if rootfs not in self.rootfs_mounts:
            return
        if self.proc is not None and self.proc.poll() is None:
            self.ctr("images", "unmount", "--rm", str(rootfs), check=False)
        if sysmount.at(str(rootfs)) is not None:
            subprocess.run(["umount", "-l", str(rootfs)], capture_output=True)
        self.rootfs_mounts.remove(rootfs)

    def run(self, container: str, spec: dict, log: Path) -> int:
        """Start the container detached, its output into log; its pid."""
        spec_path = self.directory / "specs" / f"{container}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec, indent=1))
        self.running.append(container)
        self.started.append(container)
        self.ctr("run", "--detach", "--log-uri", f"file://{log}", "--config", str(spec_path), container)
        return self.pid(container)

    def pid(self, container: str) -> int:
        for line in self.ctr("task", "ls").stdout.splitlines()[1:]:
            name, pid, status = line.split()
            if name == container:
                return int(pid)
        raise RuntimeError(f"no task {container}")

    def status(self, container: str) -> str:
        for line in self.ctr("task", "ls").stdout.splitlines()[1:]:
            name, _, status = line.split()
            if name == container:
                return status
        return "GONE"

    def exec(self, container: str, exec_id: str, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
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
        if container in self.running:
            self.running.remove(container)
        self._unmount_rootfs(self.directory / "rootfs" / container)


def image_name(archive: Path) -> str:
    """The name an OCI archive gives its image (the ref.name annotation)."""
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
    (manifest,) = index["manifests"]
    return manifest["annotations"]["org.opencontainers.image.ref.name"]


def image_config(archive: Path) -> dict:
    """The image's config (Entrypoint, Cmd, Env, User, WorkingDir)."""
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
        blob = lambda digest: json.load(tar.extractfile("blobs/" + digest.replace(":", "/")))  # noqa: E731
        manifest = blob(index["manifests"][0]["digest"])
        return blob(manifest["config"]["digest"]).get("config", {})
