"""A tiny container image made here, from Debian's busybox-static.

No registry is reachable from our machines, so the pods of the demo and
the tests run an image built locally: one layer holding the static busybox
binary, its applets as links in the usual places, a minimal /etc/passwd and
/etc/group, and the directories a container expects. Its default command is
`sleep infinity`, so the same image serves as the pod sandbox's (pause)
image and, with a command of its own, as the workload's.

The archive is an OCI image layout in a tar file (index.json, oci-layout,
blobs/sha256/...), as `ctr images import` takes it. Everything in it is
deterministic (fixed times and owners, sorted entries), so the same busybox
always gives the same image id.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import struct
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPOSITORY = "localhost/crust/busybox"
# Kubernetes' pause image stays up doing nothing; so does this one by default.
DEFAULT_COMMAND = ["/bin/sleep", "infinity"]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
GROUP = "root:x:0:\nnogroup:x:65534:\n"
DIRS = {"bin": 0o755, "dev": 0o755, "etc": 0o755, "proc": 0o755, "root": 0o700, "sbin": 0o755, "sys": 0o755,
        "tmp": 0o1777, "usr": 0o755, "usr/bin": 0o755, "usr/sbin": 0o755, "var": 0o755}
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar"
PT_INTERP = 3


class ImageError(Exception):
    pass


@dataclass(frozen=True)
class Image:
    """The archive on disk and how runtimes name the image in it."""

    archive: Path
    name: str  # repository:tag, as the pod spec names it
    image_id: str  # sha256 of the config, as CRI's ImageStatus reports it
    busybox_version: str


def find_busybox() -> Path:
    found = shutil.which("busybox") or next((p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.exists(p)), None)
    if found is None:
        raise ImageError("busybox not found: install Debian's busybox-static")
    return Path(found).resolve()


def check_static(path: Path) -> None:
    if _dynamically_linked(path):
        raise ImageError(f"{path} is dynamically linked: the image needs Debian's busybox-static")


def _dynamically_linked(path: Path) -> bool:
    """Whether the ELF file asks for a program interpreter (PT_INTERP)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2:
            raise ImageError(f"{path} is not a 64-bit ELF executable")
        endian = "<" if header[5] == 1 else ">"
        phoff, = struct.unpack_from(endian + "Q", header, 32)
        phentsize, phnum = struct.unpack_from(endian + "HH", header, 54)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, = struct.unpack(endian + "I", f.read(4))
            if p_type == PT_INTERP:
                return True
    return False


def busybox_version(busybox: Path) -> str:
    """"1.35.0" from busybox's banner ("BusyBox v1.35.0 (Debian ...)")."""
    banner = subprocess.run([str(busybox)], capture_output=True, text=True, timeout=10).stdout.split("\n", 1)[0]
    parts = banner.split()
    if len(parts) < 2 or not parts[1].startswith("v"):
        raise ImageError(f"cannot read busybox's version from {banner!r}")
    return parts[1][1:]


def _applets(busybox: Path) -> list[str]:
    out = subprocess.run([str(busybox), "--list-full"], capture_output=True, text=True, timeout=10, check=True).stdout
    return sorted({line.strip() for line in out.splitlines() if line.strip() and ".." not in line})


def _entry(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
    return info


def layer_tar(busybox: Path) -> bytes:
    """The image's only layer, byte for byte the same for the same busybox."""
    binary = busybox.read_bytes()
    applets = _applets(busybox)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, mode in sorted(DIRS.items()):
            tar.addfile(_entry(name, tarfile.DIRTYPE, mode))
        tar.addfile(_entry("bin/busybox", tarfile.REGTYPE, 0o755, len(binary)), io.BytesIO(binary))
        for applet in applets:
            if applet == "bin/busybox" or applet.split("/", 1)[0] not in ("bin", "sbin", "usr"):
                continue
            link = os.path.relpath("bin/busybox", os.path.dirname(applet))
            tar.addfile(_entry(applet, tarfile.SYMTYPE, 0o777, link=link))
        for name, text in (("etc/group", GROUP), ("etc/passwd", PASSWD)):
            data = text.encode()
            tar.addfile(_entry(name, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def _architecture() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def build(directory: Path, busybox: Path | None = None) -> Image:
    """Write the image archive into directory (made if missing); returns it.
    Built again each time: it takes milliseconds and depends only on busybox."""
    busybox = busybox or find_busybox()
    check_static(busybox)
    version = busybox_version(busybox)
    name = f"{REPOSITORY}:{version}"
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    layer = layer_tar(busybox)
    layer_digest, layer_size = blob(layer)
    config = {
        "architecture": _architecture(), "os": "linux",
        "config": {"Env": [f"PATH={PATH}"], "Cmd": DEFAULT_COMMAND, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": f"crust: Debian busybox-static {version}"}],
    }
    config_digest, config_size = blob(_json(config))
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST,
                "config": {"mediaType": CONFIG, "digest": config_digest, "size": config_size},
                "layers": [{"mediaType": LAYER, "digest": layer_digest, "size": layer_size}]}
    manifest_digest, manifest_size = blob(_json(manifest))
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": MANIFEST, "digest": manifest_digest, "size": manifest_size,
        "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": version}}]}

    directory.mkdir(parents=True, exist_ok=True)
    archive = directory / f"crust-busybox-{version}.oci.tar"
    partial = archive.with_suffix(".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        files = [("oci-layout", _json({"imageLayoutVersion": "1.0.0"})), ("index.json", _json(index))]
        files += [(f"blobs/sha256/{d.split(':', 1)[1]}", data) for d, data in sorted(blobs.items())]
        for dirname in ("blobs", "blobs/sha256"):
            tar.addfile(_entry(dirname, tarfile.DIRTYPE, 0o755))
        for path, data in files:
            tar.addfile(_entry(path, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    partial.replace(archive)
    return Image(archive=archive, name=name, image_id=config_digest, busybox_version=version)


def _json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
