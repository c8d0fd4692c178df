"""The Debian packages the guest image is made of, as apt and dpkg know
them: apt's candidate version of each package, the installed package that
ships a host file (every file copied into the guest must have one), the
libraries a program links, and the .deb files downloaded once and
unpacked once into the image cache (crust.kata.image.build assembles the image
from them).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from crust.common.private import make_dirs
from crust.sys.run import CommandError


def command(argv: list[str], *, timeout: float = 120, cwd: Path | None = None,
            ok_codes: tuple[int, ...] = (0,), env: dict[str, str] | None = None) -> str:
    """Run argv (no shell), return stdout; CommandError with stderr on failure.
    env: variables set beside the usual ones."""
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "LC_ALL": "C", "DEBIAN_FRONTEND": "noninteractive", **(env or {})})
    except subprocess.TimeoutExpired:
        raise CommandError(argv, None, f"no answer within {timeout:.0f}s", timed_out=True) from None
    if done.returncode not in ok_codes:
        raise CommandError(argv, done.returncode, done.stderr or done.stdout)
    return done.stdout


def apt_cache_options(cache: Path) -> list[str]:
    """apt-cache keeps the package cache it builds from apt's lists in the
    image cache. Debian's container images switch apt's own off
    (Dir::Cache::pkgcache ""), and without one each apt-cache call rebuilds
    it: about a second each, twice at every handler start, against a few
    milliseconds. apt checks the file against the lists and rebuilds it
    after `apt-get update`; build() holds the cache's lock meanwhile."""
    return ["-o", f"Dir::Cache::pkgcache={cache / 'apt-pkgcache.bin'}"]


def kernel_package(metapackage: str, apt_options: list[str] | None = None) -> str:
    """The versioned kernel package the metapackage points at
    (linux-image-cloud-amd64 -> linux-image-6.1.0-56-cloud-amd64)."""
    for line in command(["apt-cache", *(apt_options or []), "depends", metapackage]).splitlines():
        m = re.match(r"\s*Depends:\s*(linux-image-\S+)", line)
        if m:
            return m.group(1)
    raise LookupError(f"apt-cache depends {metapackage} names no linux-image package (apt-get update?)")


def candidate_versions(packages: list[str], apt_options: list[str] | None = None) -> dict[str, str]:
    """apt's candidate version of each package (what apt-get download gets)."""
    found, current = {}, None
    for line in command(["apt-cache", *(apt_options or []), "policy", *packages]).splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = line[:-1]
        m = re.match(r"\s*Candidate:\s*(\S+)", line)
        if m and current and m.group(1) != "(none)":
            found[current] = m.group(1)
    missing = [p for p in packages if p not in found]
    if missing:
        raise LookupError(f"apt has no candidate for {' '.join(missing)} (apt-get update?)")
    return found


def owners(paths: list[str]) -> dict[str, tuple[str, str]]:
    """path -> (package, version) of the installed package that shipped it.
    usr-merged hosts reach one file as /lib/... and /usr/lib/...; dpkg knows
    one of the names, so every variant is asked (in one dpkg-query call)."""
    variants: dict[str, str] = {}
    for path in paths:
        for p in (path, os.path.realpath(path)):
            for v in (p, p[4:] if p.startswith("/usr/") else "/usr" + p):
                variants.setdefault(v, path)
    package_of: dict[str, str] = {}
    # Exit code 1: some variants are unknown to dpkg, as expected.
    for line in command(["dpkg-query", "-S", *variants], ok_codes=(0, 1)).splitlines():
        if ": " not in line or line.startswith("diversion "):
            continue
        pkgs, name = line.split(": ", 1)          # "libc6:amd64: /lib/x86_64-linux-gnu/libc.so.6"
        if name in variants:
            package_of.setdefault(variants[name], pkgs.split(", ")[0].split(":")[0])
    missing = [p for p in paths if p not in package_of]
    if missing:
        raise LookupError(f"{' '.join(missing)}: no installed Debian package ships it; "
                          "refusing to copy it into the guest")
    versions = {}
    out = command(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Abbrev} ${Version}\n",
                *sorted(set(package_of.values()))])
    for line in out.splitlines():
        name, status, version = line.split()
        if status.startswith("ii"):
            versions[name] = version
    return {path: (pkg, versions[pkg]) for path, pkg in package_of.items()}


def shared_libraries(binary: str) -> list[str]:
    """Paths ldd resolves for binary (the loader included); none for a static one."""
    libs = []
    try:
        out = command(["ldd", binary])
    except CommandError as exc:
        if "not a dynamic executable" in str(exc):
            return []   # static (catatonit): nothing to copy with it
        raise
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].split("(")[0].strip()
            if target.startswith("/"):
                libs.append(target)
            elif "not found" in line:
                raise LookupError(f"ldd {binary}: {line}")
        elif line.startswith("/"):
            libs.append(line.split("(")[0].strip())
    return libs


def fetch(cache: Path, package: str, version: str) -> Path:
    """The .deb of package=version, downloaded once into cache/debs."""
    debs = cache / "debs"
    make_dirs(debs)
    name = f"{package}_{version.replace(':', '%3a')}_"
    for existing in debs.glob(f"{glob_escape(name)}*.deb"):
        return existing
    with tempfile.TemporaryDirectory(dir=debs) as tmp:
        command(["apt-get", "download", "-o", "APT::Sandbox::User=root", f"{package}={version}"],
             cwd=Path(tmp), timeout=900)
        got = list(Path(tmp).glob("*.deb"))
        if len(got) != 1:
            raise RuntimeError(f"apt-get download {package}={version} left {len(got)} files")
        fields = command(["dpkg-deb", "-f", str(got[0]), "Package", "Version"])
        if f"Package: {package}" not in fields or f"Version: {version}" not in fields:
            raise RuntimeError(f"apt-get download {package}={version} gave {fields!r}")
        final = debs / got[0].name
        os.replace(got[0], final)
        return final


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def extract(cache: Path, deb: Path, package: str, version: str) -> Path:
    """`dpkg -x` of the .deb into cache/extract, once (marked complete last)."""
    dest = cache / "extract" / f"{package}_{re.sub(r'[^A-Za-z0-9.+-]', '_', version)}"
    if (dest / ".complete").exists():
        return dest
    make_dirs(dest.parent)
    shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".x-"))
    try:
        command(["dpkg", "-x", str(deb), str(tmp)], timeout=600)
        (tmp / ".complete").touch()
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
