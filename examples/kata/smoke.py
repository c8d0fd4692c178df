"""By-hand smoke test of the microVM foundation (root; not part of the suite).

    python examples/kata/smoke.py [--fs ext4 xfs] [--flavor cloud|generic] [--accel tcg|kvm]

For each file system: a sparse file on a loop device, formatted on the host
(as the shim does at stage time: mkfs only, no mount), a VM booted, the loop device
hot-plugged as virtio-blk, mounted by the agent with an fsGroup, a file
written from inside, stats, an online grow (file, losetup -c, block_resize,
the agent's GrowVolume), unmount, unplug, poweroff. Then, on the host and without mounting: the data
is on the device (debugfs for ext4, a raw scan for xfs) and fsck finds the
grown file system clean. Meanwhile the host's mountinfo is sampled: the loop
device must never appear in it. Everything created is released in finally.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crust.api import agent_pb2
from crust.kata.agent import volume_calls
from crust.kata.image import build
from crust.kata.vmm.qemu import Vm, VmConfig
from crust.sys import loop

MiB = 2**20
SIZES = {"ext4": (64 * MiB, 96 * MiB), "xfs": (320 * MiB, 400 * MiB)}   # mkfs.xfs wants >= 300 MiB
TARGET = "/run/crust/volumes/smoke"


async def volume_stats(client) -> dict:
    answer = await client.call("VolumeStats", agent_pb2.VolumeStatsRequest(
        volume_id=volume_calls.volume_id(TARGET)), timeout=30)
    return {"total": answer.total_bytes, "free": answer.free_bytes, "devsize": answer.device_bytes,
            "readonly": answer.readonly}


async def guest_sh(client, script: str) -> int:
    """A guest process (no container), waited for; its exit code."""
    process = {"args": ["/bin/sh", "-c", script], "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "cwd": "/"}
    await client.call("ExecProcess", agent_pb2.ExecProcessRequest(exec_id="smoke", process=json.dumps(
        process).encode()), timeout=60)
    answer = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id="smoke"), timeout=120)
    await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id="smoke"), timeout=30)
    return answer.exit_code


def sh(*argv: str, timeout: float = 120) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=timeout).stdout


class MountWatch:
    """Samples /proc/self/mountinfo while the VM runs: is the device there?"""

    def __init__(self, device: str):
        st = os.stat(device)
        self.majmin = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        self.device = device
        self.samples = 0
        self.seen: list[str] = []

    async def run(self) -> None:
        while True:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    fields = line.split()
                    if fields[2] == self.majmin or self.device in fields:
                        self.seen.append(line.strip())
            self.samples += 1
            await asyncio.sleep(0.05)


async def one(fs: str, kernel: Path, initrd: Path, accel: str) -> dict:
    steps: dict[str, float] = {}
    t = time.monotonic()

    def step(name: str) -> None:
        nonlocal t
        steps[name] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        print(f"  [{fs}] {name}: {steps[name]:.2f}s", flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="crust-kata-"))
    device = None
    vm = None
    watch_task = None
    token = f"crust-smoke-{secrets.token_hex(8)}"
    small, big = SIZES[fs]
    result: dict = {"fs": fs}
    try:
        backing = workdir / "volume.img"
        with open(backing, "wb") as f:
            f.truncate(small)
        device = await loop.attach(backing)
        sh(*(["mkfs.ext4", "-q", "-F"] if fs == "ext4" else ["mkfs.xfs", "-q", "-f"]), device)
        step("loop device + host mkfs")
        watch = MountWatch(device)
        watch_task = asyncio.create_task(watch.run())

        vm = Vm(f"smoke-{fs}", workdir / "vm", VmConfig(kernel, initrd, accel=accel))
        result["boot_seconds"] = round(await vm.start(), 3)
        step("boot to agent ready")
        await vm.attach_disk(device, "vol-smoke")
        step("hotplug virtio-blk")
        client = await vm.port.ready()
        mounted = await volume_calls.mount(client, volume_calls.storage(
            "vol-smoke", fs, [], False, TARGET, (1234, "OnRootMismatch")))
        result["guest_device"], result["fsgroup_walked"] = mounted.device, mounted.fs_group_walked
        step("agent mount with fsGroup")
        result["exec_exit"] = await guest_sh(client, f"echo {token} > {TARGET}/file && mkdir -p {TARGET}/dir && sync")
        step("exec write")
        before = await volume_stats(client)
        step("stats")

        with open(backing, "r+b") as f:
            f.truncate(big)
        await loop.refresh_capacity(device)
        await vm.resize_disk("vol-smoke")
        for _ in range(100):   # the guest learns the new capacity from a config interrupt
            if (await volume_stats(client))["devsize"] == big:
                break
            await asyncio.sleep(0.05)
        step("grow file + losetup -c + block_resize")
        result["grow_answer"] = await volume_calls.grow(client, TARGET)
        after = await volume_stats(client)
        step("agent grow + stats")
        result["stats_before"], result["stats_after"] = before, after

        result["unmounted"] = await volume_calls.unmount(client, TARGET)
        await vm.detach_disk("vol-smoke")
        step("umount + unplug")
        result["qemu_exit"] = await vm.stop()
        step("poweroff")
        watch_task.cancel()
        result["mountinfo_samples"] = watch.samples
        result["host_mounted"] = watch.seen

        if fs == "ext4":
            result["host_read"] = sh("debugfs", "-R", "cat /file", device).strip()
            sh("e2fsck", "-fn", device)
        else:
            with open(device, "rb") as f:
                result["host_read"] = token if token.encode() in f.read() else ""
            sh("xfs_repair", "-n", device)
        result["host_fsck_clean"] = True
        step("host check (no mount): data + fsck")
        result["ok"] = (result["exec_exit"] == 0 and result["host_read"] == token and not watch.seen
                        and after["devsize"] == big and after["total"] > before["total"]
                        and result["fsgroup_walked"])
    finally:
        if watch_task is not None:
            watch_task.cancel()
        if vm is not None and vm.alive():
            await vm.kill()
        if device is not None:
            await loop.detach(device)
        shutil.rmtree(workdir, ignore_errors=True)
    result["steps"] = steps
    return result


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fs", nargs="+", default=["ext4", "xfs"], choices=["ext4", "xfs"])
    p.add_argument("--flavor", default="cloud", choices=sorted(build.FLAVORS))
    p.add_argument("--accel", default="tcg", choices=["tcg", "kvm"])
    p.add_argument("--cache", type=Path, default=build.DEFAULT_CACHE)
    args = p.parse_args()
    if shutil.which("qemu-system-x86_64") is None:
        sh("apt-get", "install", "-y", "--no-install-recommends", "qemu-system-x86", timeout=900)
    built = await asyncio.to_thread(build.build, args.cache, args.flavor)
    print(build.report(built), flush=True)
    results = []
    for fs in args.fs:
        results.append(await one(fs, built.kernel, built.initrd, args.accel))
    print(json.dumps(results, indent=2))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
