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
test's own parser (tests/harness/hostile.py), not crust's.

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

The set-up is tests/harness/hostile_stack.py (its requests: tests/harness/hostile_templates.py
and tests/harness/hostile_requests.py); the host-side invariants are tests/harness/hostile.py.
Every test here shares the module's one set-up, so they stay in one module.

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
import os
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from crust.api import csi_pb2, handler_pb2, registry_pb2, runtime_pb2
from crust.sys import loop as sysloop
from tests.harness import hostile
from tests.harness import hostile_requests
from tests.harness.daemons import MIB, Root, kill_processes_rooted_under, mount_cap
from tests.harness.hostile_stack import CHANGES_STATE, Stack, Vol, finding, mount_small_disks, one_line
from tests.harness.hostile_templates import TARGETS


# Hypothesis keeps caches (and would keep its example database) in
# ./.hypothesis: a scratch directory instead, so the checkout stays clean.
_HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="crust-hypothesis-")
atexit.register(shutil.rmtree, _HYPOTHESIS_HOME, ignore_errors=True)
set_hypothesis_home_dir(_HYPOTHESIS_HOME)

EXAMPLES_PER_RPC = 50
FULL_EXAMPLES_PER_RPC = 10
MULTIPLIER = float(os.environ.get("CRUST_HOSTILE_EXAMPLES", "1") or 1)

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


@pytest.fixture(scope="module")
def stack():
    before = hostile.HostState.take()
    root = Root()
    place = hostile_requests.Place(root=root.path.resolve(), outside=hostile.scratch_outside(root.path))
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


def test_what_counts_as_another_tests_mount():
    """The mounts a request is blamed for: crun's moment-long bind of its own
    binary (a crun run beside this test) is not one; a daemon's mount on any
    other name outside the root is."""
    root, outside = Path("/tmp/crust-t-0123abcd"), Path("/tmp/crust-outside-0123abcd")
    assert hostile.foreign("/tmp/crun.ecRwD1", root, outside)
    assert hostile.foreign("/var/lib/containers/crun.0aZ9xy", root, outside)
    for ours in ("/tmp/crun.ecRwD1x", "/tmp/crun.ec/x", "/tmp/notcrun.ecRwD1x", "/etc/crun.conf",
                 str(outside / "x"), "/relative/x"):
        assert not hostile.foreign(ours, root, outside), ours
