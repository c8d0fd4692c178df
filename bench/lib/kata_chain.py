"""The chain bench/microvm/kata_bench.py's parts 1 to 3 measure: crust driver ->
crust shim -> crust proxy with the microVM handler (`crust kata handler`)
registered, a deferred volume published through the proxy and sandboxes
(microVMs) run over it; taken down in order.

- KataChain: one deferred volume, the sandboxes run over it through the
  handler's SandboxControl service, and its expansion; closed by force
  after its teardown;
- kata_machine(): the machine description with Debian's release, QEMU's
  version and whether /dev/kvm exists (bench/microvm/luks_io.py too);
- run_sample(): a CPU sample of this run, which counts its QEMU processes.

The mount-namespace handler's chain is in harness_mountns_chain.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from bench.lib.benchlib import (
    cpu_sample,
    file_text,
    left_below,
    machine,
)
from bench.lib.stack import ProxyVolume, attempt, start_stack, write_bundle
from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc
from crust.kata.vmm.qemu import qemu_pids_under
from tests.harness.daemons import MIB, Root, mount_cap

# -- the microVM handler ----------------------------------------------------------------------------

VOLUME_MIB = 256
HANDLER_NAME = "kata"


def kata_machine() -> dict:
    """The shared machine description with Debian's release (after the
    kernel's), QEMU's version and whether /dev/kvm exists."""
    try:
        qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True,
                              timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        qemu = "unknown"
    info = machine(debian=file_text("/etc/debian_version"))
    info["python"] = info.pop("python")  # after "debian", where it stands in earlier results
    return {**info, "qemu": qemu, "kvm_device": os.path.exists("/dev/kvm")}


def run_sample(daemon_pids: list[int], directory: Path) -> Callable[[], dict]:
    """A CPU sample of this run: this script and the children it reaped, the
    daemons and what they reaped (e.g. QEMU of a deleted sandbox), and the
    live QEMU processes whose command line names directory."""
    return lambda: cpu_sample(daemon_pids, strays=lambda: qemu_pids_under(directory))


class KataChain:
    """driver -> shim -> proxy + kata handler, one deferred volume, sandboxes."""

    def __init__(self, root: Root, fs: str, accel: str):
        self.root = root
        self.fs = fs
        self.accel = accel
        self.cap = mount_cap(fs)
        self.volume: ProxyVolume | None = None
        self.sandbox_id = ""      # the running sandbox, if any
        self.handler_channel: grpc.Channel | None = None

    def up(self) -> None:
        self.driver, self.shim, self.proxy, self.handler = start_stack(
            self.root, name=HANDLER_NAME, endpoint_name="kata.sock", command=("kata", "handler"),
            extra=["--accel", self.accel, "--kata-dir", str(self.root.path / "kata-direct")],
            handler_timeout=900)  # the guest image is checked (maybe rebuilt) first
        self.handler_channel = grpc.insecure_channel(f"unix://{self.handler.socket}")
        self.control = handler_pb2_grpc.SandboxControlStub(self.handler_channel)
        self.handler_stub = handler_pb2_grpc.HandlerStub(self.handler_channel)
        self.volume = ProxyVolume.create(self.proxy, "kb-vol", "kb-pod", VOLUME_MIB * MIB, self.cap)
        self.volume.stage()
        self.device = self.volume.publish_deferred().device
        self.bundle = self.root.path / "bundle"
        write_bundle(self.bundle, self.volume.target, 3600)

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in (self.driver, self.shim, self.proxy, self.handler)]

    def run_sandbox(self, sandbox_id: str) -> tuple[float, handler_pb2.SandboxInfo]:
        """RunSandbox over the bundle: ms from the call to its return, and the sandbox."""
        # Recorded first: if the call is interrupted, the handler may still
        # be creating it, and the teardown deletes it (DeleteSandbox is idempotent).
        self.sandbox_id = sandbox_id
        t0 = time.perf_counter()
        rsp = self.control.RunSandbox(handler_pb2.RunSandboxRequest(bundle=str(self.bundle), sandbox_id=sandbox_id),
                                      timeout=300)
        ms = (time.perf_counter() - t0) * 1e3
        info = rsp.sandbox
        if not info.volumes or info.volumes[0].target_path != str(self.volume.target):
            raise RuntimeError(f"sandbox {sandbox_id} does not hold the volume: {info}")
        return ms, info

    def delete_sandbox(self) -> float:
        """DeleteSandbox of the running sandbox: ms from the call to its return."""
        t0 = time.perf_counter()
        self.control.DeleteSandbox(handler_pb2.DeleteSandboxRequest(sandbox_id=self.sandbox_id), timeout=300)
        self.sandbox_id = ""
        return (time.perf_counter() - t0) * 1e3

    def boot_seconds(self, sandbox_id: str) -> float | None:
        """The VM's boot time as crust.kata.vmm.qemu logged it in the handler's log."""
        pattern = re.compile(rf"vm crust-{re.escape(sandbox_id)}: agent ready ([0-9.]+)s after start")
        found = None
        for line in self.handler.log_path.read_text(errors="replace").splitlines():
            try:
                msg = json.loads(line).get("msg", "")
            except ValueError:
                msg = line
            m = pattern.search(msg)
            if m:
                found = float(m.group(1))
        return found

    def stats_bytes(self) -> csi_pb2.VolumeUsage:
        """The volume's byte usage as the guest reports it, through the proxy."""
        rsp = self.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=self.volume.volume_id, volume_path=str(self.volume.target)), timeout=60)
        if rsp.volume_condition.abnormal:
            raise RuntimeError(f"volume condition abnormal: {rsp.volume_condition.message}")
        return next(u for u in rsp.usage if u.unit == csi_pb2.VolumeUsage.BYTES)

    def controller_expand(self, new_size: int) -> csi_pb2.ControllerExpandVolumeResponse:
        return self.proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=self.volume.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=new_size)),
            timeout=120)

    def node_expand(self, new_size: int) -> csi_pb2.NodeExpandVolumeResponse:
        return self.proxy.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(
            volume_id=self.volume.volume_id, volume_path=str(self.volume.target),
            capacity_range=csi_pb2.CapacityRange(required_bytes=new_size)), timeout=300)

    def wait_for_guest_size(self, before: int, growth: float) -> tuple[int, int]:
        """Ask for the volume's stats every 50 ms until the guest's file system
        is growth bytes larger than before (60 s at most): its size then, and
        how many calls that took."""
        polls, deadline = 0, time.monotonic() + 60
        while True:
            polls += 1
            total = self.stats_bytes().total
            if total >= before + growth:
                return total, polls
            if time.monotonic() > deadline:
                raise RuntimeError(f"the guest still reports {total} bytes 60 s after NodeExpandVolume "
                                   f"(before: {before})")
            time.sleep(0.05)

    def teardown(self) -> list[str]:
        """Undo up() through the chain; returns the errors (forced cleanup follows)."""
        problems = []
        handler = getattr(self, "handler", None)
        if handler is None or handler.proc is None or handler.proc.poll() is not None:
            if self.sandbox_id or (self.volume is not None and self.volume.published):
                problems.append("the handler is not running; forced cleanup only")
            return problems
        if self.sandbox_id:
            attempt(problems, "sandbox delete", self.delete_sandbox)
        if self.volume is not None and self.volume.take_down(problems):
            self.volume = None
        if self.handler_channel is not None:
            self.handler_channel.close()
            self.handler_channel = None
        return problems

    def close(self) -> bool:
        """teardown(), then Root.close() (daemons stopped, what is below the
        root unmounted, detached, removed); prints the teardown errors and
        what is left, on stderr. True if nothing is left."""
        problems = self.teardown()
        path = self.root.path
        prefix = str(path.resolve()) + "/"
        self.root.close()
        left_mounts, left_loops = left_below(prefix)
        if problems:
            print(f"cleanup: teardown errors (forced cleanup followed): {problems[:3]}", file=sys.stderr)
        if left_mounts or left_loops or qemu_pids_under(path) or path.exists():
            print(f"cleanup INCOMPLETE: mounts {left_mounts[:5]}, loop devices {left_loops[:5]}, "
                  f"root {path}", file=sys.stderr)
            return False
        return True
