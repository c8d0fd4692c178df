"""Test harness for the CRI tests: a private containerd (crust.kubelet.containerd)
with the tiny busybox image imported, and checks that it left nothing behind."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from crust.kubelet import image as images
from crust.kubelet.containerd import CGROUP_FS, SHIM_SOCKETS, Containerd
from crust.sys import mount as sysmount


@contextlib.contextmanager
def private_containerd(runtimes: dict[str, str] | None = None, env: dict[str, str] | None = None,
                       ) -> Iterator[tuple[Containerd, images.Image]]:
    """A started containerd with the busybox image (also its pause image);
    closed and checked clean afterwards, whatever the test did."""
    directory = Path(tempfile.mkdtemp(prefix="crust-cri-"))
    image = images.build(directory / "images")
    containerd = Containerd(directory / "containerd", sandbox_image=image.name,
                            runtimes=runtimes or {"runc": ""}, env=env or {})
    try:
        containerd.start()
        containerd.import_image(image)
        yield containerd, image
    finally:
        containerd.close()
        shutil.rmtree(directory, ignore_errors=True)
    leftovers = leftovers_of(containerd)
    assert not leftovers, f"the private containerd left: {leftovers}"


def processes_naming(text: str) -> list[str]:
    """Processes whose command line holds text (a path of ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in argv:
            command = argv.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {command[:200]}")
    return found


def leftovers_of(containerd: Containerd) -> list[str]:
    """What a closed containerd left: its directory, processes naming it,
    mounts below it, cgroups below its cgroup root, its shim sockets."""
    found = []
    if containerd.directory.exists():
        found.append(f"directory {containerd.directory}")
    found += processes_naming(str(containerd.directory))
    prefix = str(containerd.directory) + "/"
    found += [m.mount_point for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]
    name = containerd.cgroup_root.strip("/")
    found += [str(h / name) for h in CGROUP_FS.iterdir() if (h / name).exists()] if CGROUP_FS.is_dir() else []
    if containerd._made_shim_dir and SHIM_SOCKETS.exists():
        sockets = os.listdir(SHIM_SOCKETS / "s") if (SHIM_SOCKETS / "s").is_dir() else []
        if not sockets:
            found.append(f"{SHIM_SOCKETS} (made for our shims, left empty)")
    return found
