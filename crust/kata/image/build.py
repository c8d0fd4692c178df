"""Build the guest image (a kernel, an initramfs and the guest's root) from Debian packages only.

    python -m crust.kata.image.build build [--cache DIR] [--flavor cloud|generic] [--force] [--json]

Why this shape:

- Only Debian's package registry is trusted: the kernel and busybox-static
  are fetched with `apt-get download` (pinned to apt's candidate version) and
  unpacked with `dpkg -x`; the file system tools (e2fsprogs, xfsprogs,
  blkid) are the host's installed Debian binaries, copied with the shared
  libraries `ldd` names. Every copied file must belong to an installed
  package, whose name and version enter the image hash
  (crust.kata.image.packages asks apt and dpkg). Beside them, crust's
  own /init (guest/init.sh) and a small C program of its own
  (guest/enter.c), compiled by the host's gcc and linked statically.
- The guest's agent (crust.guest) runs on Debian's python3.11, copied
  like the tools with its shared libraries, and only the standard library
  modules the agent imports: the set is measured at build time by importing
  the agent under that interpreter and reading sys.modules, so it follows
  the agent's imports without a list to keep. The one exception to "only
  Debian packages": the protobuf runtime (google.protobuf) is the one the
  builder's own interpreter imports, a pip wheel, not Debian's
  python3-protobuf: the agent's generated modules (crust/api/*_pb2.py) are
  made for that runtime, and the guest answers with the same encoder the
  host's client uses. Its version and the content of the files taken from
  it enter the image hash, as do those of crust's own modules. Everything
  Python is byte-compiled here, by the guest's interpreter, into
  unchecked-hash .pyc files (no source times involved, so the archive stays
  reproducible, and nothing is compiled at boot: under software emulation
  an import costs about twenty times what it does on the host).
- The guest's files are not in the initramfs but in one read-only ext4
  image (root.img) every VM maps as a virtio-pmem device and mounts with
  DAX (crust.kata.image.guest_root): the initramfs holds only busybox, the
  modules of that device and the /init that mounts it.
- The kernel is Debian's own, so the guest parses volumes with a kernel that
  gets security updates: after `apt-get update`, a new candidate changes the
  hash and the next build picks it up.
- The build is cached: the output is rebuilt only when its inputs change
  (package versions, the guest scripts, the Python files of crust and of
  the protobuf runtime, the module list, this builder's format), which is
  decided without downloading anything. The initramfs is byte-for-byte
  reproducible (see cpio.py).

Layout of the cache (default /var/cache/crust/kata):
    debs/                 downloaded .deb files
    extract/<pkg>_<ver>/  `dpkg -x` of each
    programs/<hash>/      the guest's own programs, compiled (GUEST_PROGRAMS)
    images/<flavor>/<hash>/  vmlinux (or vmlinuz), initramfs.cpio, root.img, manifest.json (inputs, hash, sizes)
    images/<flavor>/current  the <hash> of the last build or confirmation

One directory per input hash: a handler keeps booting the image it checked
at its start while another release (or checkout) on the same node builds
its own beside it; the oldest beyond KEEP_IMAGES are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from crust.common.atomicfile import write_atomic
from crust.common.private import make_dirs, open_new
from crust.kata.image import agent_files, bzimage, cpio, guest_root
from crust.kata.image.agent_files import PYTHON, PYTHON_PACKAGES, PYTHON_STDLIB
from crust.kata.image.packages import (
    apt_cache_options,
    candidate_versions,
    command,
    extract,
    fetch,
    kernel_package,
    owners,
    shared_libraries,
)
from crust.kata.image.kmod import ModuleTree
from crust.sys.run import CommandError

DEFAULT_CACHE = Path("/var/cache/crust/kata")
GUEST_DIR = Path(__file__).resolve().parents[2] / "guest" / "files"
# Bump when the image layout changes in a way the other inputs do not show
# (4: the initramfs is no longer compressed; 5: the kernel is booted
# uncompressed, crust.kata.image.bzimage; 6: the Python agent, its files
# byte-compiled into unchecked-hash .pyc files; 7: the guest's root in
# root.img, the initramfs only mounts it).
BUILDER_VERSION = 7
# The initramfs, an uncompressed cpio archive: under software emulation
# gunzipping a compressed one is a large part of the guest kernel's boot,
# against a plain copy; the host keeps the archive at about two and a half
# times its compressed size.
INITRD = "initramfs.cpio"
ROOT = guest_root.ROOT_IMAGE
SBIN_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"

# Kernel modules the guest loads; their dependencies are added (kmod.py) and
# those built into the kernel are skipped. Boot modules are loaded by /init;
# a file system's modules by the agent on the first mount of that type (xfs
# alone costs about half a second of boot under software emulation). The
# console's serial port (8250) is built into both kernels; virtio_console:
# the agent's virtio-serial port (crust.agent).
# virtio_net: a pod's NIC (crust.sys.podnet), there at boot when the pod has
# a network; without one the module costs a few milliseconds.
# virtio_balloon: the memory the guest frees goes back to the host (free
# page reporting, crust.kata.vmm.config). What mounts the guest's root
# (guest_root.ROOT_MODULES) is loaded by the initramfs, before these.
BOOT_MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "virtio_console", "virtio_balloon")
FS_MODULES = {"ext4": ("ext4",), "xfs": ("xfs",),
              # LUKS2 volumes (agent's luksopen): dm-crypt, the xts mode over
              # the built-in aes (ecb is what xts asks for by name, which no
              # modprobe in the guest could load), and the kernel crypto API
              # for user space that cryptsetup uses for key slots.
              "crypt": ("dm_crypt", "xts", "ecb", "algif_skcipher"),
              # crust.dev/integrity: dm-integrity under dm-crypt, and the
              # authenc template that pairs the cipher with the HMAC.
              "integrity": ("dm_integrity", "authenc"),
              # A pod's shared directory (agent's sharemount): FUSE and its
              # virtio transport.
              "virtiofs": ("fuse", "virtiofs"),
              # Disks as LUNs of a virtio-scsi controller (VmConfig.disk_bus):
              # loaded by /init at boot when the command line asks for them.
              "scsi": ("virtio_scsi", "sd_mod")}
# Modules the guest's kernel loads by itself when a container asks for what
# they provide (request_module -> busybox modprobe, which reads the image's
# modules.dep): the bridge a privileged container or one with NET_ADMIN
# makes (`brctl addbr`), and the virtual links such containers add. Only
# these: an unprivileged container can make the kernel ask for a module, and
# nothing else is in the image for it to find.
DEMAND_MODULES = ("bridge", "veth", "dummy", "8021q", "macvlan")


@dataclass(frozen=True)
class Flavor:
    name: str
    kernel_metapackage: str              # depends on the current kernel's package
    boot_modules: tuple[str, ...]
    fs_modules: dict[str, tuple[str, ...]]
    demand_modules: tuple[str, ...] = DEMAND_MODULES

    def module_inputs(self) -> dict:
        return {"boot": list(self.boot_modules), "fs": {k: list(v) for k, v in sorted(self.fs_modules.items())},
                "demand": list(self.demand_modules)}


FLAVORS = {
    # Small, virtio-oriented; no 9p, but virtio-fs. ext4 is built in.
    "cloud": Flavor("cloud", "linux-image-cloud-amd64", BOOT_MODULES, FS_MODULES),
    # Debian's generic kernel: ext4 is a module, and it has 9p over virtio
    # (for sharing a host directory later).
    "generic": Flavor("generic", "linux-image-amd64", BOOT_MODULES,
                      {**FS_MODULES, "9p": ("9p", "9pnet_virtio")}),
}

# Debian package -> programs copied from the host's installation of it.
HOST_TOOLS = {
    "e2fsprogs": ("resize2fs", "e2fsck", "mke2fs", "tune2fs"),
    "xfsprogs": ("xfs_growfs", "xfs_repair", "mkfs.xfs"),
    # blkid: a disk's signature before a blank one is formatted; unshare:
    # the init of a pod's shared PID namespace started in a new one.
    "util-linux": ("blkid", "unshare"),
    "cryptsetup-bin": ("cryptsetup",),
    # The kernel's own table of an opened volume (cryptsetup status reads
    # the disk's header, which the disk's owner writes).
    "dmsetup": ("dmsetup",),
    # A pod's containers run as their OCI spec says (user and groups,
    # capabilities, no_new_privs, seccomp, masked and read-only paths,
    # rlimits, cgroup limits): the spec, rewritten for the guest, to runc.
    "crun": ("crun",),
    # The init of a pod's shared PID namespace (catatonit -P: it reaps the
    # orphans of the pod's containers, as the pause container does).
    "catatonit": ("catatonit",),
}
# The guest's own files: path in the image -> file in guest/.
GUEST_FILES = {"init": "init.sh", "usr/lib/crust/warm.json": "warm.json"}
# The initramfs's /init: it mounts the guest's root (guest_root).
BOOT_INIT = "mountroot.sh"
# The guest's own programs, compiled from guest/ by the host's C compiler
# (gcc, a Debian package): path in the image -> source. They are linked
# statically: under emulation the dynamic loader's start (mapping and
# relocating the C library) costs each run several times what the program
# does. Each is compiled once per source and flags, into the cache
# (programs/), so a node rebuilding its image for a new kernel needs no
# compiler.
GUEST_PROGRAMS = {"usr/lib/crust/enter": "enter.c"}
GUEST_CFLAGS = ("-O2", "-Wall", "-Wextra", "-Werror", "-fstack-protector-strong", "-static", "-s")
TOOL_LINKS = {"mkfs.ext4": "mke2fs", "mkfs.ext3": "mke2fs", "fsck.ext4": "e2fsck"}
HOST_CONFIG = ("/etc/mke2fs.conf",)

# ------------------------------------------------------------------ inputs

@dataclass
class HostFile:
    source: str      # on the host
    dest: str        # in the guest
    mode: int


@dataclass
class Inputs:
    flavor: Flavor
    kernel_package: str
    downloads: dict[str, str]          # package -> version, fetched with apt-get download
    host_packages: dict[str, str]      # package -> version, files copied from the host
    host_files: list[HostFile]
    scripts: dict[str, str]            # guest script (or host config file) -> sha256
    # The Python files no Debian package ships (crust's, the protobuf
    # runtime's), and what of them enters the hash: {"protobuf": version,
    # "files": {guest path: sha256}}.
    python_files: list[HostFile] = field(default_factory=list)
    python: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"builder": BUILDER_VERSION, "flavor": self.flavor.name, "modules": self.flavor.module_inputs(),
                "kernel_package": self.kernel_package, "downloads": self.downloads,
                "host_packages": self.host_packages, "scripts": self.scripts,
                "host_files": sorted(f.dest for f in self.host_files), "guest_cflags": list(GUEST_CFLAGS),
                "python": self.python}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()


def ensure_host_tools() -> None:
    """Install the Debian packages of missing tools (root; ordinary apt-get)."""
    missing = sorted({pkg for pkg, tools in HOST_TOOLS.items()
                      for t in tools if shutil.which(t, path=SBIN_PATH) is None})
    if not (Path(PYTHON).is_file() and Path(PYTHON_STDLIB, "asyncio").is_dir()):
        missing = sorted({*missing, *PYTHON_PACKAGES})
    if missing:
        print(f"crust-kata: installing {' '.join(missing)} with apt-get", file=sys.stderr)
        command(["apt-get", "install", "-y", "--no-install-recommends", *missing], timeout=900)


def python_modules() -> tuple[list[HostFile], list[HostFile], str]:
    """(standard library files, crust's and the protobuf runtime's files,
    protobuf's version) of what the guest's agent imports (guest_python)."""
    stdlib, own, version = agent_files.agent_files()
    return ([HostFile(path, path, 0o755 if path.endswith(".so") else 0o644) for path in stdlib],
            [HostFile(source, dest, 0o644) for source, dest in own], version)


def collect_inputs(flavor: Flavor, apt_options: list[str] | None = None) -> Inputs:
    kpkg = kernel_package(flavor.kernel_metapackage, apt_options)
    downloads = candidate_versions([kpkg, "busybox-static"], apt_options)
    ensure_host_tools()
    files: dict[str, HostFile] = {}
    for tools in HOST_TOOLS.values():
        for tool in tools:
            path = shutil.which(tool, path=SBIN_PATH)
            files[f"/sbin/{tool}"] = HostFile(path, f"/sbin/{tool}", 0o755)
            for lib in shared_libraries(path):
                files.setdefault(lib, HostFile(lib, lib, 0o755))
    for conf in HOST_CONFIG:
        files[conf] = HostFile(conf, conf, 0o644)
    # The agent's interpreter and standard library; the shared libraries of
    # the interpreter and of the extension modules (the protobuf runtime's
    # among them, though it is no Debian file: its libraries are).
    stdlib, own_python, protobuf_version = python_modules()
    interpreter = HostFile(PYTHON, PYTHON, 0o755)
    files.update((f.dest, f) for f in (interpreter, *stdlib))
    for f in (interpreter, *stdlib, *own_python):
        if f == interpreter or f.dest.endswith(".so"):
            for lib in shared_libraries(f.source):
                files.setdefault(lib, HostFile(lib, lib, 0o755))
    host_packages = dict(owners([f.source for f in files.values()]).values())
    # Config files are editable conffiles: their package version does not
    # say what they contain.
    hashed = {**{name: GUEST_DIR / name for name in (*GUEST_FILES.values(), *GUEST_PROGRAMS.values(), BOOT_INIT)},
              **{conf: Path(conf) for conf in HOST_CONFIG}}
    scripts = {name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in hashed.items()}
    python = {"protobuf": protobuf_version,
              "files": {f.dest: hashlib.sha256(Path(f.source).read_bytes()).hexdigest()
                        for f in sorted(own_python, key=lambda f: f.dest)}}
    return Inputs(flavor, kpkg, downloads, dict(sorted(host_packages.items())),
                  sorted(files.values(), key=lambda f: f.dest), scripts,
                  sorted(own_python, key=lambda f: f.dest), python)


def guest_program(cache: Path, source: Path, libraries: set[str]) -> bytes:
    """A guest program compiled from source (once per source and flags:
    cache/programs/<hash>/); it may link only libraries (the paths of the
    shared libraries the image holds)."""
    digest = hashlib.sha256(source.read_bytes() + b"\0" + " ".join(GUEST_CFLAGS).encode()).hexdigest()[:16]
    built = cache / "programs" / digest / source.stem
    if not built.is_file():
        if shutil.which("cc", path=SBIN_PATH) is None:
            raise LookupError(f"no C compiler (cc) to build the guest's {source.name}: apt-get install gcc libc6-dev")
        make_dirs(built.parent)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=built.parent) as tmp:
            out = Path(tmp) / source.stem
            command(["cc", *GUEST_CFLAGS, "-o", str(out), str(source)], cwd=Path(tmp))
            os.replace(out, built)
    missing = sorted(set(shared_libraries(str(built))) - libraries)
    if missing:
        raise LookupError(f"{source.name} links {', '.join(missing)}, which the image does not hold")
    return built.read_bytes()


# -------------------------------------------------------------- assembling

def _busybox_entries(busybox: Path, taken: set[str]) -> list[cpio.Entry]:
    """busybox plus a link per applet at its usual place (bin/sh, sbin/insmod,
    usr/bin/...); names the real tools provide are left to them."""
    entries = [cpio.regular("bin/busybox", busybox.read_bytes(), 0o755)]
    for applet in command([str(busybox), "--list-full"]).split():
        if os.path.basename(applet) in taken or applet == "bin/busybox":
            continue
        entries.append(cpio.symlink(applet, "/bin/busybox"))
    return entries


def _compiled_python(sources: list[str], contents: dict[str, bytes]) -> list[cpio.Entry]:
    """The .pyc of each source (agent_files.compiled), as archive entries."""
    return [cpio.regular(path, data) for path, data in agent_files.compiled(sources, contents)]


@dataclass
class BuildResult:
    flavor: str
    digest: str
    rebuilt: bool
    kernel: Path
    initrd: Path
    manifest: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def root(self) -> Path:
        return self.initrd.with_name(ROOT)


# Image directories kept per flavor (the current one always among them).
KEEP_IMAGES = 4


def _flavor_dir(cache: Path, flavor: Flavor) -> Path:
    return cache / "images" / flavor.name


def _output_dir(cache: Path, flavor: Flavor, digest: str) -> Path:
    return _flavor_dir(cache, flavor) / digest[:16]


def _mark_current(cache: Path, flavor: Flavor, out: Path) -> None:
    """Name out as the flavor's current image and the newest one, and drop
    the oldest beyond KEEP_IMAGES: a handler still running on one of those
    (two upgrades behind) finds its kernel gone at its next VM start."""
    top = _flavor_dir(cache, flavor)
    os.utime(out / "manifest.json")
    _write(top / "current", out.name.encode() + b"\n")
    built = sorted((d for d in top.iterdir() if d.is_dir() and (d / "manifest.json").exists()),
                   key=lambda d: (d / "manifest.json").stat().st_mtime, reverse=True)
    for old in built[KEEP_IMAGES:]:
        if old != out:
            shutil.rmtree(old, ignore_errors=True)
    for legacy in ("vmlinuz", "initramfs.gz", "manifest.json"):  # the one-image layout of earlier releases
        with contextlib.suppress(FileNotFoundError):
            (top / legacy).unlink()


def _current(out: Path, digest: str) -> dict | None:
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("hash") != digest:
        return None
    for name, size in manifest.get("sizes", {}).items():
        if not (out / name).is_file() or (out / name).stat().st_size != size:
            return None
    return manifest


def boot_kernel(vmlinuz: bytes) -> tuple[str, bytes, str]:
    """(file name, contents, why) of the kernel the VMs boot: the
    uncompressed vmlinux at its PVH entry where the bzImage yields one
    (crust.kata.image.bzimage: no decompressor run at each start), else the
    bzImage itself."""
    try:
        return "vmlinux", bzimage.vmlinux(vmlinuz), "pvh: the bzImage's kernel, decompressed at build time"
    except bzimage.NotBootable as exc:
        return "vmlinuz", vmlinuz, f"bzImage: {exc}"


def assemble(cache: Path, inputs: Inputs) -> tuple[str, bytes, bytes, list[cpio.Entry], dict]:
    """(kernel's file name, kernel, initramfs, the guest root's files,
    manifest) for inputs."""
    kernel_dir = extract(cache, fetch(cache, inputs.kernel_package, inputs.downloads[inputs.kernel_package]),
                         inputs.kernel_package, inputs.downloads[inputs.kernel_package])
    bb_dir = extract(cache, fetch(cache, "busybox-static", inputs.downloads["busybox-static"]),
                     "busybox-static", inputs.downloads["busybox-static"])
    releases = sorted(p.name for p in (kernel_dir / "lib" / "modules").iterdir())
    if len(releases) != 1:
        raise RuntimeError(f"{inputs.kernel_package} ships modules for {releases}")
    release = releases[0]
    vmlinuz = (kernel_dir / "boot" / f"vmlinuz-{release}").read_bytes()
    tree = ModuleTree(kernel_dir / "lib" / "modules" / release)
    boot = tree.resolve(list(inputs.flavor.boot_modules))
    per_fs = {fs: tree.resolve(list(names)) for fs, names in sorted(inputs.flavor.fs_modules.items())}
    demand = tree.resolve(list(inputs.flavor.demand_modules))
    root_modules = tree.resolve(list(guest_root.ROOT_MODULES))

    def guest_path(p: Path) -> str:
        return f"/lib/modules/{release}/{p.relative_to(tree.root)}"

    module_files = {guest_path(p): p for r in (boot, *per_fs.values(), demand, root_modules) for p in r.order}
    fs_lists = {fs: [guest_path(p) for p in r.order if p not in boot.order] for fs, r in per_fs.items()}

    entries = [cpio.directory(d) for d in ("bin", "sbin", "usr/bin", "usr/sbin", "lib", "lib64", "etc",
                                           "dev", "proc", "sys", "run", "tmp", "mnt", "root")]
    entries += [cpio.chardev("dev/console", 5, 1), cpio.chardev("dev/null", 1, 3, 0o666)]
    for dest, name in GUEST_FILES.items():
        entries.append(cpio.regular(dest, (GUEST_DIR / name).read_bytes(), 0o755 if name.endswith(".sh") else 0o644))
    libraries = {f.dest for f in inputs.host_files}
    for dest, name in GUEST_PROGRAMS.items():
        entries.append(cpio.regular(dest, guest_program(cache, GUEST_DIR / name, libraries), 0o755))
    # What the initramfs loaded is loaded already.
    entries.append(cpio.regular("etc/crust/modules", "".join(
        guest_path(p) + "\n" for p in boot.order if p not in root_modules.order).encode()))
    for fs, paths in fs_lists.items():
        if paths:
            entries.append(cpio.regular(f"etc/crust/modules.d/{fs}", "".join(p + "\n" for p in paths).encode()))
    entries.append(cpio.regular("etc/crust/image", (
        f"CRUST_IMAGE_HASH={inputs.digest[:16]}\nCRUST_IMAGE_FLAVOR={inputs.flavor.name}\n"
        f"CRUST_KERNEL_PACKAGE={inputs.kernel_package}\n").encode()))
    entries.append(cpio.symlink("etc/mtab", "/proc/self/mounts"))
    entries.append(cpio.regular("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"))
    entries.append(cpio.regular("etc/group", b"root:x:0:\n"))
    for path, p in sorted(module_files.items()):
        entries.append(cpio.regular(path.lstrip("/"), p.read_bytes()))
    # What the kernel's own module requests may load: only the demand
    # modules, each with what it needs (kmod's format, paths relative to
    # the release's directory).
    entries.append(cpio.regular(f"lib/modules/{release}/modules.dep", tree.modules_dep(demand.order).encode()))
    tools = {os.path.basename(f.dest) for f in inputs.host_files if f.dest.startswith("/sbin/")}
    for f in inputs.host_files:
        entries.append(cpio.regular(f.dest.lstrip("/"), Path(f.source).read_bytes(), f.mode))
    for f in inputs.python_files:
        entries.append(cpio.regular(f.dest.lstrip("/"), Path(f.source).read_bytes(), f.mode))
    entries += _compiled_python([f.dest for f in (*inputs.host_files, *inputs.python_files)
                                 if f.dest.endswith(".py")],
                                {e.path: e.data for e in entries})
    for link, target in TOOL_LINKS.items():
        entries.append(cpio.symlink(f"sbin/{link}", target))
    entries += _busybox_entries(bb_dir / "bin" / "busybox", tools | set(TOOL_LINKS))

    initrd = cpio.archive(guest_root.boot_entries(
        (bb_dir / "bin" / "busybox").read_bytes(),
        [(guest_path(p), p.read_bytes()) for p in root_modules.order], (GUEST_DIR / BOOT_INIT).read_bytes()))
    kernel_file, kernel, kernel_boot = boot_kernel(vmlinuz)
    manifest = {
        "hash": inputs.digest, "inputs": inputs.as_dict(), "kernel_release": release,
        "boot_modules": [p.stem for p in boot.order],
        "root_modules": [p.stem for p in root_modules.order],
        "fs_modules": {fs: [Path(p).stem for p in paths] for fs, paths in fs_lists.items()},
        "demand_modules": [p.stem for p in demand.order],
        "builtin_modules": sorted({m for r in (boot, *per_fs.values(), demand) for m in r.builtin}),
        "unresolved_softdeps": sorted({m for r in (boot, *per_fs.values(), demand) for m in r.unresolved}),
        "kernel_file": kernel_file, "kernel_boot": kernel_boot,
        "sizes": {kernel_file: len(kernel), INITRD: len(initrd), ROOT: guest_root.image_size(entries)},
    }
    return kernel_file, kernel, initrd, entries, manifest


def _write(path: Path, data: bytes) -> None:
    write_atomic(path, data, mode=0o600)


def build(cache: Path = DEFAULT_CACHE, flavor: str = "cloud", force: bool = False) -> BuildResult:
    """The image for flavor, rebuilt only when its inputs changed."""
    started = time.monotonic()
    fl = FLAVORS[flavor]
    make_dirs(cache)
    with os.fdopen(open_new(cache / ".lock", os.O_WRONLY | os.O_CREAT), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one builder at a time per cache
        inputs = collect_inputs(fl, apt_cache_options(cache))
        out = _output_dir(cache, fl, inputs.digest)
        manifest = None if force else _current(out, inputs.digest)
        rebuilt = manifest is None
        if rebuilt:
            kernel_file, kernel, initrd, root_entries, manifest = assemble(cache, inputs)
            make_dirs(out)
            partial = out / (ROOT + ".partial")
            partial.unlink(missing_ok=True)
            guest_root.make_image(root_entries, partial)
            os.replace(partial, out / ROOT)
            _write(out / kernel_file, kernel)
            _write(out / INITRD, initrd)
            _write(out / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True).encode())
        _mark_current(cache, fl, out)
    return BuildResult(fl.name, inputs.digest, rebuilt, out / _kernel_file(manifest), out / INITRD,
                       manifest, time.monotonic() - started)


def _kernel_file(manifest: dict) -> str:
    """The kernel's file in an image directory (builders before 5 wrote only the bzImage)."""
    return manifest.get("kernel_file", "vmlinuz")


def image_paths(cache: Path = DEFAULT_CACHE, flavor: str = "cloud") -> tuple[Path, Path]:
    """(kernel, initramfs) of the last build, without checking inputs."""
    top = _flavor_dir(cache, FLAVORS[flavor])
    try:
        out = top / (top / "current").read_text().strip()
    except OSError:
        out = top / "none"
    try:
        manifest = json.loads((out / "manifest.json").read_bytes()) if out.name else None
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        raise FileNotFoundError(f"no {flavor} image in {cache}: run python -m crust.kata.image.build build")
    return out / _kernel_file(manifest), out / INITRD


def report(result: BuildResult) -> str:
    m = result.manifest
    inputs = m["inputs"]
    state = "built" if result.rebuilt else "up to date"
    lines = [f"crust kata image ({result.flavor}): {state} in {result.seconds:.1f}s, hash {result.digest[:16]}",
             (f"  kernel   {result.kernel} ({m['sizes'][result.kernel.name] / 2**20:.1f} MiB, "
              f"{m['kernel_release']}; {m.get('kernel_boot', 'bzImage')})"),
             f"  initrd   {result.initrd} ({m['sizes'][INITRD] / 2**20:.1f} MiB)",
             f"  root     {result.root} ({m['sizes'].get(ROOT, 0) / 2**20:.1f} MiB, read-only, virtio-pmem)",
             f"  modules  boot: {' '.join(m['boot_modules'])}; on first mount: "
             + "; ".join(f"{fs}: {' '.join(mods) or '-'}" for fs, mods in m["fs_modules"].items())
             + (f" (built in: {' '.join(m['builtin_modules'])})" if m["builtin_modules"] else ""),
             "  downloaded  " + ", ".join(f"{p} {v}" for p, v in inputs["downloads"].items()),
             "  from host   " + ", ".join(f"{p} {v}" for p, v in inputs["host_packages"].items())]
    if inputs.get("python"):
        stdlib = [f for f in inputs["host_files"] if f.startswith(PYTHON_STDLIB + "/") and f.endswith((".py", ".so"))]
        lines.append(f"  python   {PYTHON}: {len(stdlib)} standard library files, "
                     f"{len(inputs['python']['files'])} of crust and protobuf {inputs['python']['protobuf']}")
    if m.get("unresolved_softdeps"):
        lines.append(f"  warning: soft dependencies not found: {' '.join(m['unresolved_softdeps'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crust.kata.image.build",
                                     description="Build the crust microVM guest image from Debian packages.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or confirm up to date) the kernel and initramfs")
    b.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"cache directory (default {DEFAULT_CACHE})")
    b.add_argument("--flavor", choices=sorted(FLAVORS), default="cloud",
                   help="cloud: Debian's cloud kernel (default); generic: the full kernel, with 9p")
    b.add_argument("--force", action="store_true", help="rebuild even if the inputs did not change")
    b.add_argument("--json", action="store_true", help="print the manifest as JSON")
    args = parser.parse_args(argv)
    try:
        result = build(args.cache, args.flavor, args.force)
    except (CommandError, LookupError, RuntimeError, OSError) as exc:
        print(f"crust-kata: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"rebuilt": result.rebuilt, "kernel": str(result.kernel), "initrd": str(result.initrd),
                          "seconds": round(result.seconds, 2), **result.manifest}, indent=2, sort_keys=True))
    else:
        print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
