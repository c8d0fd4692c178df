"""The real stack and the volumes parts 1 and 2 of bench/csi/proxy_bench.py
measure (part 3's proxies are in harness_fleet.py), and the volumes of
bench/csi/hop_cost.py.

- RealStack: crust driver -> crust shim -> crust proxy;
- StatsVolume (part 1, and hop_cost.py's chains): an ext4 volume published
  on the host through the proxy, as kubelet would, and taken down again
  (holders() says who keeps its loop device when DeleteVolume is refused);
- CreatedVolume (hop_cost.py's bare variant): a volume created on a driver
  and nothing more;
- StatsEntries (part 2): deferred volumes on the proxy's runtime socket,
  one claimed by a registered handler, the others naming a runtime-cli.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc

from bench.lib.benchlib import file_text
from bench.lib.fakes import (
    STATS_TOTAL,
    ServerProcess,
    fixed_stats,
    runtime_cli_python,
    runtime_cli_sh,
)
from bench.lib.stack import own_session, retry_failed_precondition
from crust.api import (
    csi_pb2,
    registry_pb2,
    registry_pb2_grpc,
    runtime_pb2,
    runtime_pb2_grpc,
)
from crust.contract.mountinfo import digest
from crust.sys import loop as sysloop
from tests.harness.daemons import MIB, DriverProcess, ProxyProcess, Root, ShimProcess, mount_cap

# -- parts 1 and 2: the real stack -----------------------------------------------------------


class RealStack:
    """crust driver -> crust shim -> crust proxy, in their own session, with
    part 1's volume and part 2's handler."""

    def __init__(self, root: Root):
        self.root = root
        self.processes: tuple[DriverProcess, ShimProcess, ProxyProcess] | None = None
        self.volume: StatsVolume | None = None

    def start(self) -> tuple[DriverProcess, ShimProcess, ProxyProcess]:
        with own_session():
            self.processes = self.root.stack()
        self.volume = StatsVolume(self.processes[0], self.processes[2])
        return self.processes

    def start_handler(self) -> ServerProcess:
        handler = ServerProcess("handler", self.root.path / "handler.sock")
        self.root.drivers.append(handler)
        return handler.start()

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes = None

    def tear_down(self) -> list[str]:
        """Part 1's volume taken down, if it exists and the whole stack still
        runs (else Root.close() alone releases it); the errors."""
        if self.processes is None or not self.volume.volume_id or \
                not all(p.proc is not None and p.proc.poll() is None for p in self.processes):
            return []
        return self.volume.tear_down()


# -- part 1: a volume published on the host -----------------------------------------------------


class StatsVolume:
    """An ext4 volume created on the driver, staged and published on the
    host (no deferral) through the proxy, as kubelet would; and how far it got."""

    def __init__(self, driver: DriverProcess, proxy: ProxyProcess):
        self.driver = driver
        self.proxy = proxy
        self.volume_id = ""
        self.staging: Path | None = None
        self.target: Path | None = None

    def set_up(self) -> None:
        cap = mount_cap("ext4")
        self.volume_id = self.driver.create("bench-proxy-stats", 64 * MIB, cap).volume_id
        staging = self.proxy.staging("pv-stats")
        target = self.proxy.target("pod-stats", "pv-stats")
        target.parent.mkdir(parents=True, exist_ok=True)  # kubelet makes the parent, the plugin the target
        self.proxy.stage(self.volume_id, staging, cap)
        self.staging = staging
        self.proxy.publish(self.volume_id, staging, target, cap)
        self.target = target

    def tear_down(self, timeout: float = 30) -> list[str]:
        """Unpublish, unstage, delete (whatever of it exists); errors are returned."""
        problems = []
        vid = self.volume_id
        if not vid:
            return problems
        steps = []
        if self.target is not None:
            steps.append(("unpublish", lambda: self.proxy.node.NodeUnpublishVolume(
                csi_pb2.NodeUnpublishVolumeRequest(volume_id=vid, target_path=str(self.target)), timeout=timeout)))
        if self.staging is not None:
            steps.append(("unstage", lambda: self.proxy.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(
                volume_id=vid, staging_target_path=str(self.staging)), timeout=timeout)))

        def delete() -> None:
            try:
                retry_failed_precondition(lambda: self.driver.controller.DeleteVolume(
                    csi_pb2.DeleteVolumeRequest(volume_id=vid), timeout=timeout), patience=20)
            except grpc.RpcError as exc:
                raise RuntimeError(f"{exc.details()} ({holders(self.driver.data_dir)})") from None

        steps.append(("delete", delete))
        for name, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the forced cleanup follows
                problems.append(f"{name} {vid}: {exc!r}")
        self.volume_id, self.staging, self.target = "", None, None
        return problems


def holders(data_dir: Path) -> str:
    """Who keeps the loop devices over files below data_dir (for a failed DeleteVolume)."""
    prefix = str(data_dir.resolve()) + "/"
    out = []
    for device, backing in sysloop.attached().items():
        if not backing.startswith(prefix):
            continue
        name = device.removeprefix("/dev/")
        autoclear = file_text(f"/sys/block/{name}/loop/autoclear")
        try:
            rdev = os.stat(device).st_rdev
            numbers = f" {os.major(rdev)}:{os.minor(rdev)} "
        except OSError:
            numbers = None
        users, namespaces = [], set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                for fd in (proc / "fd").iterdir():
                    if os.readlink(fd) == device:
                        users.append(f"{proc.name}:{file_text(f'/proc/{proc.name}/comm')}")
                        break
                # A mount of it in any mount namespace (a sandbox made with
                # unshare -m while it was mounted here keeps a copy).
                if numbers and numbers in (proc / "mountinfo").read_text():
                    namespaces.add(f"{os.readlink(proc / 'ns' / 'mnt')} (pid {proc.name} "
                                   f"{file_text(f'/proc/{proc.name}/comm')})")
            except OSError:
                continue
        out.append(f"{device} autoclear={autoclear}, open by {users or 'nobody'}, mounted in "
                   f"{sorted(namespaces)[:5] or 'no mount namespace'}")
    return "; ".join(out) or "no loop device attached any more"


class CreatedVolume:
    """A volume created on a driver and nothing more (no stage, no
    publish): what ControllerGetVolume and ValidateVolumeCapabilities of
    hop_cost.py's bare variant ask about. No target, so no NodeGetVolumeStats."""

    target = None

    def __init__(self, driver: DriverProcess):
        self.driver = driver
        self.volume_id = ""

    def set_up(self) -> None:
        self.volume_id = self.driver.create("bench-bare-hops", 64 * MIB, mount_cap("ext4")).volume_id

    def tear_down(self, timeout: float = 30) -> list[str]:
        """DeleteVolume on the driver (if it was created); errors are returned."""
        vid, self.volume_id = self.volume_id, ""
        if not vid:
            return []
        try:
            retry_failed_precondition(lambda: self.driver.controller.DeleteVolume(
                csi_pb2.DeleteVolumeRequest(volume_id=vid), timeout=timeout), patience=20)
        except Exception as exc:  # noqa: BLE001 - the forced cleanup follows
            return [f"delete {vid}: {exc!r}"]
        return []


# -- part 2: deferred volumes on the runtime socket ---------------------------------------------


class StatsEntries:
    """Deferred volumes staged with RuntimeStageVolume on the proxy's
    runtime socket: (label, target, runtime-cli script or None for the one
    claimed by the registered handler)."""

    HANDLER = "bench"

    def __init__(self, root: Path, proxy: ProxyProcess, handler: ServerProcess):
        self.root = root
        self.proxy = proxy
        self.handler = handler
        self.channel = proxy.runtime_channel()
        self.runtime = runtime_pb2_grpc.RuntimeStub(self.channel)
        self.registry = registry_pb2_grpc.RegistryStub(self.channel)
        self.lease = None
        self.last_beat: float | None = None
        self.paths = [("handler", proxy.target("pod-handler", "pv-handler"), None),
                      ("runtime-cli sh", proxy.target("pod-cli", "pv-cli"), runtime_cli_sh()),
                      ("runtime-cli python", proxy.target("pod-cli-py", "pv-cli-py"), runtime_cli_python())]

    def stage(self) -> None:
        """Register the handler, stage every entry, claim the handler's, give the others their runtime-cli."""
        self.lease = self.registry.RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name=self.HANDLER, endpoint=f"unix://{self.handler.socket}", filesystems=["ext4"], features=["stats"]),
            timeout=10)
        Req = runtime_pb2.RuntimeStageVolumeRequest
        for _label, target, script in self.paths:
            target.mkdir(parents=True, exist_ok=True)  # an existing target: the sweep keeps the entry
            self.runtime.RuntimeStageVolume(Req(
                volume_type=Req.BLOCK, volume_target_path=str(target),
                volume_backing_path=f"/dev/bench-{target.parent.name}", fs_type="ext4", volume_id=target.parent.name,
                capacity_bytes=STATS_TOTAL), timeout=10)
            if script is None:
                self.registry.ClaimVolume(registry_pb2.ClaimVolumeRequest(
                    target_path=str(target), handler=self.HANDLER, sandbox_id="bench-sandbox",
                    lease_id=self.lease.lease_id), timeout=10)
            else:
                cli = self.root / f"runtime-cli-{target.parent.name}"
                cli.write_text(script)
                cli.chmod(0o755)
                # What a KEP-style runtime leaves in the entry directory.
                (self.proxy.volumes_dir / digest(str(target)) / "runtime-cli").write_text(f"{cli}\n")

    def stats(self, target: Path) -> runtime_pb2.RuntimeGetVolumeStatsResponse:
        return self.runtime.RuntimeGetVolumeStats(runtime_pb2.RuntimeGetVolumeStatsRequest(
            volume_target_path=str(target)), timeout=30)

    def check_and_warm_up(self) -> None:
        """Every path answers the fixed numbers; then 20 untimed rounds."""
        expected = fixed_stats()
        for label, target, _ in self.paths:
            got = self.stats(target)
            if got != expected:
                raise RuntimeError(f"RuntimeGetVolumeStats via the {label} answered {got}, expected {expected}")
        for _ in range(20):
            for _, target, _ in self.paths:
                self.stats(target)

    def keep_lease(self) -> None:
        """A heartbeat every 3 s, counted from the first call (untimed: call it between timed calls)."""
        if self.last_beat is None:
            self.last_beat = time.monotonic()
        elif time.monotonic() - self.last_beat > 3:
            self.registry.Heartbeat(registry_pb2.HeartbeatRequest(name=self.HANDLER, lease_id=self.lease.lease_id),
                                    timeout=10)
            self.last_beat = time.monotonic()

    def unstage(self) -> None:
        """Release the claim, unstage every entry, unregister the handler."""
        for _label, target, script in self.paths:
            if script is None:
                self.registry.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(
                    target_path=str(target), handler=self.HANDLER, sandbox_id="bench-sandbox",
                    lease_id=self.lease.lease_id), timeout=10)
            self.runtime.RuntimeUnstageVolume(runtime_pb2.RuntimeUnstageVolumeRequest(
                volume_target_path=str(target)), timeout=10)
        self.registry.UnregisterHandler(registry_pb2.UnregisterHandlerRequest(
            name=self.HANDLER, lease_id=self.lease.lease_id), timeout=10)

    def close(self) -> None:
        self.channel.close()
