#!/usr/bin/env python3
"""What the guest's OCI runtime (crun) costs in a microVM, and which parts
of a container's spec add to it.

One VM of the current guest image (crust.kata.vmm.qemu.Vm, the handler's path)
runs, through its agent, `crun run` of a container whose process is
/bin/true and whose root is the guest's own root bound read-only, with
the spec a CRI container gets (PID, IPC, UTS and mount namespaces; /proc,
/dev, /dev/pts, /dev/mqueue, /sys, /dev/shm; masked and read-only paths;
a cgroup with a device rule; capabilities, no new privileges) and with one
part taken out at a time; beside them `crun --version` (the binary's start
alone), `sh -c true` (a fork and exec of busybox), the same container
made with no OCI runtime by bench/microvm/guest_maker.c (compiled as the image's
own programs are: the kernel's part of the start), and crun's run with the
guest's address randomization off (as the agent starts it). The variants take
turns, their order rotated from round to round; times are the guest's
/proc/uptime around each run (10 ms steps), so they include no hop to the
host.

    .venv/bin/python bench/microvm/guest_crun.py [--rounds 5] [--accel tcg|kvm] [--json OUT.json]

Median, min and max per variant, the machine and its load before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import copy
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.kata.image import build as kata_image
from crust.kata.vmm.qemu import Vm, VmConfig  # noqa: E402
from tests.harness.guest_vm import PORT_WAIT, run_script  # noqa: E402

CAPABILITIES = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
                "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
                "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"]
MASKED = ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
          "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap"]
READ_ONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
# The spec a CRI container's comes down to in the guest (crust.kata.pod.container_spec).
FULL_SPEC = {
    "ociVersion": "1.0.2",
    "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["/bin/true"], "cwd": "/",
                "env": ["PATH=/sbin:/bin:/usr/sbin:/usr/bin"],
                "capabilities": {k: CAPABILITIES for k in ("bounding", "effective", "permitted")},
                "noNewPrivileges": True},
    "root": {"path": "rootfs", "readonly": True},
    "hostname": "bench",
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}],
    "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
              "cgroupsPath": "/crust-bench/ctr", "resources": {"devices": [{"allow": False, "access": "rwm"}]},
              "maskedPaths": MASKED, "readonlyPaths": READ_ONLY},
}


def spec_without(part: str) -> dict:
    spec = copy.deepcopy(FULL_SPEC)
    linux = spec["linux"]
    if part in ("masked and read-only paths", "all of these"):
        del linux["maskedPaths"], linux["readonlyPaths"]
    if part in ("cgroup", "all of these"):
        del linux["cgroupsPath"]
        linux["resources"] = {}
    if part in ("mounts but /proc", "all of these"):
        spec["mounts"] = spec["mounts"][:1]
    if part in ("capabilities and no_new_privs", "all of these"):
        del spec["process"]["capabilities"]
        spec["process"]["noNewPrivileges"] = False
    if part == "read-only root":
        spec["root"]["readonly"] = False
    return spec


PARTS = ["", "masked and read-only paths", "cgroup", "mounts but /proc", "capabilities and no_new_privs",
         "read-only root", "all of these"]
MAKER_SOURCE = Path(__file__).resolve().parent / "guest_maker.c"
MAKER = "/tmp/b/guest_maker"
NO_RUNTIME = "no OCI runtime (bench/microvm/guest_maker.c), the full spec's parts"
# The guest's address randomization off around the run (as the agent starts crun: crust.sys.personality).
FIXED = "crun run, full spec, at fixed addresses"
# A script's argument holds at most 128 KiB (MAX_ARG_STRLEN): the maker goes in pieces.
PIECE = 96 * 1024
REPEAT = 10   # `crun --version` and `sh -c true` run this many times in a row (10 ms steps)


async def sh(vm: Vm, name: str, script: str) -> str:
    """A script's stdout in the guest, run by its agent on its port (its
    exit code must be 0)."""
    client = await vm.port.ready(wait=PORT_WAIT)
    if client is None:
        raise RuntimeError(f"vm {vm.name}: its guest's agent did not answer on its port")
    code, out, err = await run_script(client, name, script, timeout=120)
    if code != 0:
        raise RuntimeError(f"{name} exited {code}: {err[:4096]!r}")
    return out.decode()


def compile_maker(workdir: Path) -> bytes:
    """bench/microvm/guest_maker.c built as the image's own programs are."""
    out = workdir / "guest_maker"
    subprocess.run(["cc", *kata_image.GUEST_CFLAGS, "-o", str(out), str(MAKER_SOURCE)], check=True)
    return out.read_bytes()


async def put_maker(vm: Vm, program: bytes) -> None:
    encoded = base64.b64encode(gzip.compress(program)).decode()
    for number, start in enumerate(range(0, len(encoded), PIECE)):
        await sh(vm, f"maker-{number}", f"printf %s '{encoded[start:start + PIECE]}' >> {MAKER}.gz.b64")
    await sh(vm, "maker", f"base64 -d {MAKER}.gz.b64 | gunzip > {MAKER} && chmod 755 {MAKER}")


async def measure(workdir: Path, accel: str, rounds: int) -> dict[str, list[float]]:
    built = kata_image.build()
    workdir.mkdir(parents=True, exist_ok=True)
    maker = compile_maker(workdir)
    vm = Vm("crust-crun-bench", workdir, VmConfig(kernel=built.kernel, initrd=built.initrd, accel=accel))
    samples: dict[str, list[float]] = {}
    try:
        await vm.start(ready_timeout=120)
        await sh(vm, "setup", "mkdir -p /tmp/b/rootfs /sys/fs/cgroup/crust-bench && mount --bind / /tmp/b/rootfs"
                              " && mount -o remount,bind,ro /tmp/b/rootfs")
        await put_maker(vm, maker)
        runs = 0
        for turn in range(rounds):
            for part in benchlib.rotated([*PARTS, NO_RUNTIME, FIXED], turn):
                runs += 1
                times = 1
                if part == FIXED:
                    name = part
                    spec = json.dumps(spec_without(""))
                    prepare = (f"cat > /tmp/b/config.json <<'SPEC'\n{spec}\nSPEC\n"
                               "echo 0 > /proc/sys/kernel/randomize_va_space")
                    run = (f"crun --root /run/crust-bench run --bundle /tmp/b c{runs} >/dev/null; "
                           "ran=$?; echo 2 > /proc/sys/kernel/randomize_va_space; [ $ran = 0 ]")
                elif part == NO_RUNTIME:
                    # Ten in a row: one is about as long as the clock's step.
                    name, times = part, REPEAT
                    loop = " ".join(str(n) for n in range(REPEAT))
                    prepare = "mkdir -p /sys/fs/cgroup/crust-maker"   # crun takes crust-bench away with its last
                    run = f"for n in {loop}; do {MAKER} /tmp/b/rootfs /sys/fs/cgroup/crust-maker c{runs}-$n || exit; done"
                else:
                    name = "crun run, full spec" if not part else f"crun run, without {part}"
                    spec = json.dumps(spec_without(part))
                    prepare = f"cat > /tmp/b/config.json <<'SPEC'\n{spec}\nSPEC"
                    run = f"crun --root /run/crust-bench run --bundle /tmp/b c{runs} >/dev/null"
                out = await sh(vm, f"r{runs}", f"{prepare}\nread a x < /proc/uptime\n{run} || exit\n"
                               "read b x < /proc/uptime\necho $a $b")
                start, end = map(float, out.split())
                samples.setdefault(name, []).append((end - start) * 1e3 / times)
            loop = " ".join(["x"] * REPEAT)
            out = await sh(vm, f"t{turn}", "read a x < /proc/uptime\n"
                                           f"for i in {loop}; do crun --version >/dev/null || exit; done\n"
                                           "read b x < /proc/uptime\n"
                                           f"for i in {loop}; do sh -c true || exit; done\n"
                                           "read c x < /proc/uptime\necho $a $b $c")
            a, b, c = map(float, out.split())
            samples.setdefault("crun --version", []).append((b - a) * 1e3 / REPEAT)
            samples.setdefault("sh -c true", []).append((c - b) * 1e3 / REPEAT)
    finally:
        await vm.kill()
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accel", choices=("tcg", "kvm"), default="tcg")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("guest_crun.py", "QEMU and the image cache"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("guest_crun", argv, benchlib.machine(), vm=True)
    base = Path(tempfile.mkdtemp(prefix="crust-crun-"))

    def body() -> None:
        results["load_before"] = benchlib.loadavg()
        samples = asyncio.run(measure(base / "vm", args.accel, args.rounds))
        results["load_after"] = benchlib.loadavg()
        results["accelerator"] = args.accel
        results["variants"] = benchlib.ms_rows(samples)
        print(f"in the guest, {args.accel}, median of {args.rounds} (min-max); "
              f"{benchlib.machine_summary(results['machine'])}")
        benchlib.print_ms_rows(results["variants"], 52)
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.vm_dir_cleanup(base), benchlib.report_failure, args.json, results)


if __name__ == "__main__":
    sys.exit(main())
