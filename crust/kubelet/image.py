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

The same parts make other images from busybox (assemble(): the busybox
layer with users and groups of one's own, extra layers of files with exact
owners and modes, setuid bits included, and any image config), for a
registry (crust.kubelet.registry) as well as an archive.

pause_image() is the sandbox image for a runtime that stops a pod's
infra container with its image's stop signal and waits (CRI-O): busybox
with /pause, a shell that traps TERM and INT and exits, and SIGKILL as the
image's stop signal. The kernel delivers no signal to a namespace's first
process that has no handler for it: a SIGTERM that came before the trap
was set (a pod stopped right after it started) would be lost and the stop
would wait out its timeout.
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
PAUSE_COMMAND = "/pause"
# Its sleep is killed too: in a pod sharing the host's PID namespace no
# kernel does it when the shell exits.
PAUSE_SCRIPT = """#!/bin/sh
trap 'kill $! 2>/dev/null; exit 0' TERM INT
while :; do sleep 3600 & wait $!; done
"""
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


def _entry(name: str, kind: bytes, mode: int, size: int = 0, link: str = "", uid: int = 0,
           gid: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, uid, gid, "", ""
    return info


@dataclass(frozen=True)
class File:
    """One entry of a layer: a regular file (data), a directory (is_dir), a
    symbolic link (link), or a hard link (link, hard: another entry's path
    in the layer), with its exact mode and owner (a setuid bit is kept as
    given)."""

    path: str
    data: bytes = b""
    mode: int = 0o644
    link: str = ""
    hard: bool = False
    is_dir: bool = False
    uid: int = 0
    gid: int = 0

    def tar_entry(self) -> tarfile.TarInfo:
        name = self.path.strip("/")
        if self.is_dir:
            return _entry(name, tarfile.DIRTYPE, self.mode, uid=self.uid, gid=self.gid)
        if self.link and self.hard:
            return _entry(name, tarfile.LNKTYPE, self.mode, link=self.link, uid=self.uid, gid=self.gid)
        if self.link:
            return _entry(name, tarfile.SYMTYPE, 0o777, link=self.link, uid=self.uid, gid=self.gid)
        return _entry(name, tarfile.REGTYPE, self.mode, len(self.data), uid=self.uid, gid=self.gid)


def layer_of(files: list[File]) -> bytes:
    """An uncompressed layer holding exactly these entries, in this order
    (parents before children), the same bytes for the same files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for item in files:
            entry = item.tar_entry()
            tar.addfile(entry, io.BytesIO(item.data) if entry.isreg() else None)
    return buffer.getvalue()


def layer_tar(busybox: Path, passwd: str = PASSWD, group: str = GROUP, hard_links: bool = False) -> bytes:
    """The busybox layer, byte for byte the same for the same busybox (and
    the same /etc/passwd and /etc/group). Its applets are symbolic links to
    bin/busybox, or hard links to it (as the busybox images of registries
    have them: a path masked in a container then masks that applet alone)."""
    applets = _applets(busybox)
    files = [File(name, mode=mode, is_dir=True) for name, mode in sorted(DIRS.items())]
    files.append(File("bin/busybox", busybox.read_bytes(), mode=0o755))
    for applet in applets:
        if applet == "bin/busybox" or applet.split("/", 1)[0] not in ("bin", "sbin", "usr"):
            continue
        if hard_links:
            files.append(File(applet, mode=0o755, link="bin/busybox", hard=True))
        else:
            files.append(File(applet, link=os.path.relpath("bin/busybox", os.path.dirname(applet))))
    files += [File("etc/group", group.encode()), File("etc/passwd", passwd.encode())]
    return layer_of(files)


def architecture() -> str:
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


@dataclass(frozen=True)
class OciImage:
    """An image's blobs in memory: its manifest names its config and layers
    by digest. The same inputs give the same bytes, so the same digests."""

    blobs: dict[str, bytes]
    manifest_digest: str
    config_digest: str

    @property
    def manifest(self) -> bytes:
        return self.blobs[self.manifest_digest]

    def write_archive(self, archive: Path, name: str, tag: str) -> None:
        """An OCI image layout in a tar file, as `ctr images import` takes it
        (the image named `name`), written whole or not at all."""
        index = {"schemaVersion": 2, "manifests": [{
            "mediaType": MANIFEST, "digest": self.manifest_digest, "size": len(self.manifest),
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": tag}}]}
        partial = archive.with_suffix(".partial")
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
            files = [("oci-layout", _json({"imageLayoutVersion": "1.0.0"})), ("index.json", _json(index))]
            files += [(f"blobs/sha256/{d.split(':', 1)[1]}", data) for d, data in sorted(self.blobs.items())]
            for dirname in ("blobs", "blobs/sha256"):
                tar.addfile(_entry(dirname, tarfile.DIRTYPE, 0o755))
            for path, data in files:
                tar.addfile(_entry(path, tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
        partial.replace(archive)


def assemble(layers: list[bytes], config: dict, created_by: str) -> OciImage:
    """An image of these layers (uncompressed tars, bottom first) whose
    runtime config is `config` (Env, Entrypoint, Cmd, User, WorkingDir...)."""
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    described = [blob(layer) for layer in layers]
    image_config = {
        "architecture": architecture(), "os": "linux", "config": config,
        "rootfs": {"type": "layers", "diff_ids": [digest for digest, _ in described]},
        "history": [{"created_by": created_by}],
    }
    config_digest, config_size = blob(_json(image_config))
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST,
                "config": {"mediaType": CONFIG, "digest": config_digest, "size": config_size},
                "layers": [{"mediaType": LAYER, "digest": d, "size": size} for d, size in described]}
    manifest_digest, _ = blob(_json(manifest))
    return OciImage(blobs=blobs, manifest_digest=manifest_digest, config_digest=config_digest)


def build(directory: Path, busybox: Path | None = None) -> Image:
    """Write the image archive into directory (made if missing); returns it.
    Built again each time: it takes milliseconds and depends only on busybox."""
    busybox = busybox or find_busybox()
    check_static(busybox)
    version = busybox_version(busybox)
    name = f"{REPOSITORY}:{version}"
    image = busybox_image(busybox)
    directory.mkdir(parents=True, exist_ok=True)
    archive = directory / f"crust-busybox-{version}.oci.tar"
    image.write_archive(archive, name, version)
    return Image(archive=archive, name=name, image_id=image.config_digest, busybox_version=version)


def busybox_image(busybox: Path | None = None) -> OciImage:
    """The image build() writes, in memory (for a registry)."""
    busybox = busybox or find_busybox()
    check_static(busybox)
    return assemble([layer_tar(busybox)], {"Env": [f"PATH={PATH}"], "Cmd": DEFAULT_COMMAND, "WorkingDir": "/"},
                    created_by=f"crust: Debian busybox-static {busybox_version(busybox)}")


def pause_image(busybox: Path | None = None) -> OciImage:
    """The busybox layer and /pause (PAUSE_COMMAND, its default command)."""
    busybox = busybox or find_busybox()
    check_static(busybox)
    pause = layer_of([File(PAUSE_COMMAND.lstrip("/"), PAUSE_SCRIPT.encode(), mode=0o755)])
    return assemble([layer_tar(busybox), pause], {"Env": [f"PATH={PATH}"], "Cmd": [PAUSE_COMMAND], "WorkingDir": "/",
                                                  "StopSignal": "SIGKILL"},
                    created_by=f"crust: pause from Debian busybox-static {busybox_version(busybox)}")


def _json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _archive_json(tar: tarfile.TarFile, member: str) -> dict:
    return json.load(tar.extractfile(member))


def archive_name(archive: Path) -> str:
    """The name an OCI archive gives its image (the ref.name annotation)."""
    with tarfile.open(archive) as tar:
        (manifest,) = _archive_json(tar, "index.json")["manifests"]
    return manifest["annotations"]["org.opencontainers.image.ref.name"]


def archive_config(archive: Path) -> dict:
    """The runtime config (Entrypoint, Cmd, Env, User, WorkingDir) of the
    image in an OCI archive."""
    with tarfile.open(archive) as tar:
        index = _archive_json(tar, "index.json")
        manifest = _archive_json(tar, "blobs/" + index["manifests"][0]["digest"].replace(":", "/"))
        config = _archive_json(tar, "blobs/" + manifest["config"]["digest"].replace(":", "/"))
    return config.get("config", {})
