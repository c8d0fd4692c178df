"""Hostile input to every RPC of every crust daemon (property-based, hypothesis).

One real stack for the module: `crust driver` -> `crust shim` -> `crust proxy`
and a `crust handler` (mount-namespace sandboxes) registered with the proxy,
on real loop devices and mounts. For each RPC of

- csi.v1 Identity, Controller, GroupController, Node and SnapshotMetadata on
  the driver's, the shim's and the proxy's CSI sockets,
- crust's Runtime and Registry services on the proxy's runtime socket,
- crust's Handler and SandboxControl services on the handler's socket,

hypothesis builds requests from the message descriptors (crust/api/*_pb2):
random and real ids; paths below the test root, through symlinks planted
below it that lead out of it (to a scratch directory next to the root, and to
/etc, followed only by names of this run's own `crust-hostile-<token>`
prefix), with '.', '..', '//', components of 256+ bytes, 4097+ byte paths,
characters str.splitlines() breaks lines at (\x85, \u2028, \r, ...); odd
Unicode and NUL; enum values in and out of range; integers at the
int32/int64/uint64 edges; repeated fields and maps with 0 to 1000 entries.
Two thirds of the requests are "nearly valid": a request of the live set-up
(real volumes staged and published on the host, at the driver itself,
deferred to a running sandbox, raw block; a snapshot, a group snapshot, a
registered handler, a Runtime API entry, OCI bundles) with one or two fields
replaced (path fields most often) or cleared. Before hypothesis' own
examples, every RPC with such a request gets the same explicit attacks:
each path field through each planted symlink and each malformed path, each
id field with each malformed id, enums 99 and -1, int64 edges.

After every request it asserts:
- the status is not UNKNOWN, INTERNAL or DEADLINE_EXCEEDED;
- no daemon log (root/*.log) got a traceback, and no daemon process died;
- no mount appeared outside the test root and no loop device over a file
  outside the test root (compared with the host before the module started;
  other crust tests' /tmp/crust-* directories are ignored);
- nothing was created or removed in the scratch directory outside the root,
  and nothing named crust-hostile-<token>* appeared in /etc;
- a stage, publish, Runtime API stage or sandbox the request made at a new
  place can be undone (unstage, unpublish, ...) without UNKNOWN, INTERNAL or
  DEADLINE_EXCEEDED, and an undo that answers OK leaves nothing mounted.
What a failing example made outside the root (its mounts, /etc entries,
scratch files) is undone before the next example. After each RPC every daemon
must answer: csi Identity/Probe on the three CSI sockets, grpc.health and a
listing on the runtime and handler sockets. The mount table is read with the
test's own parser (tests/hostile.py), not crust's.

File-level faults (test_hostile_files): hypothesis plants, where crust
reads a file, a mountInfo.json that is not JSON, cut short, of wrong types,
empty, 8 MiB, a directory, a symlink (to the scratch directory's file or
directory, or dangling), a FIFO or a socket; an entry holding a
subdirectory tree, a link and a FIFO, or an entry that is a file or a
symlink. The places: the entries of the volume deferred to the set-up's
sandbox and of the Runtime API's volume, their Kata mirrors, an entry no
record explains, a runtime-cli file, Kata's claim marker, and the proxy's
record of a volume (then the proxy restarts). Then the calls that read them
(kubelet's retried publish, stats, claim and release, the Runtime API's
unstage and stage, a sandbox start) must meet the invariants above, and the
proxy must have written its entry and mirror again from its record.

Full disk (test_hostile_request_on_a_full_disk): every RPC gets
FULL_EXAMPLES_PER_RPC more requests with every state directory full: the
driver's record directories, the shim's, the proxy's and the handler's state
dirs, the watched directory and the Kata mirror are small tmpfs mounts the
module makes, each filled to the last byte for that pass (ENOSPC). The same
checks hold (RESOURCE_EXHAUSTED is a right answer there, UNKNOWN, INTERNAL
and tracebacks are not), and once the space is freed the set-up is put back
in place through the same daemons, which must answer as before.

Distinct problems of one RPC are reported separately (hypothesis' multiple
bugs report; "[explicit]" for the fixed attacks), each with its request in
protobuf text format (invisible characters escaped) and the end of the
daemon's traceback. With -s, the last test prints the status codes each
RPC's requests got (how deep they reached).

Running:
    ./run tests tests/integration/test_hostile_input.py -q
CRUST_HOSTILE_EXAMPLES=N multiplies the number of hypothesis examples per RPC
(default 1: EXAMPLES_PER_RPC = 50 per RPC, about 2 minutes for the file on
two cores; more while findings are shrunk), e.g. CRUST_HOSTILE_EXAMPLES=20
for a long run. No example database is kept and hypothesis' caches go to a
scratch directory (no .hypothesis in the checkout); a failure prints the
request and a @reproduce_failure blob.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import pytest
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from crust.api import csi_pb2, handler_pb2, registry_pb2, runtime_pb2
from crust.sys import loop as sysloop
from tests import hostile
from tests.harness import MIB, Root, block_cap, fill_until_full, kill_processes_rooted_under, mount_cap

# Hypothesis keeps caches (and would keep its example database) in
# ./.hypothesis: a scratch directory instead, so the checkout stays clean.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="crust-hypothesis-")
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)
set_hypothesis_home_dir(_HYPOTHESIS_HOME)

EXAMPLES_PER_RPC = 50
FULL_EXAMPLES_PER_RPC = 10
MULTIPLIER = float(os.environ.get("CRUST_HOSTILE_EXAMPLES", "1") or 1)
CALL_TIMEOUT = 20.0
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}
TOPOLOGY_KEY = "topology.loop.csi.crust.dev/node"

pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

SETTINGS = settings(
    max_examples=max(1, int(EXAMPLES_PER_RPC * MULTIPLIER)),
    deadline=None,
    database=None,
    derandomize=False,
    print_blob=True,
    report_multiple_bugs=True,
    suppress_health_check=list(HealthCheck),
)
FULL_SETTINGS = settings(SETTINGS, max_examples=max(1, int(FULL_EXAMPLES_PER_RPC * MULTIPLIER)))

# Directories under the root that are small tmpfs mounts of their own, so
# that the full-disk pass can fill each one (ENOSPC); the driver's pools
# stay on the disk (a full pool is an I/O error inside a volume).
FULL_DISKS = ("data/controller", "data/node", "shim-state", "proxy-state", "volumes", "kata", "mountns-state")
FULL_DISK_SIZE = "16M"

# -- what each socket serves ------------------------------------------------------------------

CSI = [csi_pb2.DESCRIPTOR.services_by_name[n] for n in
       ("Identity", "Controller", "GroupController", "Node", "SnapshotMetadata")]
SERVICES = {
    "driver": CSI,
    "shim": CSI,
    "proxy": CSI,
    "runtime": [runtime_pb2.DESCRIPTOR.services_by_name["Runtime"],
                registry_pb2.DESCRIPTOR.services_by_name["Registry"]],
    "handler": [handler_pb2.DESCRIPTOR.services_by_name["Handler"],
                handler_pb2.DESCRIPTOR.services_by_name["SandboxControl"]],
}
TARGETS = [(endpoint, service.full_name, method.name)
           for endpoint, services in SERVICES.items() for service in services for method in service.methods]

# RPCs after which the live set-up may need to be put back (ids deleted,
# volumes unpublished, sandboxes gone, claims moved).
CHANGES_STATE = ("Create", "Delete", "Stage", "Unstage", "Publish", "Unpublish", "Expand", "Modify", "Register",
                 "Unregister", "Heartbeat", "Claim", "Release", "RunSandbox")


def method_of(service_name: str, method_name: str):
    for services in SERVICES.values():
        for service in services:
            if service.full_name == service_name:
                return service, service.methods_by_name[method_name]
    raise KeyError(service_name)


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
class Stack:
    root: Root
    place: hostile.Place
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
        response_type = hostile.message_class(method.output_type)
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

    # -- templates of nearly valid requests ---------------------------------------------------------

    def templates(self) -> dict[str, list[Callable[[], object]]]:
        v = self.vols
        H, D, B, S, X = v["host"], v["deferred"], v["block"], v["spare"], v["direct"]
        cap = lambda: mount_cap("ext4")  # noqa: E731
        rng = lambda n: csi_pb2.CapacityRange(required_bytes=n)  # noqa: E731
        return {
            "CreateVolume": [lambda: csi_pb2.CreateVolumeRequest(
                name="hostile-new", capacity_range=rng(32 * MIB), volume_capabilities=[cap()],
                parameters={"fsType": "ext4"}, accessibility_requirements=csi_pb2.TopologyRequirement(
                    requisite=[csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-a"})])),
                lambda: csi_pb2.CreateVolumeRequest(
                    name="hostile-clone", capacity_range=rng(32 * MIB), volume_capabilities=[cap()],
                    volume_content_source=csi_pb2.VolumeContentSource(
                        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=self.snapshot_id)))],
            "DeleteVolume": [lambda: csi_pb2.DeleteVolumeRequest(volume_id=S.volume_id)],
            "ControllerPublishVolume": [lambda: csi_pb2.ControllerPublishVolumeRequest(
                volume_id=H.volume_id, node_id="node-a", volume_capability=cap())],
            "ControllerUnpublishVolume": [lambda: csi_pb2.ControllerUnpublishVolumeRequest(
                volume_id=H.volume_id, node_id="node-a")],
            "ValidateVolumeCapabilities": [lambda: csi_pb2.ValidateVolumeCapabilitiesRequest(
                volume_id=H.volume_id, volume_capabilities=[cap()])],
            "ListVolumes": [lambda: csi_pb2.ListVolumesRequest(max_entries=2, starting_token="1")],
            "GetCapacity": [lambda: csi_pb2.GetCapacityRequest(
                volume_capabilities=[cap()], accessible_topology=csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-a"}))],
            "CreateSnapshot": [lambda: csi_pb2.CreateSnapshotRequest(source_volume_id=H.volume_id,
                                                                     name="hostile-snap-2")],
            "DeleteSnapshot": [lambda: csi_pb2.DeleteSnapshotRequest(snapshot_id=self.snapshot_id)],
            "ListSnapshots": [lambda: csi_pb2.ListSnapshotsRequest(source_volume_id=H.volume_id, max_entries=1)],
            "GetSnapshot": [lambda: csi_pb2.GetSnapshotRequest(snapshot_id=self.snapshot_id)],
            "ControllerExpandVolume": [lambda: csi_pb2.ControllerExpandVolumeRequest(
                volume_id=S.volume_id, capacity_range=rng(64 * MIB), volume_capability=cap())],
            "ControllerGetVolume": [lambda: csi_pb2.ControllerGetVolumeRequest(volume_id=H.volume_id)],
            "ControllerModifyVolume": [lambda: csi_pb2.ControllerModifyVolumeRequest(
                volume_id=S.volume_id, mutable_parameters={"provisioning": "thin"})],
            "ControllerGetNodeInfo": [lambda: csi_pb2.ControllerGetNodeInfoRequest(node_id="node-a")],
            "CreateVolumeGroupSnapshot": [lambda: csi_pb2.CreateVolumeGroupSnapshotRequest(
                name="hostile-group-2", source_volume_ids=[H.volume_id])],
            "DeleteVolumeGroupSnapshot": [lambda: csi_pb2.DeleteVolumeGroupSnapshotRequest(
                group_snapshot_id=self.group_id, snapshot_ids=self.group_members)],
            "GetVolumeGroupSnapshot": [lambda: csi_pb2.GetVolumeGroupSnapshotRequest(
                group_snapshot_id=self.group_id, snapshot_ids=self.group_members)],
            "GetMetadataAllocated": [lambda: csi_pb2.GetMetadataAllocatedRequest(
                snapshot_id=self.snapshot_id, max_results=10)],
            "GetMetadataDelta": [lambda: csi_pb2.GetMetadataDeltaRequest(
                base_snapshot_id=self.snapshot_id, target_snapshot_id=self.snapshot_id, max_results=10)],
            "NodeStageVolume": [lambda: csi_pb2.NodeStageVolumeRequest(
                volume_id=S.volume_id, staging_target_path=str(S.staging), volume_capability=cap()),
                lambda: csi_pb2.NodeStageVolumeRequest(
                    volume_id=B.volume_id, staging_target_path=str(B.staging), volume_capability=block_cap())],
            "NodeUnstageVolume": [lambda: csi_pb2.NodeUnstageVolumeRequest(
                volume_id=S.volume_id, staging_target_path=str(S.staging))],
            "NodePublishVolume": [lambda: csi_pb2.NodePublishVolumeRequest(
                volume_id=H.volume_id, staging_target_path=str(H.staging),
                target_path=str(self.target("p2", "pv-host")), volume_capability=cap()),
                lambda: csi_pb2.NodePublishVolumeRequest(
                    volume_id=D.volume_id, staging_target_path=str(D.staging), target_path=str(D.target),
                    volume_capability=cap(), defer_fs_ops=True),
                lambda: csi_pb2.NodePublishVolumeRequest(
                    volume_id=B.volume_id, staging_target_path=str(B.staging),
                    target_path=str(self.target("p2", "pv-block")), volume_capability=block_cap()),
                lambda: csi_pb2.NodePublishVolumeRequest(
                    volume_id=X.volume_id, staging_target_path=str(X.staging),
                    target_path=str(self.target("p2", "pv-direct")), volume_capability=cap())],
            "NodeUnpublishVolume": [lambda: csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=H.volume_id, target_path=str(self.target("p2", "pv-host"))),
                lambda: csi_pb2.NodeUnpublishVolumeRequest(
                    volume_id=X.volume_id, target_path=str(self.target("p2", "pv-direct")))],
            "NodeGetVolumeStats": [lambda x=x: csi_pb2.NodeGetVolumeStatsRequest(
                volume_id=x.volume_id, volume_path=str(x.target), staging_target_path=str(x.staging))
                for x in (H, D, B, X)],
            "NodeExpandVolume": [lambda x=x: csi_pb2.NodeExpandVolumeRequest(
                volume_id=x.volume_id, volume_path=str(x.target), staging_target_path=str(x.staging),
                capacity_range=rng(32 * MIB), volume_capability=x.cap()) for x in (H, D, X)],
            "RuntimeStageVolume": [self.runtime_stage],
            "RuntimeUnstageVolume": [lambda: runtime_pb2.RuntimeUnstageVolumeRequest(
                volume_target_path=self.runtime_target)],
            "RuntimeGetVolumeStats": [lambda: runtime_pb2.RuntimeGetVolumeStatsRequest(
                volume_target_path=str(D.target))],
            "RuntimeExpandVolume": [lambda: runtime_pb2.RuntimeExpandVolumeRequest(
                volume_target_path=str(D.target), capacity_range=rng(32 * MIB))],
            "RegisterHandler": [lambda: registry_pb2.RegisterHandlerRequest(
                name="hostile-h", endpoint=f"unix://{self.path / 'hostile-h.sock'}", filesystems=["ext4"])],
            "Heartbeat": [lambda: registry_pb2.HeartbeatRequest(name="hostile-h", lease_id=self.lease_id)],
            "UnregisterHandler": [lambda: registry_pb2.UnregisterHandlerRequest(name="hostile-h",
                                                                                lease_id=self.lease_id)],
            "ClaimVolume": [lambda: registry_pb2.ClaimVolumeRequest(
                target_path=self.runtime_target, handler="hostile-h", sandbox_id="hs1", sandbox_pid=os.getpid(),
                lease_id=self.lease_id),
                # The set-up's sandbox's volume, in its handler's name, without its lease.
                lambda: registry_pb2.ClaimVolumeRequest(
                    target_path=str(D.target), handler="mountns", sandbox_id="hs1", lease_id=self.lease_id)],
            "ReleaseVolume": [lambda: registry_pb2.ReleaseVolumeRequest(
                target_path=self.runtime_target, handler="hostile-h", sandbox_id="hs1", lease_id=self.lease_id),
                lambda: registry_pb2.ReleaseVolumeRequest(
                    target_path=str(D.target), handler="mountns", sandbox_id=self.sandbox_id,
                    lease_id=self.lease_id)],
            "ListClaims": [lambda: registry_pb2.ListClaimsRequest(handler="mountns")],
            "GetVolumeStats": [lambda: handler_pb2.GetVolumeStatsRequest(target_path=str(D.target),
                                                                         sandbox_id=self.sandbox_id)],
            "ExpandVolume": [lambda: handler_pb2.ExpandVolumeRequest(
                target_path=str(D.target), sandbox_id=self.sandbox_id, capacity_range=rng(32 * MIB))],
            "GetSandbox": [lambda: handler_pb2.GetSandboxRequest(sandbox_id=self.sandbox_id)],
            "RunSandbox": [lambda: handler_pb2.RunSandboxRequest(bundle=str(self.path / "bundles" / "plain"),
                                                                 sandbox_id="hostile-run")],
            "DeleteSandbox": [lambda: handler_pb2.DeleteSandboxRequest(sandbox_id="hostile-run")],
        }

    def strategy(self, service_name: str, method_name: str) -> st.SearchStrategy:
        key = f"{service_name}/{method_name}"
        if key not in self.strategies:
            _, method = method_of(service_name, method_name)
            desc = method.input_type
            generic = hostile.message(desc, self.place)
            nearly = [hostile.mutated(t, desc, self.place) for t in self.templates().get(method_name, [])
                      if t().DESCRIPTOR is desc]
            # Two thirds nearly valid: hostile values where a real request would reach the kernel.
            self.strategies[key] = st.one_of(generic, st.one_of(*nearly), st.one_of(*nearly)) if nearly else generic
        return self.strategies[key]

    def explicit(self, service_name: str, method_name: str) -> list:
        _, method = method_of(service_name, method_name)
        return hostile.explicit_cases([t() for t in self.templates().get(method_name, [])], method.input_type,
                                      self.place)

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


@pytest.fixture(scope="module")
def stack():
    before = hostile.HostState.take()
    root = Root()
    place = hostile.Place(root=root.path.resolve(), outside=hostile.scratch_outside(root.path))
    cwd = os.getcwd()
    # The daemons inherit the working directory: a relative path a daemon
    # wrongly accepted lands deep below the test root, not in the checkout.
    workdir = root.path / "cwd" / "a" / "b" / "c"
    workdir.mkdir(parents=True)
    os.chdir(workdir)
    s = Stack(root=root, place=place, before=before)
    try:
        place.plant()
        s.outside_baseline = place.outside_listing()
        mount_small_disks(root.path)
        # A small pool: thick provisioning of hostile sizes must not fill the disk.
        s.driver, s.shim, s.proxy = root.stack(driver_extra=["--capacity", "2Gi"])
        s.handler = root.handler(s.proxy).start()
        s.open_channels()
        s.bundle("plain")
        s.vols = {
            "host": Vol("hostile-host", "mount", s.staging("pv-host"), s.target("p1", "pv-host")),
            "deferred": Vol("hostile-deferred", "mount", s.staging("pv-def"), s.target("p1", "pv-def")),
            "block": Vol("hostile-block", "block", s.staging("pv-block"), s.target("p1", "pv-block")),
            "spare": Vol("hostile-spare", "mount", s.staging("pv-spare"), s.target("p1", "pv-spare")),
            # Staged and published at the driver itself (the others reach it through the shim).
            "direct": Vol("hostile-direct", "mount", s.staging("pv-direct"), s.target("p1", "pv-direct"),
                          via="driver"),
        }
        s.ensure()
        assert not s.setup_problems, s.setup_problems
        s.setup_problems.clear()
        s.logs = hostile.LogWatch(sorted(root.path.glob("*.log")))
        yield s
    finally:
        os.chdir(cwd)
        try:
            s.delete_sandboxes()
        except Exception:  # noqa: BLE001 - cleanup goes on
            pass
        for ch in s.channels.values():
            ch.close()
        kill_processes_rooted_under(str(root.path.resolve()) + "/")
        hostile.unmount_ours_outside(place)
        # Root.close() finds mounts with crust's own mountinfo parser, which
        # misses mount points holding \x85, \u2028, \r, ...: those first.
        hostile.unmount_under(place.root)
        root.close()
        hostile.unmount_under(place.root)
        hostile.detach_loops_of(str(place.root) + "/")
        shutil.rmtree(place.root, ignore_errors=True)
        hostile.unmount_ours_outside(place)
        hostile.remove_etc_entries(place)
        hostile.detach_loops_of(str(place.outside) + "/")
        shutil.rmtree(place.outside, ignore_errors=True)
        left = [m.mount_point for m in hostile.host_mounts()
                if m.mount_point.startswith((str(root.path) + "/", str(place.outside), "/etc/" + place.token))]
        loops = [d for d, b in sysloop.attached().items() if b.startswith((str(root.path.resolve()) + "/",
                                                                             str(place.outside)))]
        etc = place.etc_entries()
        if left or loops or etc:
            raise RuntimeError(f"the hostile-input test left mounts {left}, loop devices {loops}, /etc entries {etc}")


@pytest.mark.parametrize("endpoint,service,method", TARGETS, ids=[f"{e}-{s.split('.')[-1]}.{m}" for e, s, m in TARGETS])
def test_hostile_request(stack: Stack, endpoint: str, service: str, method: str):
    if stack.dirty:
        stack.ensure()
    stack.setup_problems.clear()
    strategy = stack.strategy(service, method)
    if any(w in method for w in CHANGES_STATE):
        stack.dirty = True

    # The same attacks every run (each path field through each symlink, ...),
    # then hypothesis' own; distinct problems of the explicit ones are
    # reported once each, with their first request and how often they came.
    explicit: dict[str, list] = {}  # kind -> [count, {first line of text: (request, text)}]
    for request in stack.explicit(service, method):
        for kind, text in stack.observe(endpoint, service, method, request):
            entry = explicit.setdefault(kind, [0, {}])
            entry[0] += 1
            if len(entry[1]) < 3:
                entry[1].setdefault(text.split("\n")[0][:200], (one_line(request), text))

    @SETTINGS
    @given(request=strategy)
    def one_request(request):
        __tracebackhide__ = True
        note(f"request ({type(request).DESCRIPTOR.full_name}): {one_line(request)}")
        stack.check(endpoint, service, method, request)

    failure = None
    try:
        one_request()
    except Exception as exc:  # noqa: BLE001 - reported below, after the liveness check
        failure = exc
    problems = stack.answers()
    if problems:
        stack.revive()
        stack.open_channels()
    report = [f"after {endpoint} {method}, daemons do not answer: {problems}"] if problems else []
    report += [f"[set-up, after earlier RPCs] {d}" for d in stack.setup_defects]
    stack.setup_defects.clear()
    report += [f"[explicit] {kind} ({count} requests), e.g.\n" + "\n".join(
        f"request: {req}\n{text}" for req, text in samples.values())
        for kind, (count, samples) in sorted(explicit.items())]
    if report:
        raise AssertionError("\n\n".join(report)) from failure
    if failure is not None:
        raise failure


# -- file-level faults in the directories crust shares ------------------------------------------------

# Where a fault is planted: the watched directory's entries (of the volume
# deferred to the set-up's sandbox, of the Runtime API's volume, of no
# volume at all), their Kata mirrors, the runtime-cli a KEP runtime leaves in
# an entry, Kata's claim marker, and the proxy's record of a volume.
FILE_PLACES = ("entry:deferred", "mirror:deferred", "entry:runtime", "mirror:runtime", "runtime-cli:runtime",
               "marker:runtime", "entry:stray", "record:runtime")
FILE_EXAMPLES = 40
MARKER = "hs1"


def stray_target(stack: Stack) -> str:
    return str(stack.target("stray", "pv-stray"))


def fault_path(stack: Stack, where: str) -> Path:
    from crust.contract.mountinfo import digest, kata_name

    kind, which = where.split(":")
    target = {"deferred": str(stack.vols["deferred"].target), "runtime": stack.runtime_target,
              "stray": stray_target(stack)}[which]
    return {"entry": stack.proxy.volumes_dir / digest(target) / "mountInfo.json",
            "mirror": stack.proxy.kata_dir / kata_name(target) / "mountInfo.json",
            "runtime-cli": stack.proxy.volumes_dir / digest(target) / "runtime-cli",
            "marker": stack.proxy.kata_dir / kata_name(target) / MARKER,
            "record": stack.proxy.state_dir / "volumes" / f"{digest(target)}.json"}[kind]


def file_triggers(stack: Stack, where: str) -> list[tuple[str, str, str, object]]:
    """The calls that read what was damaged, in the order a node makes them."""
    D = stack.vols["deferred"]
    N, RT, R = "csi.v1.Node", "crust.runtime.v1.Runtime", "crust.registry.v1.Registry"
    publish = ("proxy", N, "NodePublishVolume", csi_pb2.NodePublishVolumeRequest(
        volume_id=D.volume_id, staging_target_path=str(D.staging), target_path=str(D.target),
        volume_capability=mount_cap("ext4"), defer_fs_ops=True))
    deferred_stats = ("runtime", RT, "RuntimeGetVolumeStats",
                      runtime_pb2.RuntimeGetVolumeStatsRequest(volume_target_path=str(D.target)))
    claim = ("runtime", R, "ClaimVolume", registry_pb2.ClaimVolumeRequest(
        target_path=stack.runtime_target, handler="hostile-h", sandbox_id=MARKER, sandbox_pid=os.getpid(),
        lease_id=stack.lease_id))
    release = ("runtime", R, "ReleaseVolume", registry_pb2.ReleaseVolumeRequest(
        target_path=stack.runtime_target, handler="hostile-h", sandbox_id=MARKER, lease_id=stack.lease_id))
    runtime_stats = ("runtime", RT, "RuntimeGetVolumeStats",
                     runtime_pb2.RuntimeGetVolumeStatsRequest(volume_target_path=stack.runtime_target))
    unstage = ("runtime", RT, "RuntimeUnstageVolume",
               runtime_pb2.RuntimeUnstageVolumeRequest(volume_target_path=stack.runtime_target))
    stage = ("runtime", RT, "RuntimeStageVolume", stack.runtime_stage())
    run = ("handler", "crust.handler.v1.SandboxControl", "RunSandbox", handler_pb2.RunSandboxRequest(
        bundle=str(stack.path / "bundles" / "plain"), sandbox_id="hostile-files"))
    kind, which = where.split(":")
    if which == "deferred":
        return [publish, deferred_stats]
    if kind in ("entry", "mirror"):
        return [claim, release, runtime_stats, stage, unstage, stage] if which == "runtime" else [run]
    if kind == "runtime-cli":
        return [runtime_stats, unstage, stage]
    if kind == "marker":
        return [claim, release]
    return [stage]  # the record, after the proxy's restart


def file_truth(stack: Stack, where: str, codes: list[grpc.StatusCode]) -> list[tuple[str, str]]:
    """What must hold once the calls answered OK: the proxy wrote its entry
    and mirror again from its record, Kata's marker is a plain file only
    while claimed, a stray entry is gone after a start."""
    from crust.contract.mountinfo import MountInfo

    problems = []
    kind, which = where.split(":")
    if which in ("deferred", "runtime") and kind in ("entry", "mirror", "record") and \
            all(c == grpc.StatusCode.OK for c in codes[-1:]):
        D = stack.vols["deferred"]
        for name in ("entry", "mirror"):
            path = fault_path(stack, f"{name}:{which}")
            if not path.is_file() or path.is_symlink():
                problems.append(("file not repaired", f"{where}: {path} is not a regular file after the calls"))
                continue
            info = MountInfo.model_validate_json(path.read_bytes())
            if (info.device, info.device_major, info.device_minor) != (D.device, D.major, D.minor):
                problems.append(("file not repaired", f"{where}: {path} names {info.device}"))
    if which == "deferred" and kind == "mirror":
        marker = fault_path(stack, "mirror:deferred").parent / stack.sandbox_id
        if not marker.is_file():
            problems.append(("marker lost", f"{where}: Kata's marker of the set-up's sandbox is gone"))
    if kind == "marker" and codes and codes[0] == grpc.StatusCode.OK:
        if os.path.lexists(fault_path(stack, where)):
            problems.append(("marker left", f"{where}: the marker is still there after the release"))
    if which == "stray" and fault_path(stack, where).parent.exists() and \
            fault_path(stack, where).parent.is_dir():
        problems.append(("stray entry left", f"{where}: a start left an entry no record explains"))
    return problems


def test_setup_made_again_after_its_volumes_grew(stack: Stack):
    """A hostile ControllerExpandVolume may draw any set-up volume's id and
    take what the pool has left. With every set-up volume grown so, putting
    the set-up back makes them again at 32 MiB instead of finding no room
    for its snapshots."""
    if stack.dirty:
        stack.ensure()
    C = "csi.v1.Controller"
    capacity = csi_pb2.GetCapacityRequest(volume_capabilities=[mount_cap("ext4")])
    room_before = stack.ok("proxy", C, "GetCapacity", capacity, "capacity before").available_capacity
    claim_before = stack.deferred_claim()
    assert claim_before is not None
    stack.dirty = True
    for n, v in enumerate(stack.vols.values(), start=1):
        room = stack.ok("proxy", C, "GetCapacity", capacity, "capacity").available_capacity
        share = room if n == len(stack.vols) else room // 2  # the last takes all that is left
        code, details, _ = stack.call("proxy", C, "ControllerExpandVolume", csi_pb2.ControllerExpandVolumeRequest(
            volume_id=v.volume_id, capacity_range=csi_pb2.CapacityRange(
                required_bytes=32 * MIB + share // MIB * MIB), volume_capability=v.cap()), timeout=120)
        assert code == grpc.StatusCode.OK, f"growing {v.name}: {code.name} {details}"
    room_grown = stack.ok("proxy", C, "GetCapacity", capacity, "capacity grown").available_capacity
    assert room_grown < MIB, room_grown
    stack.ensure()
    assert not stack.setup_defects, stack.setup_defects
    assert not [p for p in stack.setup_problems if "RESOURCE_EXHAUSTED" in p], stack.setup_problems
    stack.setup_problems.clear()
    for v in stack.vols.values():
        rsp = stack.ok("proxy", C, "ControllerGetVolume", csi_pb2.ControllerGetVolumeRequest(volume_id=v.volume_id),
                       f"get {v.name}")
        assert rsp.volume.capacity_bytes == 32 * MIB, (v.name, rsp.volume.capacity_bytes)
    assert stack.ok("proxy", C, "GetCapacity", capacity, "capacity after").available_capacity == room_before
    assert stack.deferred_claim() == claim_before


def test_hostile_files(stack: Stack):
    """Damaged, planted, FIFO, symlinked and oversized files (and entries)
    where crust reads them, then the calls that read them: never UNKNOWN,
    INTERNAL or a deadline (a blocked event loop), no traceback, nothing
    mounted or written outside the root, the daemons answer, and the proxy
    writes its entries again from its records."""
    outside_file = (stack.place.outside / "file").read_bytes()

    def faults_at(where: str) -> tuple[str, ...]:
        # Around a record only its file: its directory is the daemon's own.
        return hostile.FILE_FAULTS if where.startswith("record") else hostile.FILE_FAULTS + hostile.ENTRY_FAULTS

    @settings(SETTINGS, max_examples=max(1, int(FILE_EXAMPLES * MULTIPLIER)))
    @given(case=st.sampled_from(FILE_PLACES).flatmap(
        lambda where: st.tuples(st.just(where), st.sampled_from(faults_at(where)))))
    def one_fault(case: tuple[str, str]):
        __tracebackhide__ = True
        where, fault = case
        if stack.dirty:
            stack.ensure()
        path = fault_path(stack, where)
        note(f"{fault} at {where} ({path})")
        kept = hostile.plant_file_fault(path, fault, stack.place.outside)
        stack.dirty = True
        problems: list[tuple[str, str]] = []
        try:
            if where in ("record:runtime", "entry:stray"):
                stack.proxy.restart()  # the proxy reads these at its start
                stack.open_channels()
                problems += [("daemon", p) for p in stack.answers()]
            codes = []
            for endpoint, service, method, request in file_triggers(stack, where):
                problems += stack.observe(endpoint, service, method, request)
                codes.append(stack.last_code)
            problems += file_truth(stack, where, codes)
            problems += [("daemon", p) for p in stack.answers()]
            if (stack.place.outside / "file").read_bytes() != outside_file:
                problems.append(("file outside root", "a file outside the root was written through a link"))
        finally:
            for sock in kept:
                sock.close()
            # What no call was meant to repair goes before the next example.
            if where.startswith(("runtime-cli", "marker")) or fault == "socket" or \
                    (os.path.lexists(path) and not (path.is_file() and not path.is_symlink())):
                hostile.remove_any(path)
            if where == "entry:stray" and os.path.lexists(path.parent):
                hostile.remove_any(path.parent)
        event(f"{where} {fault}")
        if problems:
            kinds = sorted({k for k, _ in problems})
            raise finding(f"file {kinds[0]}")(f"{fault} at {where}: " + "\n".join(t for _, t in problems))

    one_fault()

@pytest.mark.parametrize("endpoint,service,method", TARGETS, ids=[f"{e}-{s.split('.')[-1]}.{m}" for e, s, m in TARGETS])
def test_hostile_request_on_a_full_disk(stack: Stack, endpoint: str, service: str, method: str):
    """Hypothesis' requests with every state directory full; then, with
    room again, the set-up is put back and every daemon answers."""
    if stack.dirty:
        stack.ensure()
    stack.setup_problems.clear()
    strategy = stack.strategy(service, method)
    if any(w in method for w in CHANGES_STATE):
        stack.dirty = True

    @FULL_SETTINGS
    @given(request=strategy)
    def one_request(request):
        __tracebackhide__ = True
        note(f"request ({type(request).DESCRIPTOR.full_name}), disks full: {one_line(request)}")
        stack.check(endpoint, service, method, request)

    failure = None
    with stack.disks_full():
        try:
            one_request()
        except Exception as exc:  # noqa: BLE001 - reported below, after the recovery check
            failure = exc
    problems = stack.answers()
    if problems:
        stack.revive()
        stack.open_channels()
    if stack.dirty:
        stack.ensure()  # with room again: what the full disk refused now succeeds
    report = [f"after {endpoint} {method} on a full disk, daemons do not answer: {problems}"] if problems else []
    # With room again nothing may still answer RESOURCE_EXHAUSTED: a daemon
    # that did not recover (other refusals of the idempotent set-up, such as
    # a live handler's name, are the normal pass's business).
    report += [f"[set-up, with room again] {d}" for d in stack.setup_defects]
    report += [f"[set-up, with room again] {p}" for p in stack.setup_problems if "RESOURCE_EXHAUSTED" in p]
    stack.setup_problems.clear()
    stack.setup_defects.clear()
    if report:
        raise AssertionError("\n\n".join(report)) from failure
    if failure is not None:
        raise failure


def test_stack_survived(stack: Stack):
    """After every RPC's examples: every daemon answers, no traceback in any
    log, and nothing outside the root is mounted, attached or created."""
    # With -s: the status codes each RPC's requests got (how deep they reached).
    for rpc, counts in sorted(stack.codes.items()):
        print(f"{rpc:50} " + " ".join(f"{k}={v}" for k, v in counts.most_common()))
    assert not stack.answers()
    text = "".join(p.read_text(errors="replace") for p in stack.root.path.glob("*.log"))
    found = hostile.tracebacks(text)
    unique = {hostile.crust_frame(t) + " " + t.splitlines()[-1].split(":")[0]: t for t in found}
    assert not found, f"{len(found)} tracebacks in the daemon logs, {len(unique)} distinct:\n" + "\n---\n".join(
        unique.values())
    now = hostile.HostState.take()
    assert not stack.before.new_mounts_outside(now, stack.path, stack.place.outside)
    assert not stack.before.new_loops_outside(now, stack.path, stack.place.outside)
    assert stack.place.outside_listing() == stack.outside_baseline
    assert not stack.place.etc_entries()
