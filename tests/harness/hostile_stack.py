"""The live set-up of tests/integration/test_hostile_input.py: the Stack
(`crust driver` -> `crust shim` -> `crust proxy` and a `crust handler` on real
loop devices and mounts) that sends a request to a daemon, puts its volumes,
snapshots, sandbox and registration back in place, checks the invariants
after every request, fills its state directories, and tears down. Its
nearly valid requests are in tests/harness/hostile_templates.py.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import event
from hypothesis import strategies as st

from crust.api import csi_pb2, handler_pb2, registry_pb2, runtime_pb2
from tests.harness import hostile
from tests.harness import hostile_requests
from tests.harness.daemons import MIB, Root, block_cap, fill_until_full, mount_cap
from tests.harness.hostile_templates import Templates, method_of


CALL_TIMEOUT = 20.0
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}

# Directories under the root that are small tmpfs mounts of their own, so
# that the full-disk pass can fill each one (ENOSPC); the driver's pools
# stay on the disk (a full pool is an I/O error inside a volume).
FULL_DISKS = ("data/controller", "data/node", "shim-state", "proxy-state", "volumes", "kata", "mountns-state")
FULL_DISK_SIZE = "16M"


# RPCs after which the live set-up may need to be put back (ids deleted,
# volumes unpublished, sandboxes gone, claims moved).
CHANGES_STATE = ("Create", "Delete", "Stage", "Unstage", "Publish", "Unpublish", "Expand", "Modify", "Register",
                 "Unregister", "Heartbeat", "Claim", "Release", "RunSandbox")


def one_line(msg) -> str:
    """Protobuf text format on one line; invisible characters (controls,
    \\u202e, \\x85, \\u2028, ...) escaped so the request can be read back."""
    text = text_format.MessageToString(msg, as_one_line=True, as_utf8=True)
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return text if len(text) < 3000 else text[:3000] + f"... ({len(text)} characters)"


_FINDINGS: dict[str, type] = {}


def finding(key: str) -> type:
    """An AssertionError subclass per kind of problem: hypothesis tells bugs
    apart by exception type and place, so each kind is shrunk and reported
    on its own."""
    if key not in _FINDINGS:
        name = "Hostile_" + "".join(c if c.isalnum() else "_" for c in key)[:80]
        _FINDINGS[key] = type(name, (AssertionError,), {})
    return _FINDINGS[key]


# -- the live set-up ------------------------------------------------------------------------------


@dataclass
class Vol:
    name: str
    kind: str  # mount | block
    staging: Path
    target: Path
    volume_id: str = ""
    device: str = ""
    major: int = 0
    minor: int = 0
    via: str = "proxy"  # the socket it is staged and published through

    def cap(self):
        return mount_cap("ext4") if self.kind == "mount" else block_cap()


@dataclass(repr=False)
class Stack(Templates):
    root: Root
    place: hostile_requests.Place
    before: hostile.HostState
    driver: object = None
    shim: object = None
    proxy: object = None
    handler: object = None
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    vols: dict[str, Vol] = field(default_factory=dict)
    snapshot_id: str = ""
    group_id: str = ""
    group_members: list[str] = field(default_factory=list)
    lease_id: str = ""
    sandbox_id: str = "hostile-sb"
    runtime_target: str = ""
    dirty: bool = True
    setup_problems: list[str] = field(default_factory=list)
    setup_defects: list[str] = field(default_factory=list)
    logs: hostile.LogWatch | None = None
    outside_baseline: set[str] = field(default_factory=set)
    strategies: dict[str, st.SearchStrategy] = field(default_factory=dict)
    last_code: grpc.StatusCode = grpc.StatusCode.OK
    codes: dict[str, Counter] = field(default_factory=dict)  # how far requests got, per RPC (printed at the end)

    @property
    def path(self) -> Path:
        return self.root.path

    @property
    def kubelet(self) -> Path:
        return self.path / "kubelet"

    def daemons(self) -> dict[str, object]:
        return {"driver": self.driver, "shim": self.shim, "proxy": self.proxy, "handler": self.handler}

    def target(self, pod: str, pv: str) -> Path:
        return self.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / pv / "mount"

    def staging(self, pv: str) -> Path:
        return self.kubelet / "plugins" / "kubernetes.io" / "csi" / "staging" / pv / "globalmount"

    # -- gRPC ---------------------------------------------------------------------------------

    def open_channels(self) -> None:
        for ch in self.channels.values():
            ch.close()
        sockets = {"driver": self.driver.socket, "shim": self.shim.socket, "proxy": self.proxy.socket,
                   "runtime": self.proxy.runtime_socket, "handler": self.handler.socket}
        self.channels = {name: grpc.insecure_channel(f"unix://{path}") for name, path in sockets.items()}

    def call(self, endpoint: str, service_name: str, method_name: str, request, timeout: float = CALL_TIMEOUT):
        """(code, details, response) of one call; never raises for a status."""
        service, method = method_of(service_name, method_name)
        response_type = hostile_requests.message_class(method.output_type)
        path = f"/{service.full_name}/{method.name}"
        channel = self.channels[endpoint]
        try:
            if method.server_streaming:
                rpc = channel.unary_stream(path, request_serializer=lambda m: m.SerializeToString(),
                                           response_deserializer=response_type.FromString)
                return grpc.StatusCode.OK, "", list(rpc(request, timeout=timeout))
            rpc = channel.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                                      response_deserializer=response_type.FromString)
            return grpc.StatusCode.OK, "", rpc(request, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None

    def ok(self, endpoint: str, service: str, method: str, request, what: str):
        code, details, response = self.call(endpoint, service, method, request, timeout=120)
        if code != grpc.StatusCode.OK:
            self.setup_problems.append(f"{what}: {code.name} {details}")
            if code in BAD_CODES:
                # A valid, idempotent request of the set-up: reported with the next RPC's result.
                self.setup_defects.append(f"{what} ({method} on {endpoint}, {one_line(request)}): {code.name} "
                                          f"{details[:500]}")
            return None
        return response

    # -- putting the set-up (back) in place ------------------------------------------------------

    def renew_grown(self, grown: dict[str, int]) -> None:
        """Set-up volumes a hostile ControllerExpandVolume grew (to as much as
        the pool had left: its volume id may be any real one) are taken down
        and made again at 32 MiB. Otherwise the set-up's snapshots would find
        no room in the 2 GiB pool, rightly, and say so as RESOURCE_EXHAUSTED.
        What holds or names such a volume goes first: the group snapshot and
        the snapshot of it, the sandbox holding the deferred one and its
        Runtime API entry, its publications (the set-up's and the second pod's
        a hostile NodePublishVolume made), its staging, a hostile
        ControllerPublishVolume."""
        C, G, N = "csi.v1.Controller", "csi.v1.GroupController", "csi.v1.Node"
        vols = {key: self.vols[key] for key in grown}
        why = ", ".join(f"{v.name} grown to {grown[key]}" for key, v in vols.items())
        if self.group_id and {"host", "spare"} & set(vols):
            self.ok("proxy", G, "DeleteVolumeGroupSnapshot", csi_pb2.DeleteVolumeGroupSnapshotRequest(
                group_snapshot_id=self.group_id), f"delete the group snapshot ({why})")
            self.group_id, self.group_members = "", []
        if self.snapshot_id and "host" in vols:
            self.ok("proxy", C, "DeleteSnapshot", csi_pb2.DeleteSnapshotRequest(snapshot_id=self.snapshot_id),
                    f"delete the snapshot ({why})")
            self.snapshot_id = ""
        if "deferred" in vols:
            self.ok("handler", "crust.handler.v1.SandboxControl", "DeleteSandbox",
                    handler_pb2.DeleteSandboxRequest(sandbox_id=self.sandbox_id), f"delete the sandbox ({why})")
            if self.runtime_target:
                self.ok("runtime", "crust.runtime.v1.Runtime", "RuntimeUnstageVolume",
                        runtime_pb2.RuntimeUnstageVolumeRequest(volume_target_path=self.runtime_target),
                        f"runtime unstage ({why})")
        for v in vols.values():
            for target in (v.target, self.target("p2", v.target.parent.name)):
                self.ok(v.via, N, "NodeUnpublishVolume", csi_pb2.NodeUnpublishVolumeRequest(
                    volume_id=v.volume_id, target_path=str(target)), f"unpublish {target.parent.name} ({why})")
            self.ok(v.via, N, "NodeUnstageVolume", csi_pb2.NodeUnstageVolumeRequest(
                volume_id=v.volume_id, staging_target_path=str(v.staging)), f"unstage {v.name} ({why})")
            self.ok("proxy", C, "ControllerUnpublishVolume", csi_pb2.ControllerUnpublishVolumeRequest(
                volume_id=v.volume_id, node_id="node-a"), f"controller unpublish {v.name} ({why})")
            self.ok("proxy", C, "DeleteVolume", csi_pb2.DeleteVolumeRequest(volume_id=v.volume_id),
                    f"delete {v.name} ({why})")
            rsp = self.ok("proxy", C, "CreateVolume", csi_pb2.CreateVolumeRequest(
                name=v.name, capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MIB),
                volume_capabilities=[v.cap()]), f"create {v.name} again ({why})")
            if rsp is not None:
                v.volume_id = rsp.volume.volume_id
                if rsp.volume.capacity_bytes != 32 * MIB:
                    self.setup_defects.append(f"{v.name} made again is {rsp.volume.capacity_bytes} bytes ({why})")

    def ensure(self) -> None:
        """Idempotent: volumes created, staged, published (host, deferred,
        raw block), a spare volume, snapshots, a registered handler, a
        Runtime API entry, a sandbox holding the deferred volume."""
        self.place.plant()
        self.revive()
        C, N, R, G = "csi.v1.Controller", "csi.v1.Node", "crust.registry.v1.Registry", "csi.v1.GroupController"
        grown = {}
        for key, v in self.vols.items():
            rsp = self.ok("proxy", C, "CreateVolume", csi_pb2.CreateVolumeRequest(
                name=v.name, capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MIB),
                volume_capabilities=[v.cap()]), f"create {v.name}")
            if rsp is not None:
                v.volume_id = rsp.volume.volume_id
                if rsp.volume.capacity_bytes > 32 * MIB:
                    grown[key] = rsp.volume.capacity_bytes
        if grown:
            self.renew_grown(grown)
        for key in ("host", "deferred", "block", "direct"):
            v = self.vols[key]
            self.ok(v.via, N, "NodeStageVolume", csi_pb2.NodeStageVolumeRequest(
                volume_id=v.volume_id, staging_target_path=str(v.staging), volume_capability=v.cap()),
                f"stage {v.name}")
            rsp = self.ok(v.via, N, "NodePublishVolume", csi_pb2.NodePublishVolumeRequest(
                volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(v.target),
                volume_capability=v.cap(), defer_fs_ops=key == "deferred"), f"publish {v.name}")
            if rsp is not None and rsp.HasField("deferred_mount"):
                d = rsp.deferred_mount
                v.device, v.major, v.minor = d.device, d.device_major, d.device_minor
        host = self.vols["host"]
        rsp = self.ok("proxy", C, "CreateSnapshot", csi_pb2.CreateSnapshotRequest(
            source_volume_id=host.volume_id, name="hostile-snap"), "snapshot")
        if rsp is not None:
            self.snapshot_id = rsp.snapshot.snapshot_id
        rsp = self.ok("proxy", G, "CreateVolumeGroupSnapshot", csi_pb2.CreateVolumeGroupSnapshotRequest(
            name="hostile-group", source_volume_ids=[host.volume_id, self.vols["spare"].volume_id]), "group snapshot")
        if rsp is not None:
            self.group_id = rsp.group_snapshot.group_snapshot_id
            self.group_members = [s.snapshot_id for s in rsp.group_snapshot.snapshots]
        rsp = self.ok("runtime", R, "RegisterHandler", registry_pb2.RegisterHandlerRequest(
            name="hostile-h", endpoint=f"unix://{self.path / 'hostile-h.sock'}", filesystems=["ext4"],
            features=["stats"]), "register hostile-h")
        if rsp is not None:
            self.lease_id = rsp.lease_id
        deferred = self.vols["deferred"]
        self.runtime_target = str(self.target("rt", "pv-rt"))
        self.ok("runtime", "crust.runtime.v1.Runtime", "RuntimeStageVolume", self.runtime_stage(), "runtime stage")
        self.ok("handler", "crust.handler.v1.SandboxControl", "RunSandbox", handler_pb2.RunSandboxRequest(
            bundle=str(self.bundle("with-volume", deferred.target)), sandbox_id=self.sandbox_id), "sandbox")
        self.place.real_paths = sorted({str(p) for v in self.vols.values() for p in (v.staging, v.target)} | {
            self.runtime_target, str(self.target("p2", "pv-host")), str(self.target("p2", "pv-direct")),
            str(self.target("p2", "pv-block")), str(self.path / "bundles" / "plain"),
            str(self.path / "bundles" / "with-volume")})
        self.place.devices = sorted({v.device for v in self.vols.values() if v.device})
        self.place.real_ids = {
            "volume": [v.volume_id for v in self.vols.values() if v.volume_id],
            "snapshot": [i for i in [self.snapshot_id, *self.group_members] if i],
            "group_snapshot": [i for i in [self.group_id] if i],
            "sandbox": [self.sandbox_id, "hostile-run", "hs1"],
            "name": ["mountns", "hostile-h"],
            "lease": [i for i in [self.lease_id] if i],
        }
        self.dirty = False

    def runtime_stage(self) -> runtime_pb2.RuntimeStageVolumeRequest:
        d = self.vols["deferred"]
        return runtime_pb2.RuntimeStageVolumeRequest(
            volume_type=runtime_pb2.RuntimeStageVolumeRequest.BLOCK, volume_target_path=self.runtime_target,
            volume_backing_path=d.device or "/dev/null", fs_type="ext4", volume_id=d.volume_id,
            capacity_bytes=32 * MIB, device_major=d.major, device_minor=d.minor)

    def bundle(self, name: str, volume_target: Path | None = None) -> Path:
        bundle = self.path / "bundles" / name
        (bundle / "rootfs").mkdir(parents=True, exist_ok=True)
        mounts = [{"destination": "/data", "source": str(volume_target), "type": "bind", "options": ["rbind"]}] \
            if volume_target else []
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["/bin/true"], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"}, "mounts": mounts}))
        return bundle

    def revive(self) -> list[str]:
        """Start again a daemon that died (its death is reported by check())."""
        revived = []
        for name, d in self.daemons().items():
            if d.proc is None or d.proc.poll() is not None:
                d.proc = None
                try:
                    d.start(timeout=30)
                    revived.append(name)
                except Exception as exc:  # noqa: BLE001 - reported below
                    self.setup_problems.append(f"restarting {name}: {exc}")
        if revived:
            self.open_channels()
        return revived

    # -- the invariants -------------------------------------------------------------------------------

    def deferred_claim(self) -> tuple[str, str] | None:
        """(handler, sandbox) holding the set-up's deferred volume, if any."""
        target = str(self.vols["deferred"].target)
        code, _, rsp = self.call("runtime", "crust.registry.v1.Registry", "ListClaims",
                                 registry_pb2.ListClaimsRequest(), timeout=10)
        if code != grpc.StatusCode.OK:
            return None
        return next(((c.handler, c.sandbox_id) for c in rsp.claims if c.target_path == target), None)

    def inverse(self, method_name: str, r):
        """The call that undoes a successful state-changing request that is
        not the set-up's own, so the next example starts from the same state."""
        real = set(self.place.real_paths)
        if method_name == "NodeStageVolume" and r.staging_target_path not in real:
            return "NodeUnstageVolume", csi_pb2.NodeUnstageVolumeRequest(
                volume_id=r.volume_id, staging_target_path=r.staging_target_path)
        if method_name == "NodePublishVolume" and r.target_path not in real:
            return "NodeUnpublishVolume", csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=r.volume_id, target_path=r.target_path)
        if method_name == "RuntimeStageVolume" and r.volume_target_path not in real:
            return "RuntimeUnstageVolume", runtime_pb2.RuntimeUnstageVolumeRequest(
                volume_target_path=r.volume_target_path)
        if method_name == "RunSandbox" and r.sandbox_id != self.sandbox_id:
            return "DeleteSandbox", handler_pb2.DeleteSandboxRequest(sandbox_id=r.sandbox_id)
        return None

    def observe(self, endpoint: str, service_name: str, method_name: str, request) -> list[tuple[str, str]]:
        """Send one request; the problems it caused as (kind, text). What it
        made outside the root is undone, a daemon it killed is restarted, and
        a successful state change of it is reversed."""
        held = self.deferred_claim()
        started = time.monotonic()
        code, details, _ = self.call(endpoint, service_name, method_name, request)
        elapsed = time.monotonic() - started
        self.last_code = code
        self.codes.setdefault(f"{endpoint} {method_name}", Counter())[code.name] += 1
        problems: list[tuple[str, str]] = []
        logs = self.logs.new_text()
        tracebacks = {p.name: found for p, t in logs.items() if (found := hostile.tracebacks(t))}
        where = ""
        for found in tracebacks.values():
            where = hostile.deepest_frame(found[-1]) or where
        if code in BAD_CODES:
            problems.append((f"{code.name} {where}", f"{endpoint} {method_name} answered {code.name} after "
                                                     f"{elapsed:.1f} s: {details[:1000]}"))
        if tracebacks:
            problems.append((f"traceback {where}", "traceback in a daemon log:\n" + "\n".join(
                f"[{name}] {text}" for name, found in tracebacks.items() for text in found)))
        now = hostile.HostState.take()
        mounts = self.before.new_mounts_outside(now, self.path, self.place.outside)
        if mounts:
            problems.append(("mount outside root", f"mounts outside the test root: {mounts}"))
        loops = self.before.new_loops_outside(now, self.path, self.place.outside)
        if loops:
            problems.append(("loop outside root", f"loop devices over files outside the test root: {loops}"))
        listing = self.place.outside_listing()
        if listing != self.outside_baseline:
            problems.append(("file outside root", f"the scratch directory outside the root changed: created "
                             f"{sorted(listing - self.outside_baseline)}, removed "
                             f"{sorted(self.outside_baseline - listing)}"))
        etc = self.place.etc_entries()
        if etc:
            problems.append(("file outside root", f"created in /etc through the symlink: {etc}"))
        dead = {n: d.proc.returncode for n, d in self.daemons().items()
                if d.proc is not None and d.proc.poll() is not None}
        if dead:
            problems.append(("daemon died", f"daemons exited: {dead}"))
        # Only the handler itself (its SandboxControl API) lets go of the
        # set-up sandbox's claim: no name, lease or sandbox id a caller
        # sends to the registry or the Runtime API takes it over.
        if held is not None and endpoint != "handler" and not dead and self.deferred_claim() != held:
            problems.append(("claim taken over", f"the claim {held} on the deferred volume became "
                             f"{self.deferred_claim()} after {method_name}"))
        # Undo what the example made outside the root before the next one.
        if mounts or listing != self.outside_baseline or etc:
            self.undo_outside(listing)
        if dead:
            self.revive()
        undo = self.inverse(method_name, request) if code == grpc.StatusCode.OK else None
        if undo is not None:
            # The undo is part of the example: a publish crust cannot take
            # back (INTERNAL, a mount left behind) is as much a defect.
            undo_code, undo_details, _ = self.call(endpoint, service_name, undo[0], undo[1])
            undo_logs = self.logs.new_text()
            if undo_code in BAD_CODES:
                where = ""
                for t in undo_logs.values():
                    found = hostile.tracebacks(t)
                    where = hostile.deepest_frame(found[-1]) if found else where
                problems.append((f"undo {undo_code.name} {where}", f"undoing it, {undo[0]} ({one_line(undo[1])}) "
                                 f"answered {undo_code.name}: {undo_details[:500]}"))
            elif undo_code == grpc.StatusCode.OK:
                problems += self.mounts_left(undo[0], undo[1])
            self.undo_outside(self.place.outside_listing())
        if problems:
            self.dirty = True
        return problems

    @staticmethod
    def mounts_left(method_name: str, request) -> list[tuple[str, str]]:
        """The undo of a publish or stage that answered OK left nothing
        mounted there (checked for undos only: a hostile unpublish may
        rightly answer OK for a path that holds another volume's mount)."""
        path = {"NodeUnpublishVolume": "target_path", "NodeUnstageVolume": "staging_target_path"}.get(method_name)
        if path is None:
            return []
        where = getattr(request, path).rstrip("/")
        left = [m for m in hostile.host_mounts() if m.mount_point == where]
        if not left:
            return []
        return [("mount left after OK", f"{method_name} answered OK but {where!r} is still mounted: "
                 f"{[(m.fs_type, m.source) for m in left]}")]

    def check(self, endpoint: str, service_name: str, method_name: str, request) -> None:
        __tracebackhide__ = True
        problems = self.observe(endpoint, service_name, method_name, request)
        event(self.last_code.name)
        if problems:
            kinds = sorted({k for k, _ in problems})
            raise finding(kinds[0])(f"{endpoint} {service_name}/{method_name}: " + "\n".join(t for _, t in problems))

    def undo_outside(self, listing: set[str]) -> None:
        if listing == self.outside_baseline and not self.place.etc_entries() and not any(
                m.mount_point.startswith((str(self.place.outside), "/etc/" + self.place.token))
                for m in hostile.host_mounts()):
            return
        hostile.unmount_ours_outside(self.place)
        hostile.remove_etc_entries(self.place)
        for rel in sorted(listing - self.outside_baseline, key=len):
            path = self.place.outside / rel
            if path.is_symlink() or path.is_file():
                path.unlink(missing_ok=True)
            elif path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
        self.place.plant()

    def answers(self) -> list[str]:
        """Every daemon still answers; the problems, if not."""
        problems = []
        for name in ("driver", "shim", "proxy"):
            code, details, rsp = self.call(name, "csi.v1.Identity", "Probe", csi_pb2.ProbeRequest(), timeout=10)
            if code != grpc.StatusCode.OK:
                problems.append(f"{name} Probe: {code.name} {details}")
        for name in ("runtime", "handler"):
            try:
                rsp = health_pb2_grpc.HealthStub(self.channels[name]).Check(health_pb2.HealthCheckRequest(), timeout=10)
                if rsp.status != health_pb2.HealthCheckResponse.SERVING:
                    problems.append(f"{name} health: {rsp.status}")
            except grpc.RpcError as exc:
                problems.append(f"{name} health: {exc.code().name} {exc.details()}")
        for endpoint, service, method, request in (
                ("runtime", "crust.registry.v1.Registry", "ListHandlers", registry_pb2.ListHandlersRequest()),
                ("handler", "crust.handler.v1.SandboxControl", "ListSandboxes", handler_pb2.ListSandboxesRequest())):
            code, details, _ = self.call(endpoint, service, method, request, timeout=10)
            if code != grpc.StatusCode.OK:
                problems.append(f"{endpoint} {method}: {code.name} {details}")
        return problems

    # -- a full disk ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def disks_full(self):
        """Every FULL_DISKS directory filled until ENOSPC, then emptied again."""
        fillers = []
        try:
            for name in FULL_DISKS:
                fillers.append(fill_until_full(self.path / name, ".hostile-filler"))
            yield
        finally:
            for filler in fillers:
                filler.unlink(missing_ok=True)

    # -- teardown -------------------------------------------------------------------------------------

    def delete_sandboxes(self) -> None:
        if self.handler is None or self.handler.proc is None or "handler" not in self.channels:
            return
        code, _, rsp = self.call("handler", "crust.handler.v1.SandboxControl", "ListSandboxes",
                                 handler_pb2.ListSandboxesRequest(), timeout=20)
        if code != grpc.StatusCode.OK:
            return
        for info in rsp.sandboxes:
            self.call("handler", "crust.handler.v1.SandboxControl", "DeleteSandbox",
                      handler_pb2.DeleteSandboxRequest(sandbox_id=info.sandbox_id), timeout=60)


def mount_small_disks(root: Path) -> None:
    for name in FULL_DISKS:
        where = root / name
        where.mkdir(parents=True, mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_SIZE},mode=0700", "tmpfs", str(where)],
                       check=True)
