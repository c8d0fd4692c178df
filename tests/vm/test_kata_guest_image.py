"""What the microVM handler boots its VMs from, settled once per node: the
accelerator (`--accel auto`: a probe VM's verdict, kept for the next start;
probe VMs a killed handler left reaped; a QEMU that hangs before greeting
a timed-out probe) and the guest image (Debian's kernel decompressed to
boot at its PVH entry, the agent's Python importing from pycs compiled at
build, the package cache its inputs are read with, a directory per image
and the oldest beyond the limit removed).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from crust.kata.vmm import accel as kata_accel
from crust.kata.image import bzimage, packages
from crust.kata.image import build as kata_image
from crust.kata.vmm.qemu import Vm, VmConfig, qemu_pids_under
from tests.harness.daemons import wait_until
from tests.harness.guest_vm import guest_config


# The image cache the tests' VMs boot from (tests.harness.guest_vm.guest_config's).
CACHE = Path(os.environ.get("CRUST_TEST_KATA_CACHE") or kata_image.DEFAULT_CACHE)


# -- the accelerator ----------------------------------------------------------------------------


def test_auto_accelerator_picks_one_that_boots_and_keeps_the_verdict(tmp_path):
    config = guest_config()
    kernel, initrd = config.kernel, config.initrd
    cache, workdir = tmp_path / "cache", tmp_path / "probe"
    record_path = cache / kata_accel.RECORD_NAME

    chosen, reason = asyncio.run(kata_accel.choose("auto", config, cache, workdir))
    assert chosen in ("kvm", "tcg"), (chosen, reason)
    assert not workdir.exists() and not qemu_pids_under(tmp_path)  # the probe VM is gone
    if kata_accel.KVM_DEVICE.exists():
        assert "probe VM" in reason, reason
        record = json.loads(record_path.read_text())
        assert (record["key"], record["accel"], record["reason"]) == (kata_accel.probe_key(config), chosen, reason)
        assert stat.S_IMODE(record_path.stat().st_mode) == 0o644
        # A restart on the same node takes the kept verdict: no probe.
        again, again_reason = asyncio.run(kata_accel.choose("auto", config, cache, workdir))
        assert again == chosen and again_reason.startswith(reason + " (probed "), again_reason
        # A verdict about another kernel, QEMU or /dev/kvm is not taken.
        record_path.write_text(json.dumps({**record, "key": "0" * 64, "accel": "nonsense"}))
        third, third_reason = asyncio.run(kata_accel.choose("auto", config, cache, workdir))
        assert third == chosen and "(probed " not in third_reason
        assert json.loads(record_path.read_text())["key"] == kata_accel.probe_key(config)
    else:
        assert chosen == "tcg" and "does not exist" in reason and not record_path.exists()

    # What auto chose really runs the guest.
    async def boot() -> float:
        vm = Vm("accel-check", tmp_path / "vm", VmConfig(kernel=kernel, initrd=initrd, accel=chosen))
        try:
            return await vm.start(ready_timeout=120)
        finally:
            await vm.kill()
    assert asyncio.run(boot()) > 0
    # Explicit choices are taken as given; anything else is refused.
    assert asyncio.run(kata_accel.choose("tcg", config, cache, workdir)) == ("tcg", "chosen by --accel")
    with pytest.raises(ValueError, match="'fast'"):
        asyncio.run(kata_accel.choose("fast", config, cache, workdir))


def test_probe_vms_left_by_a_killed_handler_are_reaped_and_nothing_else(tmp_path):
    # Stand-ins that look like QEMU to /proc (argv[0] and a socket path),
    # one in this handler's probe directory and one in a neighbour's.
    def qemu_lookalike(workdir: Path) -> subprocess.Popen:
        return subprocess.Popen(["qemu-system-x86_64", "-c", "import time; time.sleep(120)", "-name",
                                 "crust-accel-probe-1", f"{workdir}/agent.sock"], executable=sys.executable)
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe-of-another").mkdir()
    ours = qemu_lookalike(tmp_path / "probe")
    other = qemu_lookalike(tmp_path / "probe-of-another")
    try:
        wait_until(lambda: sorted(qemu_pids_under(tmp_path)) == sorted([ours.pid, other.pid]),
                   timeout=10, what="both processes to start")
        assert kata_accel.reap_leftover_probes(tmp_path / "probe") == [ours.pid]
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in (ours, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_qemu_that_hangs_before_greeting_is_a_timed_out_probe_not_a_crash(tmp_path):
    """A QEMU that creates its QMP socket and then hangs (KVM under nested
    virtualisation can stop it before its main loop): the VM start fails as
    hung, the probe's verdict is the retryable "did not answer", and the
    stand-in is killed."""
    fake = tmp_path / "hanging-qemu"
    fake.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import socket, sys, time
        path = sys.argv[sys.argv.index("-qmp") + 1].removeprefix("unix:").split(",")[0]
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(4)   # connections are taken by the kernel; nobody greets
        time.sleep(120)
        """))
    fake.chmod(0o755)
    config = VmConfig(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd", qemu_binary=str(fake))
    config.root_image.write_bytes(b"")   # the VM starts only with its root image there
    workdir = tmp_path / "probe"

    started = time.monotonic()
    works, reason, definite = asyncio.run(kata_accel.probe_kvm(config, workdir, timeout=10))
    assert (works, definite) == (False, False) and "did not answer within 10s" in reason, reason
    assert time.monotonic() - started < 40
    leftover = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True).stdout.split()
    assert leftover == [], "the hung stand-in was not killed"


# -- the guest image cache ----------------------------------------------------------------------


def test_the_guest_kernel_is_built_uncompressed_and_boots_at_its_pvh_entry():
    """Debian's cloud kernel, decompressed once at build time: every VM
    starts at the kernel's PVH entry, not in the bzImage's decompressor."""
    built = kata_image.build(CACHE)
    assert built.kernel.name == "vmlinux", built.manifest.get("kernel_boot")
    assert built.manifest["kernel_boot"].startswith("pvh"), built.manifest["kernel_boot"]
    assert bzimage.pvh_entry(built.kernel.read_bytes()) is not None
    assert built.kernel.stat().st_size == built.manifest["sizes"]["vmlinux"]
    assert kata_image.image_paths(CACHE) == (built.kernel, built.initrd)


def test_the_guest_image_holds_python_and_the_agent_imports_from_pycs_compiled_at_build(tmp_path):
    """The Python agent's interpreter (Debian's python3.11), the standard
    library modules it imports and nothing of ssl, the protobuf runtime and
    crust's own modules: in the guest root's file tree (chrooted), the agent
    imports from the .pyc files the builder compiled, unchecked-hash, so
    nothing is compiled or written there. Every file is a Debian package's
    but crust's own and the protobuf runtime's the manifest names."""
    import google.protobuf

    built = kata_image.build(CACHE)
    tree = tmp_path / "tree"
    tree.mkdir()
    # The guest's root image, read without mounting it (debugfs, e2fsprogs).
    subprocess.run(["debugfs", "-R", f"rdump / {tree}", str(built.root)], check=True, capture_output=True)
    python = built.manifest["inputs"]["python"]
    assert python["protobuf"] == google.protobuf.__version__
    assert (tree / "usr/bin/python3.11").is_file() and (tree / "usr/lib/python3.11/asyncio/base_events.py").is_file()
    assert not list(tree.rglob("ssl.py")) and not list(tree.rglob("_ssl.*.so"))
    assert {"/usr/lib/crust/python/crust/guest/__main__.py", "/usr/lib/crust/python/crust/api/agent_pb2.py",
            "/usr/lib/crust/python/google/protobuf/descriptor_pool.py"} <= set(python["files"])
    # Every source has its pyc, hash-based and never checked against it (flags 0b01).
    sources = {p.relative_to(tree) for p in tree.rglob("*.py")}
    compiled = {p.relative_to(tree) for p in tree.rglob("*.pyc")}
    assert compiled == {s.parent / "__pycache__" / f"{s.stem}.cpython-311.pyc" for s in sources}
    assert {int.from_bytes((tree / c).read_bytes()[4:8], "little") for c in compiled} == {0b01}

    def chrooted(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([shutil.which("chroot"), str(tree), "/usr/bin/python3.11", "-S", *argv], capture_output=True,
                              text=True, timeout=120, env={"PYTHONPATH": "/usr/lib/crust/python"})
    before = {p: p.stat().st_mtime_ns for p in tree.rglob("*")}
    done = chrooted("-c", "import sys, crust.guest.agent; print([m for m in ('ssl', '_ssl') if m in sys.modules])")
    assert (done.returncode, done.stdout, done.stderr) == (0, "[]\n", ""), done
    done = chrooted("-m", "crust.guest", "--help")       # as /init runs it
    assert done.returncode == 0 and done.stdout.startswith("usage: python3 -m crust.guest"), done
    assert {p: p.stat().st_mtime_ns for p in tree.rglob("*")} == before

    # Owners: what the builder makes or takes from its downloads, the
    # listed Python files, and the host's files, each a Debian package's.
    release = built.manifest["kernel_release"]
    extracted = CACHE / "extract"
    kernel = extracted / f"{built.manifest['inputs']['kernel_package']}_"
    own = {"init", "etc/crust/image", "etc/passwd", "etc/group", f"lib/modules/{release}/modules.dep",
           *kata_image.GUEST_FILES, *kata_image.GUEST_PROGRAMS}
    from_host = []
    for path in sorted(p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = str(path.relative_to(tree))
        if rel in own or rel.startswith("etc/crust/modules"):
            continue
        if rel.endswith(".pyc"):
            assert (path.parent.parent / (path.name.split(".")[0] + ".py")).is_file(), rel
        elif "/" + rel in python["files"]:
            assert rel.startswith("usr/lib/crust/python/"), rel
        elif rel.startswith("lib/modules/"):
            assert any((d / rel).is_file() for d in extracted.glob(glob.escape(kernel.name) + "*")), rel
        elif rel == "bin/busybox":
            assert any((d / rel).is_file() for d in extracted.glob("busybox-static_*")), rel
        elif rel.startswith("sbin/"):      # a tool, wherever its package put it on the host
            from_host.append(shutil.which(path.name, path=kata_image.SBIN_PATH))
        else:
            from_host.append("/" + rel)
    assert "/usr/bin/python3.11" in from_host
    assert packages.owners(from_host)["/usr/bin/python3.11"][0] == "python3.11-minimal"


def test_apt_cache_keeps_its_package_cache_in_the_image_cache(tmp_path):
    """The inputs are read with a package cache of crust's own (Debian's
    images keep none), built once and then reused: the same answers."""
    options = packages.apt_cache_options(tmp_path)
    first = kata_image.collect_inputs(kata_image.FLAVORS["cloud"], options)
    made = tmp_path / "apt-pkgcache.bin"
    assert made.is_file() and made.stat().st_size > 0
    stamp = made.stat().st_mtime_ns
    again = kata_image.collect_inputs(kata_image.FLAVORS["cloud"], options)
    assert again.digest == first.digest and made.stat().st_mtime_ns == stamp
    assert first.digest == kata_image.collect_inputs(kata_image.FLAVORS["cloud"]).digest


def test_each_image_keeps_its_own_directory_and_the_oldest_beyond_the_limit_go(tmp_path):
    """Two releases (or checkouts) on one node each boot the image they
    checked: a build of another never overwrites it."""
    flavor = kata_image.FLAVORS["cloud"]
    top = tmp_path / "images" / "cloud"
    made = []
    for n in range(kata_image.KEEP_IMAGES + 2):
        out = kata_image._output_dir(tmp_path, flavor, f"{n:02d}" * 32)
        out.mkdir(parents=True)
        for name in ("vmlinuz", kata_image.INITRD):
            (out / name).write_bytes(f"{name} {n}".encode())
        (out / "manifest.json").write_text("{}")
        os.utime(out / "manifest.json", (1000 + n, 1000 + n))
        made.append(out)
    (top / "vmlinuz").write_text("the one-image layout")
    # The second image confirmed again (its handler restarted): it becomes current and newest.
    kata_image._mark_current(tmp_path, flavor, made[1])
    assert kata_image.image_paths(tmp_path) == (made[1] / "vmlinuz", made[1] / kata_image.INITRD)
    kept = sorted(d.name for d in top.iterdir() if d.is_dir())
    assert kept == sorted(d.name for d in [made[1], *made[-(kata_image.KEEP_IMAGES - 1):]])
    assert (made[1] / "vmlinuz").read_bytes() == b"vmlinuz 1"
    assert not (top / "vmlinuz").exists()
    with pytest.raises(FileNotFoundError):
        kata_image.image_paths(tmp_path / "elsewhere")
    # A build that decompressed the kernel (crust.kata.image.bzimage) names the file it boots.
    (made[1] / "manifest.json").write_text(json.dumps({"kernel_file": "vmlinux"}))
    assert kata_image.image_paths(tmp_path) == (made[1] / "vmlinux", made[1] / kata_image.INITRD)
