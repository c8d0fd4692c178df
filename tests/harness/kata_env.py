"""The microVM handler on the real stack, for the tests and benchmarks that
drive it: real driver -> shim -> proxy processes and a real `crust kata
handler` registered with the proxy (kata_env; the kenv fixtures: on each
disk bus, with short leases), and what they check the host and the guest
with: which process holds or mounts a volume's device, the guest's own
`df` (printed on its console) against NodeGetVolumeStats, a formatted loop
device as a Kata-style CSI driver has it at NodePublishVolume.

The guest image must exist (`./run tests` builds it first); a handler that
finds it missing or stale builds it before registering.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2, handler_pb2_grpc
from tests.harness.handler_env import Env, namespaces_mounting
from tests.harness.daemons import wait_until

Usage = csi_pb2.VolumeUsage


def holds_device(pid: int, majmin: tuple[int, int]) -> bool:
    """Whether the process has the block device open (QEMU's virtio-blk backend)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            st = os.stat(fd)
        except OSError:
            continue
        if stat.S_ISBLK(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == majmin:
            return True
    return False


def anyone_mounts(majmin: tuple[int, int]) -> list[int]:
    """Every process on the host whose mount table has this device: none may."""
    return namespaces_mounting(majmin)


DF_SCRIPT = ('echo "df-bytes: $(df -P -B1 {path} | tail -n 1)" && '
             'echo "df-inodes: $(df -P -i {path} | tail -n 1)"')


def guest_df(console: str, tag: str = "") -> dict[str, int]:
    """The last df lines a guest process printed on the console."""
    found: dict[str, int] = {}
    for line in console.splitlines():
        for key, names in ((f"{tag}df-bytes:", ("bytes_total", "bytes_used", "bytes_available")),
                           (f"{tag}df-inodes:", ("inodes_total", "inodes_used", "inodes_available"))):
            if key in line:
                fields = line.split(key, 1)[1].split()
                found.update(zip(names, map(int, fields[1:4])))
    return found


def usage_dict(usage) -> dict[str, int]:
    by_unit = {u.unit: u for u in usage}
    b, i = by_unit[Usage.BYTES], by_unit[Usage.INODES]
    return {"bytes_total": b.total, "bytes_used": b.used, "bytes_available": b.available,
            "inodes_total": i.total, "inodes_used": i.used, "inodes_available": i.available}


class KataEnv(Env):
    """Env (tests/harness/handler_env.py) with the microVM handler in place of the
    mount-namespace one; Kata's direct-volume directory is the proxy's
    mirror directory, as on a node where both are in use."""

    def console(self, sandbox_id: str) -> str:
        path = self.handler.state_dir / "run" / sandbox_id / "console.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_console(self, sandbox_id: str, text: str, timeout: float = 60) -> str:
        return wait_until(lambda: text in self.console(sandbox_id) and self.console(sandbox_id), timeout=timeout,
                          interval=0.1, what=f"{text!r} on the console of {sandbox_id}")

    def stats(self, v) -> csi_pb2.NodeGetVolumeStatsResponse:
        return self.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=v.volume_id, volume_path=str(v.target)), timeout=60)

    def expand(self, v, size: int) -> int:
        self.proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=60)
        return self.proxy.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
            volume_id=v.volume_id, volume_path=str(v.target),
            capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=180).capacity_bytes

    def handler_stub(self) -> tuple[grpc.Channel, handler_pb2_grpc.HandlerStub]:
        channel = grpc.insecure_channel(f"unix://{self.handler.socket}")
        return channel, handler_pb2_grpc.HandlerStub(channel)

    def direct_volume(self, verb: str, *args: str, cli: list[str] | None = None,
                      env: dict | None = None) -> subprocess.CompletedProcess:
        argv = cli or [sys.executable, "-m", "crust", "kata", "direct-volume"]
        extra = [] if env else ["--kata-dir", str(self.kata_dir), "--handler-endpoint",
                                f"unix://{self.handler.socket}"]
        return subprocess.run([*argv, verb, *args, *extra], capture_output=True, text=True, timeout=240,
                              env={**os.environ, **(env or {})})

    @property
    def kata_dir(self) -> Path:
        return self.proxy.kata_dir


def kata_env(root, proxy_extra=(), handler_extra=()):
    """driver -> shim -> proxy, and `crust kata handler` registered with it;
    its sandboxes deleted at the end. Root.close() then stops the daemons and
    kills this root's QEMU processes. CRUST_TEST_KATA_CACHE names another
    guest image cache than the default (a tree whose guest agent differs
    from the one other trees build into the shared cache)."""
    cache = os.environ.get("CRUST_TEST_KATA_CACHE")
    e = KataEnv(root, proxy_extra=proxy_extra, start_handler=False, name="kata", endpoint_name="kata.sock",
                command=("kata", "handler"),
                extra=["--kata-dir", str(root.path / "kata"), *(["--cache", cache] if cache else []),
                       *handler_extra])
    e.handler.start(timeout=900)  # builds the guest image if it is missing
    try:
        yield e
    finally:
        e.delete_sandboxes()


@pytest.fixture
def kenv(root):
    yield from kata_env(root)


@pytest.fixture
def kenv_short_lease(root):
    """With 3 s leases: a killed handler is seen gone quickly."""
    yield from kata_env(root, proxy_extra=["--lease-seconds", "3"])


DISK_BUSES = ["virtio-blk", "virtio-scsi"]


@pytest.fixture(params=DISK_BUSES)
def kenv_bus(root, request):
    """kenv, its handler's volumes on each disk bus in turn."""
    yield from kata_env(root, handler_extra=["--disk-bus", request.param])


@pytest.fixture(params=DISK_BUSES)
def kenv_bus_short_lease(root, request):
    yield from kata_env(root, proxy_extra=["--lease-seconds", "3"], handler_extra=["--disk-bus", request.param])


def make_loop_volume(root: Path, name: str, size: int, fs: str) -> tuple[Path, str]:
    """What a Kata-style CSI driver has at NodePublishVolume: a formatted device."""
    backing = root / f"{name}.img"
    with open(backing, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs." + fs, "-q", str(backing)] if fs == "ext4" else ["mkfs.xfs", "-q", str(backing)],
                   check=True, capture_output=True)
    device = subprocess.run(["losetup", "--find", "--show", str(backing)], check=True, capture_output=True,
                            text=True).stdout.strip()
    return backing, device
