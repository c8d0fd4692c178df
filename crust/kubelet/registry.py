"""A container registry of our own on 127.0.0.1, for pulls through CRI
without a network.

Debian's `docker-registry` (the CNCF distribution registry) runs with its
own config and storage below one directory this module owns, on a port the
kernel picks (the registry logs the address it listens on, so no port is
guessed and none can be taken by someone else meanwhile). Images go in
over the registry's HTTP API (blobs, then the manifest under each tag),
straight from their bytes in memory (crust.kubelet.image.OciImage): no
image tool, and the registry holds exactly the digests the builder made.

A containerd pulls from it through a hosts.toml mirror per registry host it
stands in for (crust.kubelet.containerd, `mirrors`).

close() stops the registry and removes its directory.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from crust.kubelet import image as images
from crust.kubelet.image import MANIFEST, OciImage

BINARY = "docker-registry"
LISTENING = re.compile(r'msg="listening on ([0-9.]+:[0-9]+)"')


class RegistryError(Exception):
    pass


def available() -> str:
    """Why a registry cannot run here, or "" when it can."""
    if shutil.which(BINARY) is None:
        return f"{BINARY} is not installed (apt-get install docker-registry)"
    return ""


def split_reference(reference: str) -> tuple[str, str, str]:
    """("registry.k8s.io", "e2e-test-images/busybox", "1.29-2") from
    "registry.k8s.io/e2e-test-images/busybox:1.29-2"; the tag is "latest"
    when none is given."""
    host, _, rest = reference.partition("/")
    if not rest or ("." not in host and ":" not in host and host != "localhost"):
        raise RegistryError(f"{reference!r} does not name its registry host")
    repository, colon, tag = rest.rpartition(":")
    if not colon or "/" in tag:
        repository, tag = rest, "latest"
    return host, repository, tag


@dataclass
class LocalRegistry:
    """One registry below `directory` (which it owns)."""

    directory: Path
    binary: str = BINARY
    process: subprocess.Popen | None = None
    address: str = ""  # host:port once started
    pushed: list[str] = field(default_factory=list)

    @property
    def config_path(self) -> Path:
        return self.directory / "config.yml"

    @property
    def log_path(self) -> Path:
        return self.directory / "registry.log"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def config(self) -> str:
        # JSON is YAML: the registry reads this as its config.yml.
        return json.dumps({
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.directory / "storage")},
                        "delete": {"enabled": True}},
            "http": {"addr": "127.0.0.1:0"},
        }, indent=1)

    def start(self, timeout: float = 20.0) -> "LocalRegistry":
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.config_path.write_text(self.config())
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([self.binary, "serve", str(self.config_path)], stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RegistryError(f"{self.binary} exited with {self.process.returncode}: {self.log_tail()}")
            found = LISTENING.search(self.log_tail(20000))
            if found:
                self.address = found.group(1)
                try:
                    self._request("GET", "/v2/")
                    return self
                except (OSError, RegistryError):
                    pass
            time.sleep(0.05)
        raise RegistryError(f"{self.binary} did not answer within {timeout:g} s: {self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- the HTTP API -----------------------------------------------------------------------

    def _request(self, method: str, path: str, data: bytes | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        url = path if path.startswith("http") else self.url + path
        request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        # Never through an HTTP proxy of the environment: the registry is on loopback.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as exc:
            raise RegistryError(f"{method} {path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None

    def _has_blob(self, repository: str, digest: str) -> bool:
        try:
            self._request("HEAD", f"/v2/{repository}/blobs/{digest}")
            return True
        except RegistryError:
            return False

    def push(self, image: OciImage, repository: str, tags: list[str]) -> None:
        """The image's blobs into `repository` (e.g. "e2e-test-images/busybox"),
        then its manifest under each tag."""
        for digest, data in sorted(image.blobs.items()):
            if digest == image.manifest_digest or self._has_blob(repository, digest):
                continue
            _, headers, _ = self._request("POST", f"/v2/{repository}/blobs/uploads/")
            location = headers.get("Location", "")
            if not location:
                raise RegistryError(f"the registry gave no upload location for {repository}")
            joiner = "&" if "?" in location else "?"
            self._request("PUT", f"{location}{joiner}digest={digest}", data=data,
                          headers={"Content-Type": "application/octet-stream"})
        for tag in tags:
            self._request("PUT", f"/v2/{repository}/manifests/{tag}", data=image.manifest,
                          headers={"Content-Type": MANIFEST})
            self.pushed.append(f"{repository}:{tag}")

    def manifest_digest(self, repository: str, tag: str) -> str:
        """The digest the registry serves for repository:tag."""
        _, headers, _ = self._request("HEAD", f"/v2/{repository}/manifests/{tag}", headers={"Accept": MANIFEST})
        return headers.get("Docker-Content-Digest", "")

    # -- cleanup ----------------------------------------------------------------------------

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def push_busybox_and_pause(registry: LocalRegistry, image: images.Image) -> str:
    """The busybox image (under the name `image` has) and a pause image
    whose /pause exits on SIGTERM (crust.kubelet.image.pause_image), for a
    CRI runtime that pulls and stops an infra container gracefully
    (CRI-O); returns the pause image's name."""
    pause = f"localhost/crust/pause:{image.busybox_version}"
    for name, made in ((image.name, images.busybox_image()), (pause, images.pause_image())):
        _, repository, tag = split_reference(name)
        registry.push(made, repository, [tag])
    return pause
