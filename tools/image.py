"""Build crust's container image from the Containerfile with buildah.

    python tools/image.py [--with-qemu] [--archive]

The Containerfile starts FROM docker.io/library/python:3.11-slim-bookworm.
When buildah's storage has no image of that name and no registry answers,
this makes one locally: a debootstrap of the same Debian release (bookworm,
minbase) with Debian's Python 3.11, pip and a `python` command, the slim
image's exclusions (docs, man pages, locales) and pip allowed to install
into the system (Debian's EXTERNALLY-MANAGED marker removed, as the python
images have none). It is imported into buildah's storage under the FROM name
and kept as an OCI archive in the cache directory, so the next build (or the
next machine state with an emptied storage) does not bootstrap again.

The image itself is built with `buildah bud --isolation chroot` (RUN steps
need no OCI runtime that way) and tagged localhost/crust:VERSION (-microvm
with QEMU).
`--archive` also writes it as an OCI archive named after the hash of
everything the build reads, which is what tests/integration/test_image.py imports into
containerd; a second call with an unchanged tree reuses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTAINERFILE = REPO / "Containerfile"
CACHE = Path(os.environ.get("CRUST_IMAGE_CACHE", "/var/cache/crust/image"))
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# What the slim Debian images leave out of every package (dpkg path-exclude).
SLIM_EXCLUDES = ["/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*",
                 "/usr/share/lintian/*", "/usr/share/linda/*"]
SLIM_INCLUDES = ["/usr/share/doc/*/copyright", "/usr/share/locale/locale.alias"]
DEBIAN_SOURCES = """\
Types: deb
URIs: http://deb.debian.org/debian
Suites: {release} {release}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: {release}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""
BASE_PACKAGES = ["python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates"]
# The host's trust store: mounted over the build container's for its RUN
# steps only (nothing of it reaches a layer), so that pip and apt trust what
# the host trusts, such as a TLS-inspecting proxy in front of PyPI.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# The build context: what the Containerfile copies, nothing else.
CONTEXT_FILES = ["Containerfile", "pyproject.toml", "README.md"]


def log(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=True, **kwargs)


def output(argv: list[str]) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def base_image_name() -> str:
    """The FROM of the Containerfile's final stage (every stage uses the same)."""
    names = {line.split()[1] for line in CONTAINERFILE.read_text().splitlines()
             if line.upper().startswith("FROM ")}
    if len(names) != 1:
        raise SystemExit(f"image: the Containerfile names {len(names)} base images, this tool makes one")
    return names.pop()


def debian_release(base: str) -> str:
    """bookworm from python:3.11-slim-bookworm."""
    tag = base.rsplit(":", 1)[1]
    return tag.rsplit("-", 1)[1]


def buildah_has(image: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", image],
                          capture_output=True).returncode == 0


def registry_answers(image: str) -> bool:
    """One pull attempt, bounded: a machine that reaches the registry uses
    the real base image."""
    try:
        return subprocess.run(["buildah", "pull", "--quiet", image], capture_output=True,
                              timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def bootstrap_base(base: str, archive: Path) -> None:
    release = debian_release(base)
    with tempfile.TemporaryDirectory(prefix="crust-base-", dir="/var/tmp") as tmp:
        root = Path(tmp) / "rootfs"
        log(f"debootstrap {release} (minbase) with {', '.join(BASE_PACKAGES)}")
        run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             release, str(root), DEBIAN_MIRROR], stdout=subprocess.DEVNULL)
        # Device nodes come from the container runtime, not the image.
        for entry in (root / "dev").iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        dpkg_cfg = root / "etc/dpkg/dpkg.cfg.d/slim"
        dpkg_cfg.write_text("".join(f"path-exclude {p}\n" for p in SLIM_EXCLUDES)
                            + "".join(f"path-include {p}\n" for p in SLIM_INCLUDES))
        for pattern in ("usr/share/man", "usr/share/info", "usr/share/lintian", "usr/share/locale"):
            for entry in (root / pattern).glob("*"):
                if entry.name != "locale.alias":
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        for doc in (root / "usr/share/doc").glob("*"):
            if doc.is_dir() and not doc.is_symlink():
                for entry in doc.iterdir():
                    if entry.name != "copyright":
                        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        (root / "etc/apt/sources.list").unlink(missing_ok=True)
        (root / "etc/apt/sources.list.d/debian.sources").write_text(DEBIAN_SOURCES.format(release=release))
        # The python images let pip install into the system; Debian's marker refuses it.
        for marker in (root / "usr/lib").glob("python3*/EXTERNALLY-MANAGED"):
            marker.unlink()
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        (root / "var/cache/apt/archives/partial").mkdir(parents=True)
        for lists in (root / "var/lib/apt/lists").glob("*"):
            if lists.is_file():
                lists.unlink()
        python = output(["chroot", str(root), "python", "--version"])
        pip = output(["chroot", str(root), "pip", "--version"])
        log(f"base has {python}, {pip.split(' from ')[0]}")
        container = output(["buildah", "from", "scratch"])
        try:
            mountpoint = output(["buildah", "mount", container])
            run(["cp", "-a", f"{root}/.", mountpoint])
            run(["buildah", "umount", container], stdout=subprocess.DEVNULL)
            run(["buildah", "config", "--env", "LANG=C.UTF-8",
                 "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "--cmd", "python3", "--label", f"crust.dev/stand-in-for={base}", container])
            run(["buildah", "commit", "--quiet", "--rm", container, base], stdout=subprocess.DEVNULL)
        except BaseException:
            subprocess.run(["buildah", "rm", container], capture_output=True)
            raise
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    run(["buildah", "push", "--quiet", base, f"oci-archive:{partial}:{base}"], stdout=subprocess.DEVNULL)
    partial.rename(archive)


def ensure_base() -> str:
    """The FROM image in buildah's storage: already there, pulled, restored
    from the cache, or bootstrapped (in that order)."""
    base = base_image_name()
    if buildah_has(base):
        return "present"
    archive = CACHE / f"base-{base.rsplit('/', 1)[1].replace(':', '-')}.oci.tar"
    if archive.exists():
        log(f"{base}: restored from {archive}")
        run(["buildah", "pull", "--quiet", f"oci-archive:{archive}"], stdout=subprocess.DEVNULL)
        run(["buildah", "tag", output(["buildah", "images", "--quiet", "--filter",
                                       f"label=crust.dev/stand-in-for={base}"]).split()[0], base])
        return "cached stand-in"
    if registry_answers(base):
        log(f"{base}: pulled from its registry")
        return "pulled"
    log(f"{base}: no registry answers; making a stand-in with debootstrap")
    bootstrap_base(base, archive)
    return "bootstrapped stand-in"


def tree_hash(with_qemu: bool) -> str:
    """Hash of everything the build reads, so an archive is reused only for
    the tree it was built from."""
    digest = hashlib.sha256(f"with_qemu={with_qemu}\n".encode())
    paths = [REPO / f for f in CONTEXT_FILES] + sorted(
        p for p in (REPO / "crust").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in paths:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def version() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise SystemExit("image: no version in pyproject.toml")


def tag(with_qemu: bool) -> str:
    return f"localhost/crust:{version()}{'-microvm' if with_qemu else ''}"


def archive_path(with_qemu: bool) -> Path:
    return CACHE / f"crust-{'microvm' if with_qemu else 'plain'}-{tree_hash(with_qemu)}.oci.tar"


def build(with_qemu: bool, host_ca: bool = True) -> dict:
    started = time.monotonic()
    base_state = ensure_base()
    base_seconds = time.monotonic() - started
    name = tag(with_qemu)
    log(f"buildah bud {name}")
    build_started = time.monotonic()
    trust = ["--volume", f"{HOST_CA_BUNDLE}:{HOST_CA_BUNDLE}:ro"] if host_ca and HOST_CA_BUNDLE.exists() else []
    with tempfile.TemporaryDirectory(prefix="crust-image-") as tmp:
        iidfile = Path(tmp) / "iid"
        # No --layers: buildah 1.28 cannot bind-mount from a stage it took
        # from its layer cache (RUN --mount=type=bind,from=build finds no
        # /wheels). The image ID, not the tag, names what this build made:
        # another build on the machine may move the tag meanwhile.
        run(["buildah", "bud", "--isolation", "chroot", "--pull=false", *trust, "--iidfile", str(iidfile),
             "--build-arg", f"WITH_QEMU={'true' if with_qemu else 'false'}",
             "-f", str(CONTAINERFILE), "-t", name, str(REPO)], stdout=sys.stderr)
        image_id = iidfile.read_text().strip()
    build_seconds = time.monotonic() - build_started
    size = json.loads(output(["buildah", "images", "--json", image_id]))[0]["size"]
    return {"image": name, "id": image_id, "base": base_state, "base_seconds": round(base_seconds, 1),
            "build_seconds": round(build_seconds, 1), "size": size,
            "buildah": output(["buildah", "--version"])}


# Archives of other trees are removed once this old (a run of another tree
# on the same machine may be importing a newer one).
STALE_SECONDS = 24 * 3600


def write_archive(with_qemu: bool, image_id: str, archive: Path) -> Path:
    """The built image (by ID) as an OCI archive named for its tree."""
    if archive.exists():
        return archive
    for stale in CACHE.glob(f"crust-{'microvm' if with_qemu else 'plain'}-*.oci.tar"):
        if time.time() - stale.stat().st_mtime > STALE_SECONDS:
            stale.unlink(missing_ok=True)
    partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
    partial.unlink(missing_ok=True)
    try:
        run(["buildah", "push", "--quiet", image_id, f"oci-archive:{partial}:{tag(with_qemu)}"],
            stdout=subprocess.DEVNULL)
        partial.rename(archive)
    finally:
        partial.unlink(missing_ok=True)
    return archive


def ensure_archive(with_qemu: bool) -> Path:
    """The image of this tree as an OCI archive: the cached one, or built now."""
    archive = archive_path(with_qemu)
    if archive.exists():
        return archive
    result = build(with_qemu)
    return write_archive(with_qemu, result["id"], archive)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with-qemu", action="store_true", help="build the -microvm variant (WITH_QEMU=true)")
    parser.add_argument("--no-host-ca", action="store_true",
                        help=f"do not lend the build's RUN steps the host's {HOST_CA_BUNDLE}")
    parser.add_argument("--archive", action="store_true",
                        help=f"also write the image as an OCI archive under {CACHE}")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("buildah builds with --isolation chroot as root; run as root")
    archive = archive_path(args.with_qemu)   # the tree as the build reads it
    result = build(args.with_qemu, host_ca=not args.no_host_ca)
    if args.archive:
        result["archive"] = str(write_archive(args.with_qemu, result["id"], archive))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
