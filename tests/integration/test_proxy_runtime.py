"""`crust proxy`'s runtime endpoint and its watched directory, with real parts.

Every test runs a real driver -> shim -> proxy stack (tests/harness.py) and
talks to the proxy's runtime socket (the KEP-2857 Runtime API and the handler
registry) the way the shim, a runtime handler (tests/handler_server.py) or a
KEP-style runtime CLI would. What is asserted is what can be observed from
outside: files, their modes and JSON on disk (the KEP layout under
--volumes-dir and the Kata direct-volume mirror under --kata-dir), gRPC status
codes and messages, subprocess argv, exit codes. Device paths are plain
strings: the proxy records them and never opens them. Everything lives below
the `root` fixture's temporary directory; handler servers and spawned
processes are stopped by the `env` fixture.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from tests.handler_server import HandlerServer, stats_response

Code = grpc.StatusCode
Req = runtime_pb2.RuntimeStageVolumeRequest
Usage = csi_pb2.VolumeUsage
GIB = 1024**3

REPO = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((REPO / "specs" / "mountinfo.schema.json").read_text())
KATA_KEYS = ("volume-type", "device", "fstype", "metadata", "options")
TOKENS = "csi.storage.k8s.io/serviceAccount.tokens"
SECRET = "eyJhbGciOi-SECRET-TOKEN-VALUE"


# -- independent expectations (not crust's own helpers) -------------------------------------


def sha(target: str) -> str:
    return hashlib.sha256(target.encode()).hexdigest()


def b64(target: str) -> str:
    return base64.urlsafe_b64encode(target.encode()).decode()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


_ANNOTATIONS = {"title", "description", "default", "$id", "$schema"}
_KNOWN = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "items", "const", "minimum"}
_TYPES = {"object": dict, "string": str, "array": list, "boolean": bool, "integer": int}


def validate(value, schema: dict, where: str = "$") -> None:
    """The part of JSON Schema specs/mountinfo.schema.json uses; an unknown
    keyword fails loudly instead of being ignored."""
    unknown = set(schema) - _KNOWN
    assert not unknown, f"the test's validator does not know {unknown} (at {where})"
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, _TYPES[kind]) and not (kind == "integer" and isinstance(value, bool))
        assert ok, f"{where}: {value!r} is not of type {kind}"
    if "const" in schema:
        assert value == schema["const"], f"{where}: {value!r} != const {schema['const']!r}"
    if "minimum" in schema:
        assert value >= schema["minimum"], f"{where}: {value!r} < minimum {schema['minimum']!r}"
    if kind == "object":
        for key in schema.get("required", ()):
            assert key in value, f"{where}: required key {key!r} missing"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                validate(item, props[key], f"{where}.{key}")
            elif extra is False:
                raise AssertionError(f"{where}: key {key!r} not allowed")
            elif isinstance(extra, dict):
                validate(item, extra, f"{where}.{key}")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{i}]")


def validate_mount_info(data: dict) -> None:
    validate(data, SCHEMA)
    try:
        import jsonschema  # not a dependency; used when present
    except ImportError:
        return
    jsonschema.Draft202012Validator(SCHEMA).validate(data)


def kata_parses(data: dict) -> None:
    """What Kata's direct-volume parsers need: these five keys (older
    runtime-rs versions require metadata and options too) with these types;
    unknown keys are ignored by both the Go and the Rust parser."""
    assert isinstance(data, dict)
    for key in ("volume-type", "device", "fstype"):
        assert isinstance(data[key], str) and data[key], key
    assert isinstance(data["metadata"], dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in data["metadata"].items())
    assert isinstance(data["options"], list) and all(isinstance(o, str) for o in data["options"])


def failure(call, *args, **kw) -> grpc.RpcError:
    try:
        call(*args, **kw)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded but was expected to fail")


def files_below(*dirs: Path) -> list[Path]:
    found = []
    for d in dirs:
        for base, subdirs, names in os.walk(d):
            found += [Path(base) / n for n in names + subdirs]
    return found


def wait_for(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


# -- the set-up -----------------------------------------------------------------------------


class Env:
    def __init__(self, root, proxy_extra: list[str]):
        self.root = root
        _, _, self.proxy = root.stack(proxy_extra=proxy_extra)
        self.channels: list[grpc.Channel] = []
        self.handlers: list[HandlerServer] = []
        self.procs: list[subprocess.Popen] = []
        self.connect()

    @property
    def path(self) -> Path:
        return self.root.path

    def connect(self) -> None:
        self.channel = self.proxy.runtime_channel()
        self.channels.append(self.channel)
        self.runtime = runtime_pb2_grpc.RuntimeStub(self.channel)
        self.registry = registry_pb2_grpc.RegistryStub(self.channel)

    def disconnect(self) -> None:
        """Close our channels first: a proxy stopping with a client still
        connected waits out its grace period."""
        for c in self.channels:
            c.close()
        self.channels.clear()

    def stop(self) -> None:
        self.disconnect()
        self.proxy.stop()

    def restart(self) -> None:
        self.disconnect()
        self.proxy.restart()
        self.connect()

    def start(self) -> None:
        self.proxy.start()
        self.connect()

    def close(self) -> None:
        for h in self.handlers:
            h.stop()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for c in self.channels:
            c.close()

    # paths ------------------------------------------------------------------------------------

    def target(self, name: str, create: bool = True) -> str:
        path = self.proxy.target(f"pod-{name}", f"pv-{name}")
        if create:
            path.mkdir(parents=True, exist_ok=True)
        return str(path)

    def entry(self, target: str) -> Path:
        return self.proxy.volumes_dir / sha(target)

    def mirror(self, target: str) -> Path:
        return self.proxy.kata_dir / b64(target)

    def info(self, target: str) -> dict:
        return json.loads((self.entry(target) / "mountInfo.json").read_bytes())

    # calls ------------------------------------------------------------------------------------

    @staticmethod
    def request(target: str, device: str = "/dev/crust-test0", fs_type: str = "ext4", **kw) -> Req:
        return Req(volume_type=Req.BLOCK, volume_target_path=target, volume_backing_path=device, fs_type=fs_type,
                   **kw)

    def stage(self, target: str, **kw) -> None:
        self.runtime.RuntimeStageVolume(self.request(target, **kw), timeout=10)

    def unstage(self, target: str) -> None:
        self.runtime.RuntimeUnstageVolume(runtime_pb2.RuntimeUnstageVolumeRequest(volume_target_path=target),
                                          timeout=10)

    def stats(self, target: str, timeout: float = 30) -> runtime_pb2.RuntimeGetVolumeStatsResponse:
        return self.runtime.RuntimeGetVolumeStats(
            runtime_pb2.RuntimeGetVolumeStatsRequest(volume_target_path=target), timeout=timeout)

    def expand(self, target: str, required: int, limit: int = 0, timeout: float = 30) -> int:
        return self.runtime.RuntimeExpandVolume(runtime_pb2.RuntimeExpandVolumeRequest(
            volume_target_path=target, capacity_range=csi_pb2.CapacityRange(required_bytes=required,
                                                                            limit_bytes=limit)),
            timeout=timeout).capacity_bytes

    def register(self, name: str, filesystems=("ext4", "xfs"), serve: bool = False, **kw) -> HandlerServer:
        h = HandlerServer(socket=self.path / f"h-{name}.sock", name=name, filesystems=list(filesystems), **kw)
        self.handlers.append(h)
        if serve:
            h.start()
        h.register(self.channel)
        return h

    def lease(self, handler: str) -> str:
        """The lease of the last handler registered here under that name ('' if none)."""
        return next((h.lease_id for h in reversed(self.handlers) if h.name == handler), "")

    def claim(self, target: str, handler: str, sandbox: str, pid: int = 0,
              lease: str | None = None) -> registry_pb2.ClaimVolumeResponse:
        return self.registry.ClaimVolume(registry_pb2.ClaimVolumeRequest(
            target_path=target, handler=handler, sandbox_id=sandbox, sandbox_pid=pid,
            lease_id=self.lease(handler) if lease is None else lease), timeout=10)

    def release(self, target: str, handler: str, sandbox: str, lease: str | None = None) -> None:
        self.registry.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(
            target_path=target, handler=handler, sandbox_id=sandbox,
            lease_id=self.lease(handler) if lease is None else lease), timeout=10)

    def volumes(self) -> dict[str, registry_pb2.DeferredVolume]:
        return {v.target_path: v for v in self.registry.ListVolumes(registry_pb2.ListVolumesRequest(),
                                                                    timeout=10).volumes}

    def handlers_listed(self) -> dict[str, registry_pb2.Handler]:
        return {h.name: h for h in self.registry.ListHandlers(registry_pb2.ListHandlersRequest(),
                                                              timeout=10).handlers}

    def claims(self) -> list[registry_pb2.Claim]:
        return list(self.registry.ListClaims(registry_pb2.ListClaimsRequest(), timeout=10).claims)

    def status(self, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint",
                               f"unix://{self.proxy.runtime_socket}", *extra],
                              capture_output=True, text=True, timeout=30, cwd=REPO)

    def sleeper(self) -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "60"])
        self.procs.append(p)
        return p

    def script(self, name: str, body: str) -> Path:
        path = self.path / "bin" / name
        path.parent.mkdir(exist_ok=True)
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path


@pytest.fixture
def env(root):
    """Start a stack: env() or env("--lease-seconds", "2")."""
    made: list[Env] = []

    def make(*proxy_extra: str) -> Env:
        e = Env(root, list(proxy_extra))
        made.append(e)
        return e

    try:
        yield make
    finally:
        for e in made:
            e.close()


# -- the watched directory ------------------------------------------------------------------


def test_stage_writes_a_kep_entry_and_a_kata_mirror_and_unstage_removes_both(env):
    e = env()
    target = e.target("a")
    e.stage(target, device="/dev/crust-test7", fs_type="xfs", mount_flags=["noatime", "discard"],
            volume_supplemental_group="2000", volume_supplemental_group_change_policy=Req.ON_ROOT_MISMATCH,
            volume_id="vol-123", capacity_bytes=3 * GIB, device_major=7, device_minor=42,
            volume_context={"fsType": "xfs", TOKENS: json.dumps({"": {"token": SECRET}})})

    entry = e.entry(target)
    assert sorted(os.listdir(e.proxy.volumes_dir)) == [sha(target)]
    assert stat.S_ISDIR(os.lstat(entry).st_mode) and mode(entry) == 0o700
    assert os.listdir(entry) == ["mountInfo.json"]
    f = entry / "mountInfo.json"
    assert stat.S_ISREG(os.lstat(f).st_mode) and mode(f) == 0o600 and os.lstat(f).st_uid == 0
    raw = f.read_bytes()
    data = json.loads(raw)
    validate_mount_info(data)
    unpublished = set(data) - set(SCHEMA["properties"])
    assert not unpublished, f"keys the schema does not publish: {unpublished}"
    # Kata's keys with Kata's meaning.
    assert data["volume-type"] == "block"
    assert data["device"] == "/dev/crust-test7"
    assert data["fstype"] == "xfs"
    assert data["metadata"] == {"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"}
    assert data["options"] == ["noatime", "discard"]
    # crust's keys.
    assert data["target-path"] == target
    assert data["volume-id"] == "vol-123" and data["capacity-bytes"] == 3 * GIB
    assert (data["device-major"], data["device-minor"]) == (7, 42)
    assert data["readonly"] is False
    # No secret on disk: the service account token kubelet may put in the
    # volume context stays out of the entry, the mirror and the records.
    assert data["volume-context"] == {"fsType": "xfs"}
    for path in files_below(e.proxy.volumes_dir, e.proxy.kata_dir, e.proxy.state_dir):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), f"the token reached {path}"

    mirror = e.mirror(target)
    assert sorted(os.listdir(e.proxy.kata_dir)) == [b64(target)]
    assert stat.S_ISDIR(os.lstat(mirror).st_mode) and mode(mirror) == 0o700
    assert os.listdir(mirror) == ["mountInfo.json"], "no sandbox marker before a claim"
    assert mode(mirror / "mountInfo.json") == 0o600
    kata = json.loads((mirror / "mountInfo.json").read_bytes())
    kata_parses(kata)
    assert {k: kata[k] for k in KATA_KEYS} == {k: data[k] for k in KATA_KEYS}

    # Idempotent: the same request again changes nothing.
    e.stage(target, device="/dev/crust-test7", fs_type="xfs", mount_flags=["noatime", "discard"],
            volume_supplemental_group="2000", volume_supplemental_group_change_policy=Req.ON_ROOT_MISMATCH,
            volume_id="vol-123", capacity_bytes=3 * GIB, device_major=7, device_minor=42,
            volume_context={"fsType": "xfs", TOKENS: json.dumps({"": {"token": SECRET}})})
    assert f.read_bytes() == raw
    assert sorted(os.listdir(e.proxy.volumes_dir)) == [sha(target)]
    assert list(e.volumes()) == [target]
    assert e.volumes()[target].state == "unclaimed" and e.volumes()[target].device == "/dev/crust-test7"

    e.unstage(target)
    assert os.listdir(e.proxy.volumes_dir) == [] and os.listdir(e.proxy.kata_dir) == []
    assert e.volumes() == {}
    assert not list((e.proxy.state_dir / "volumes").glob("*.json"))
    e.unstage(target)  # idempotent


def test_read_only_reaches_kata_as_the_ro_option(env):
    """Kata derives read-only from "ro" in options (it ignores crust's
    "readonly" key), so a read-only volume must carry it there."""
    e = env()
    target = e.target("ro")
    e.stage(target, mount_flags=["noatime"], readonly=True)
    data = e.info(target)
    assert data["readonly"] is True
    assert "ro" in data["options"] and "noatime" in data["options"] and "rw" not in data["options"]
    kata = json.loads((e.mirror(target) / "mountInfo.json").read_bytes())
    kata_parses(kata)
    assert "ro" in kata["options"]

    rw = e.target("rw")
    e.stage(rw, mount_flags=["noatime"])
    assert "ro" not in e.info(rw)["options"] and e.info(rw)["readonly"] is False


def test_kata_name_over_255_bytes_writes_the_entry_and_reports_the_mirror_error(env):
    e = env()
    target = e.target("x" * 200, create=False)
    assert len(b64(target).encode()) > 255
    e.stage(target)
    assert (e.entry(target) / "mountInfo.json").is_file()
    validate_mount_info(e.info(target))
    assert os.listdir(e.proxy.kata_dir) == [], "no mirror (and no truncated name) for an over-long Kata name"

    error = e.volumes()[target].kata_mirror_error
    assert "255" in error and "Kata" in error and target in error
    text = e.status()
    assert text.returncode == 0, text.stderr
    assert "kata mirror:" in text.stdout and "255" in text.stdout
    as_json = e.status("--json")
    assert as_json.returncode == 0, as_json.stderr
    (listed,) = json.loads(as_json.stdout)["volumes"]
    assert listed["target_path"] == target and listed["kata_mirror_error"] == error

    # Claims and unstage still work without a mirror.
    e.register("h")
    e.claim(target, "h", "sb-1")
    assert os.listdir(e.proxy.kata_dir) == []
    e.release(target, "h", "sb-1")
    e.unstage(target)
    assert os.listdir(e.proxy.volumes_dir) == []

    # A short name next to it is mirrored as usual.
    short = e.target("short", create=False)
    e.stage(short)
    assert os.listdir(e.proxy.kata_dir) == [b64(short)]
    assert e.volumes()[short].kata_mirror_error == ""


def test_a_reader_never_sees_a_partial_file(env):
    e = env()
    target = e.target("atomic")
    variants = [dict(mount_flags=["noatime"], volume_supplemental_group="1000"),
                dict(mount_flags=["nodiratime", "discard", "lazytime"], volume_supplemental_group="2000",
                     volume_context={f"k{i}": "v" * 200 for i in range(20)})]
    canonical = e.entry(target) / "mountInfo.json"
    mirror = e.mirror(target) / "mountInfo.json"
    expected = {canonical: set(), mirror: set()}
    for v in variants:
        e.stage(target, **v)
        for path in expected:
            expected[path].add(path.read_bytes())
    assert all(len(contents) == 2 for contents in expected.values())

    stop = threading.Event()
    bad: list[str] = []
    seen = {canonical: set(), mirror: set()}
    reads = [0]

    def reader():
        while not stop.is_set():
            for path in (canonical, mirror):
                try:
                    content = path.read_bytes()
                except FileNotFoundError:
                    bad.append(f"{path.name} missing")
                    continue
                reads[0] += 1
                if content not in expected[path]:
                    bad.append(f"unexpected content of {path}: {content[:80]!r}")
                    continue
                json.loads(content)
                seen[path].add(content)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(300):
            e.stage(target, **variants[i % 2])
    finally:
        stop.set()
        thread.join()
    assert not bad, bad[:5]
    assert reads[0] > 100
    assert all(len(s) == 2 for s in seen.values()), "the reader saw both versions come and go"


def test_sigkill_mid_burst_leaves_whole_files_and_a_restart_leaves_no_temporaries(env):
    e = env()
    targets = [e.target(f"burst{i}") for i in range(16)]
    acknowledged: set[str] = set()
    stop = threading.Event()

    def writer(n: int):
        with e.proxy.runtime_channel() as ch:
            stub = runtime_pb2_grpc.RuntimeStub(ch)
            i = 0
            while not stop.is_set():
                t = targets[(n * 5 + i) % len(targets)]
                try:
                    stub.RuntimeStageVolume(e.request(t, mount_flags=[f"commit={i % 7 + 1}"],
                                                      volume_context={"n": str(i)}), timeout=5)
                except grpc.RpcError:
                    return
                acknowledged.add(t)
                i += 1

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    try:
        assert wait_for(lambda: len(acknowledged) >= 8, 10)
        time.sleep(0.3)
        e.proxy.proc.send_signal(signal.SIGKILL)
        e.proxy.proc.wait(10)
    finally:
        stop.set()
        for t in threads:
            t.join()
    e.stop()

    # Whatever the kill interrupted, every mountInfo.json is complete.
    for root in (e.proxy.volumes_dir, e.proxy.kata_dir):
        for d in os.listdir(root):
            f = root / d / "mountInfo.json"
            if f.exists():
                data = json.loads(f.read_bytes())
                kata_parses(data)
                if root == e.proxy.volumes_dir:
                    validate_mount_info(data)
                    assert sha(data["target-path"]) == d

    # A temporary of a write the kill cut short (partial content), in an
    # entry, in the mirror and among the records.
    some = sorted(acknowledged)[0]
    (e.entry(some) / ".mountInfo.json.0123456789ab.tmp").write_bytes(b'{"volume-type": "block", "dev')
    (e.mirror(some) / ".mountInfo.json.0123456789ab.tmp").write_bytes(b'{"volume-type"')
    (e.proxy.state_dir / "volumes" / f".{sha(some)}.json.abcdef.tmp").write_bytes(b'{"target_pa')

    e.start()
    leftovers = [p for p in files_below(e.proxy.volumes_dir, e.proxy.kata_dir, e.proxy.state_dir)
                 if p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    listed = e.volumes()
    assert acknowledged <= set(listed), "an acknowledged stage was lost"
    assert sorted(os.listdir(e.proxy.volumes_dir)) == sorted(sha(t) for t in listed)
    assert sorted(os.listdir(e.proxy.kata_dir)) == sorted(b64(t) for t in listed)
    for t in listed:
        assert os.listdir(e.entry(t)) == ["mountInfo.json"]
        assert os.listdir(e.mirror(t)) == ["mountInfo.json"]
        validate_mount_info(e.info(t))
        assert e.info(t)["target-path"] == t


# -- symlinks -------------------------------------------------------------------------------


def test_planted_symlinks_are_never_followed(env):
    e = env()
    target = e.target("links")
    elsewhere = e.path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "decoy").write_text("keep me")
    kata_elsewhere = e.path / "kata-elsewhere"
    kata_elsewhere.mkdir()
    os.symlink(elsewhere, e.entry(target))
    os.symlink(kata_elsewhere, e.mirror(target))

    e.stage(target)
    for d in (e.entry(target), e.mirror(target)):
        assert stat.S_ISDIR(os.lstat(d).st_mode) and mode(d) == 0o700, f"{d} is not a real directory"
        assert os.listdir(d) == ["mountInfo.json"]
    assert os.listdir(elsewhere) == ["decoy"] and (elsewhere / "decoy").read_text() == "keep me"
    assert os.listdir(kata_elsewhere) == []

    # A symlink in place of mountInfo.json is replaced, its target untouched.
    f = e.entry(target) / "mountInfo.json"
    f.unlink()
    os.symlink(elsewhere / "decoy", f)
    e.stage(target, mount_flags=["noatime"])
    assert stat.S_ISREG(os.lstat(f).st_mode) and e.info(target)["options"] == ["noatime"]
    assert (elsewhere / "decoy").read_text() == "keep me"

    # A symlinked runtime-cli is ignored: the CLI never runs.
    ran = e.path / "cli-ran"
    cli = e.script("rt-cli", f'echo "$@" > {ran}\necho \'{{"usage": []}}\'\n')
    (e.path / "cli-path").write_text(str(cli))
    os.symlink(e.path / "cli-path", e.entry(target) / "runtime-cli")
    rsp = e.stats(target)
    assert not ran.exists(), "the proxy followed a symlinked runtime-cli"
    assert rsp.volume_condition.abnormal is False and "starting" in rsp.volume_condition.message

    # Unstage through a planted symlink removes the link, not what it points to.
    e.unstage(target)
    os.symlink(elsewhere, e.entry(target))
    e.stage(target)
    e.unstage(target)
    assert not os.path.lexists(e.entry(target)) and not os.path.lexists(e.mirror(target))
    assert os.listdir(elsewhere) == ["decoy"]


def test_bad_target_paths_are_invalid_argument_and_write_nothing(env):
    e = env()
    kubelet = e.proxy.kubelet_root
    elsewhere = e.path / "elsewhere"
    elsewhere.mkdir()
    # Parent of the target is a symlink out of the kubelet root.
    parent = kubelet / "pods" / "p1" / "volumes" / "kubernetes.io~csi" / "pv1"
    parent.parent.mkdir(parents=True)
    os.symlink(elsewhere, parent)
    # An ancestor is a symlink out of the root and the directories below it do not exist yet.
    (kubelet / "pods").mkdir(exist_ok=True)
    os.symlink(elsewhere, kubelet / "pods" / "p2")
    bad = {
        "relative": "kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount",
        "dotdot": f"{kubelet}/pods/p/../../../elsewhere/mount",
        "outside": str(elsewhere / "mount"),
        "the root itself": str(kubelet),
        "beside the root": f"{kubelet}-other/pods/p/mount",
        "parent symlink": str(parent / "mount"),
        "ancestor symlink": str(kubelet / "pods" / "p2" / "volumes" / "kubernetes.io~csi" / "pv2" / "mount"),
        "nul": f"{kubelet}/pods/p\x00/mount",
        "huge": f"{kubelet}/pods/" + "a" * 5000,
        "empty": "",
    }
    e.register("h")
    problems = []
    for why, path in bad.items():
        checks = [
            ("RuntimeStageVolume", "volume_target_path", lambda p=path: e.stage(p)),
            ("RuntimeUnstageVolume", "volume_target_path", lambda p=path: e.unstage(p)),
            ("RuntimeGetVolumeStats", "volume_target_path", lambda p=path: e.stats(p)),
            ("RuntimeExpandVolume", "volume_target_path", lambda p=path: e.expand(p, GIB)),
            ("ClaimVolume", "target_path", lambda p=path: e.claim(p, "h", "sb-1")),
            ("ReleaseVolume", "target_path", lambda p=path: e.release(p, "h", "sb-1")),
        ]
        for rpc, field, call in checks:
            try:
                call()
                problems.append(f"{rpc} accepted the {why} path")
                continue
            except grpc.RpcError as exc:
                if exc.code() != Code.INVALID_ARGUMENT or field not in exc.details():
                    problems.append(f"{rpc} {why}: {exc.code().name} {exc.details()!r}")
    assert not problems, "\n".join(problems)
    assert os.listdir(e.proxy.volumes_dir) == [] and os.listdir(e.proxy.kata_dir) == []
    assert not list((e.proxy.state_dir / "volumes").glob("*.json"))
    assert os.listdir(elsewhere) == []
    assert e.volumes() == {}


def test_bad_stage_fields_are_invalid_argument_naming_the_field(env):
    e = env()
    target = e.target("fields")
    cases = {
        "volume_backing_path": e.request(target, device="dev/loop3"),
        "fs_type": e.request(target, fs_type="ntfs"),
        "volume_type": Req(volume_type=Req.NETWORK, volume_target_path=target, volume_backing_path="/dev/x",
                           fs_type="ext4"),
        "mount_flags": e.request(target, mount_flags=["noatime,suid"]),
        "volume_supplemental_group": e.request(target, volume_supplemental_group="wheel"),
    }
    for field, request in cases.items():
        exc = failure(e.runtime.RuntimeStageVolume, request, timeout=10)
        assert exc.code() == Code.INVALID_ARGUMENT and field in exc.details(), (field, exc.details())
    assert os.listdir(e.proxy.volumes_dir) == [] and os.listdir(e.proxy.kata_dir) == []


# -- registry: leases -----------------------------------------------------------------------


def test_register_heartbeat_and_lease_expiry(env):
    e = env("--lease-seconds", "2")
    rsp = e.registry.RegisterHandler(registry_pb2.RegisterHandlerRequest(
        name="mountns", endpoint=f"unix://{e.path}/mountns.sock", filesystems=["ext4"], features=["stats"]),
        timeout=10)
    assert rsp.lease_id and rsp.lease_seconds == 2
    beat = registry_pb2.HeartbeatRequest(name="mountns", lease_id=rsp.lease_id)

    for _ in range(6):  # 3 s of heartbeats: longer than the lease
        assert e.registry.Heartbeat(beat, timeout=10).lease_seconds == 2
        time.sleep(0.5)
    h = e.handlers_listed()["mountns"]
    assert not h.lease_expired and h.lease_age_seconds < 1.5
    assert list(h.filesystems) == ["ext4"] and h.endpoint == f"unix://{e.path}/mountns.sock"

    wrong = failure(e.registry.Heartbeat, registry_pb2.HeartbeatRequest(name="mountns", lease_id="nope"), timeout=10)
    assert wrong.code() == Code.PERMISSION_DENIED and "lease" in wrong.details()
    unknown = failure(e.registry.Heartbeat, registry_pb2.HeartbeatRequest(name="other", lease_id=rsp.lease_id),
                      timeout=10)
    assert unknown.code() == Code.NOT_FOUND and "register again" in unknown.details()

    time.sleep(2.6)
    h = e.handlers_listed()["mountns"]
    assert h.lease_expired and h.lease_age_seconds > 2
    text = e.status()
    assert text.returncode == 0 and "lease expired" in text.stdout, text.stdout + text.stderr

    e.registry.Heartbeat(beat, timeout=10)
    assert not e.handlers_listed()["mountns"].lease_expired

    for request, field in (
            (registry_pb2.RegisterHandlerRequest(name="a/b", endpoint=f"unix://{e.path}/x.sock"), "name"),
            (registry_pb2.RegisterHandlerRequest(name="", endpoint=f"unix://{e.path}/x.sock"), "name"),
            (registry_pb2.RegisterHandlerRequest(name="x", endpoint="x.sock"), "endpoint"),
            (registry_pb2.RegisterHandlerRequest(name="x"), "endpoint")):
        exc = failure(e.registry.RegisterHandler, request, timeout=10)
        assert exc.code() == Code.INVALID_ARGUMENT and field in exc.details(), exc.details()


def test_a_restart_keeps_leases_and_claims(env):
    """The lease is the handler's identity and outlives the proxy: after a
    restart the holder goes on with it, and nobody else takes the name."""
    e = env()
    target, other = e.target("keep"), e.target("other")
    e.stage(target)
    e.stage(other)
    h = e.register("kata")
    e.claim(target, "kata", "sb-1", pid=0)
    (before,) = e.claims()
    records = sorted(os.listdir(e.proxy.state_dir / "handlers"))
    assert records == ["kata.json"]
    assert h.lease_id not in (e.proxy.state_dir / "handlers" / "kata.json").read_text(), "only a hash is kept"

    e.restart()
    h.heartbeat(e.channel)
    assert list(e.handlers_listed()) == ["kata"]
    (after,) = e.claims()
    assert after == before and after.target_path == target and after.sandbox_id == "sb-1"
    assert e.volumes()[target].state == "claimed"
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]

    # Someone else asking for the name while its holder lives is refused.
    impostor = HandlerServer(socket=e.path / "impostor.sock", name="kata", filesystems=["ext4"])
    exc = failure(impostor.register, e.channel)
    assert exc.code() == Code.ALREADY_EXISTS and "kata" in exc.details()
    assert e.handlers_listed()["kata"].endpoint == h.endpoint

    old_lease = h.lease_id
    rsp = h.register(e.channel, keep_lease=True)
    assert rsp.lease_id == old_lease
    e.claim(target, "kata", "sb-1")  # the same sandbox again: fine
    exc = failure(e.claim, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()


# -- claims ---------------------------------------------------------------------------------


def test_claims_are_single_sandbox_and_marked_for_kata(env):
    e = env()
    target = e.target("claim")
    e.stage(target, fs_type="ext4")

    exc = failure(e.claim, target, "ghost", "sb-1")
    assert exc.code() == Code.NOT_FOUND and "ghost" in exc.details() and "register" in exc.details()
    e.register("xfs-only", filesystems=["xfs"])
    exc = failure(e.claim, target, "xfs-only", "sb-1")
    assert exc.code() == Code.FAILED_PRECONDITION and "ext4" in exc.details()
    exc = failure(e.claim, e.target("never-staged"), "xfs-only", "sb-1")
    assert exc.code() == Code.NOT_FOUND
    assert os.listdir(e.mirror(target)) == ["mountInfo.json"]

    e.register("kata")
    rsp = e.claim(target, "kata", "sb-1", pid=os.getpid())
    assert json.loads(rsp.mount_info_json) == e.info(target)
    marker = e.mirror(target) / "sb-1"
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]
    assert stat.S_ISREG(os.lstat(marker).st_mode) and marker.stat().st_size == 0
    assert os.listdir(e.entry(target)) == ["mountInfo.json"], "the marker belongs to the Kata layout only"
    e.claim(target, "kata", "sb-1", pid=os.getpid())  # idempotent
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]

    exc = failure(e.claim, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details() and "kata" in exc.details()
    e.register("mountns")
    exc = failure(e.claim, target, "mountns", "sb-9")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()

    for sandbox in ("a/b", "..", ".", ".hidden", "", "mountInfo.json", "x" * 256, "nul\x00"):
        exc = failure(e.claim, target, "kata", sandbox)
        assert exc.code() == Code.INVALID_ARGUMENT and "sandbox_id" in exc.details(), (sandbox, exc.details())
    exc = failure(e.claim, target, "kata", "sb-1", pid=-1)
    assert exc.code() == Code.INVALID_ARGUMENT and "sandbox_pid" in exc.details()
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]
    assert sorted(os.listdir(e.proxy.kata_dir)) == [b64(target)]

    (claim,) = e.claims()
    assert (claim.target_path, claim.handler, claim.sandbox_id, claim.sandbox_pid) == \
        (target, "kata", "sb-1", os.getpid())
    assert e.volumes()[target].state == "claimed"

    # Restaging (kubelet retries) keeps the claim and the marker; a different
    # device while a live sandbox holds the volume is refused.
    e.stage(target, fs_type="ext4")
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-1"]
    assert len(e.claims()) == 1
    exc = failure(e.stage, target, device="/dev/crust-other")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()
    assert e.info(target)["device"] == "/dev/crust-test0"
    exc = failure(e.unstage, target)
    assert exc.code() == Code.UNAVAILABLE and "sb-1" in exc.details()
    assert (e.entry(target) / "mountInfo.json").exists()

    exc = failure(e.release, target, "kata", "sb-2")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-1" in exc.details()
    e.release(target, "kata", "sb-1")
    assert os.listdir(e.mirror(target)) == ["mountInfo.json"]
    assert e.claims() == [] and e.volumes()[target].state == "unclaimed"
    e.release(target, "kata", "sb-1")  # idempotent
    e.release(e.target("never-staged"), "kata", "sb-1")

    e.claim(target, "mountns", "sb-2")
    assert sorted(os.listdir(e.mirror(target))) == ["mountInfo.json", "sb-2"]
    (claim,) = e.claims()
    assert (claim.handler, claim.sandbox_id) == ("mountns", "sb-2")


def test_concurrent_restaging_never_drops_a_claim(env):
    """kubelet may publish a target again while a handler claims it: the
    claim must survive, or a second sandbox could mount the same file system."""
    e = env()
    target = e.target("race")
    e.stage(target)
    e.register("kata")
    e.register("intruder")
    stop = threading.Event()
    errors: list[str] = []

    def restage():
        with e.proxy.runtime_channel() as ch:
            stub = runtime_pb2_grpc.RuntimeStub(ch)
            while not stop.is_set():
                try:
                    stub.RuntimeStageVolume(e.request(target), timeout=10)
                except grpc.RpcError as exc:
                    errors.append(f"{exc.code().name} {exc.details()}")
                    return

    threads = [threading.Thread(target=restage) for _ in range(3)]
    for t in threads:
        t.start()
    lost = []
    try:
        for i in range(40):
            sandbox = f"sb-{i}"
            e.claim(target, "kata", sandbox)
            time.sleep(0.01)
            claims = e.claims()
            if [(c.handler, c.sandbox_id) for c in claims] != [("kata", sandbox)]:
                lost.append((sandbox, [(c.handler, c.sandbox_id) for c in claims]))
            try:
                e.claim(target, "intruder", f"intruder-{i}")
                lost.append((sandbox, "a second sandbox could claim"))
                e.release(target, "intruder", f"intruder-{i}")
            except grpc.RpcError as exc:
                assert exc.code() == Code.FAILED_PRECONDITION
            e.release(target, "kata", sandbox)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert not lost, lost[:5]
    # The records agree with memory: after a restart the last state is the same.
    e.claim(target, "kata", "final")
    e.restart()
    assert [(c.handler, c.sandbox_id) for c in e.claims()] == [("kata", "final")]


def test_a_gone_holder_can_be_taken_over_and_unstaged(env):
    e = env("--lease-seconds", "2")
    taken, freed = e.target("taken"), e.target("freed")
    e.stage(taken)
    e.stage(freed)
    sandbox = e.sleeper()
    e.register("old")
    e.claim(taken, "old", "sb-old", pid=sandbox.pid)
    e.claim(freed, "old", "sb-old2", pid=sandbox.pid)
    new = e.register("new")

    # The old handler stops heartbeating; its sandbox process still runs.
    deadline = time.monotonic() + 2.6
    while time.monotonic() < deadline:
        new.heartbeat(e.channel)
        time.sleep(0.3)
    assert e.handlers_listed()["old"].lease_expired
    new.heartbeat(e.channel)
    exc = failure(e.claim, taken, "new", "sb-new")
    assert exc.code() == Code.FAILED_PRECONDITION and "sb-old" in exc.details()
    assert e.volumes()[taken].state == "claimed"
    exc = failure(e.unstage, freed)
    assert exc.code() == Code.UNAVAILABLE and "sb-old2" in exc.details()
    assert sorted(os.listdir(e.mirror(taken))) == ["mountInfo.json", "sb-old"]

    sandbox.kill()
    sandbox.wait()  # reaped: a zombie would still answer kill(pid, 0)
    assert e.volumes()[taken].state == "holder-gone"
    new.heartbeat(e.channel)
    e.claim(taken, "new", "sb-new", pid=0)
    assert sorted(os.listdir(e.mirror(taken))) == ["mountInfo.json", "sb-new"]
    assert {(c.target_path, c.handler, c.sandbox_id) for c in e.claims()} == \
        {(taken, "new", "sb-new"), (freed, "old", "sb-old2")}
    assert e.volumes()[taken].state == "claimed"

    e.unstage(freed)
    assert not os.path.lexists(e.entry(freed)) and not os.path.lexists(e.mirror(freed))
    assert freed not in e.volumes()


# -- routing: handler and runtime-cli ------------------------------------------------------


def test_stats_and_expansion_are_answered_by_the_claiming_handler(env):
    e = env()
    target, unknown = e.target("routed"), e.target("unknown")
    e.stage(target)
    e.stage(unknown)
    h = e.register("kata", serve=True, stats={target: stats_response(10 * GIB, 3 * GIB, inodes=5000,
                                                                     inodes_used=17, message="inside sb-1")})
    e.claim(target, "kata", "sb-1")
    e.claim(unknown, "kata", "sb-2")

    rsp = e.stats(target)
    assert [(u.unit, u.total, u.used, u.available) for u in rsp.usage] == [
        (Usage.BYTES, 10 * GIB, 3 * GIB, 7 * GIB), (Usage.INODES, 5000, 17, 4983)]
    assert rsp.volume_condition.abnormal is False and rsp.volume_condition.message == "inside sb-1"
    assert ("GetVolumeStats", target, "sb-1") in h.calls

    assert e.expand(target, 5 * GIB, 6 * GIB) == 5 * GIB
    (req,) = h.expand_requests
    assert (req.target_path, req.sandbox_id) == (target, "sb-1")
    assert (req.capacity_range.required_bytes, req.capacity_range.limit_bytes) == (5 * GIB, 6 * GIB)

    # The handler's own error comes back unchanged.
    exc = failure(e.stats, unknown)
    assert exc.code() == Code.NOT_FOUND and "no sandbox of kata mounts" in exc.details()

    h.stop()
    for call in (lambda: e.stats(target), lambda: e.expand(target, 6 * GIB)):
        started = time.monotonic()
        exc = failure(call)
        assert time.monotonic() - started < 12
        assert exc.code() == Code.UNAVAILABLE and "kata" in exc.details(), exc.details()


def test_a_restarted_handler_is_answered_at_once_after_a_long_outage(env):
    """The proxy's channel to a dead handler backs off between connection
    attempts; the restarted handler must not wait out that backoff."""
    e = env()
    target = e.target("outage")
    e.stage(target)
    h = e.register("kata", serve=True, default_stats=stats_response(GIB, 1))
    e.claim(target, "kata", "sb-1")
    assert e.stats(target).usage[0].total == GIB

    h.stop()
    outage = time.monotonic() + 8  # gRPC's stock backoff would be ~5 s by now
    while time.monotonic() < outage:
        assert failure(e.stats, target).code() == Code.UNAVAILABLE
        time.sleep(0.2)
    h.start()
    h.register(e.channel, keep_lease=True)  # the restarted handler, with its lease
    assert e.stats(target).usage[0].total == GIB  # the first call, no retry
    # Back without a new lease (the same handler's server came back): within a second.
    h.stop()
    assert failure(e.stats, target).code() == Code.UNAVAILABLE
    h.start()
    deadline = time.monotonic() + 3
    while True:
        try:
            assert e.stats(target).usage[0].total == GIB
            break
        except grpc.RpcError:
            assert time.monotonic() < deadline, "the proxy did not reconnect within 3 s"
            time.sleep(0.1)


def test_runtime_cli_answers_for_an_unclaimed_volume(env):
    e = env()
    target = e.target("cli")
    e.stage(target)
    argv_file = e.path / "cli-argv"
    cli = e.script("rt-cli", f"""\
printf '%s\\n' "$0" "$@" > {argv_file}
case "$2" in
  stats) echo '{{"usage": [{{"unit": "BYTES", "total": "5000", "used": "1200", "available": "3800"}},
                          {{"unit": "INODES", "total": "64", "used": "3", "available": "61"}}],
                "volumeCondition": {{"abnormal": true, "message": "cli says so"}}}}' ;;
  resize) printf '{{"capacity_bytes": %s}}\\n' "$4" ;;
esac
""")
    (e.entry(target) / "runtime-cli").write_text(f"{cli}\n")

    rsp = e.stats(target)
    assert argv_file.read_text().splitlines() == [str(cli), "crust", "stats", target]
    assert [(u.unit, u.total, u.used, u.available) for u in rsp.usage] == [
        (Usage.BYTES, 5000, 1200, 3800), (Usage.INODES, 64, 3, 61)]
    assert rsp.volume_condition.abnormal is True and rsp.volume_condition.message == "cli says so"

    assert e.expand(target, 2 * GIB, 3 * GIB) == 2 * GIB
    assert argv_file.read_text().splitlines() == [str(cli), "crust", "resize", target, str(2 * GIB), str(3 * GIB)]

    garbage = e.script("garbage-cli", "echo 'this is not { json'\n")
    (e.entry(target) / "runtime-cli").write_text(str(garbage))
    exc = failure(e.stats, target)
    assert exc.code() == Code.INTERNAL and "JSON" in exc.details() and str(garbage) in exc.details()
    exc = failure(e.expand, target, GIB)
    assert exc.code() == Code.INTERNAL

    failing = e.script("failing-cli", "echo 'sandbox is gone' >&2\nexit 3\n")
    (e.entry(target) / "runtime-cli").write_text(str(failing))
    exc = failure(e.stats, target)
    assert exc.code() == Code.UNAVAILABLE and "sandbox is gone" in exc.details()

    # Not an absolute path: not a CLI.
    (e.entry(target) / "runtime-cli").write_text("rt-cli")
    rsp = e.stats(target)
    assert rsp.volume_condition.abnormal is False and "starting" in rsp.volume_condition.message

    # Once a handler claims the volume, the handler answers, not the CLI.
    (e.entry(target) / "runtime-cli").write_text(str(cli))
    argv_file.unlink()
    e.register("kata", serve=True, default_stats=stats_response(100, 1))
    e.claim(target, "kata", "sb-1")
    assert e.stats(target).usage[0].total == 100
    assert not argv_file.exists()


def test_a_runtime_cli_that_hangs_is_unavailable_after_its_timeout(env):
    e = env()
    target = e.target("slow")
    e.stage(target)
    pid_file = e.path / "slow-cli.pid"
    slow = e.script("slow-cli", f"echo $$ > {pid_file}\nexec sleep 30\n")
    (e.entry(target) / "runtime-cli").write_text(str(slow))
    started = time.monotonic()
    try:
        exc = failure(e.stats, target, timeout=30)
        took = time.monotonic() - started
        assert exc.code() == Code.UNAVAILABLE and "did not answer" in exc.details(), exc.details()
        assert 5 < took < 15, took
        pid = int(pid_file.read_text())
        assert not Path(f"/proc/{pid}").exists(), "the proxy left the CLI running"
    finally:
        if pid_file.exists() and Path(f"/proc/{pid_file.read_text().strip()}").exists():
            cmdline = Path(f"/proc/{pid_file.read_text().strip()}/cmdline").read_bytes()
            if b"sleep" in cmdline:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_an_unclaimed_volume_without_cli_is_starting_within_the_grace_period(env):
    e = env()
    target = e.target("starting")
    e.stage(target)
    rsp = e.stats(target)
    assert list(rsp.usage) == []
    assert rsp.volume_condition.abnormal is False and "still starting" in rsp.volume_condition.message
    exc = failure(e.expand, target, GIB)
    assert exc.code() == Code.UNAVAILABLE and "not mounted by a sandbox yet" in exc.details()
    exc = failure(e.stats, e.target("never-staged"))
    assert exc.code() == Code.NOT_FOUND


def test_an_unclaimed_volume_after_the_grace_period_is_failed_precondition(env):
    e = env("--claim-grace-seconds", "0")
    target = e.target("late")
    e.stage(target)
    time.sleep(0.05)
    exc = failure(e.stats, target)
    assert exc.code() == Code.FAILED_PRECONDITION and "no sandbox has claimed" in exc.details()
    exc = failure(e.expand, target, GIB)
    assert exc.code() == Code.FAILED_PRECONDITION and target in exc.details()


# -- the sweep ------------------------------------------------------------------------------


def test_the_sweep_removes_only_entries_nobody_needs(env):
    e = env("--sweep-interval", "1")
    gone, kept, held = e.target("gone"), e.target("kept"), e.target("held")
    for t in (gone, kept, held):
        e.stage(t)
    h = e.register("kata")
    e.claim(held, "kata", "sb-1")
    assert len(e.volumes()) == 3
    os.rmdir(gone)
    os.rmdir(held)

    def swept():
        return not os.path.lexists(e.entry(gone)) and not os.path.lexists(e.mirror(gone)) \
            and gone not in e.volumes()

    assert wait_for(swept, 6), "the entry of a target that is gone was not swept"
    assert not (e.proxy.state_dir / "volumes" / f"{sha(gone)}.json").exists()
    time.sleep(1.5)  # at least one more sweep
    h.heartbeat(e.channel)
    assert set(e.volumes()) == {kept, held}
    for t in (kept, held):
        assert (e.entry(t) / "mountInfo.json").is_file() and (e.mirror(t) / "mountInfo.json").is_file()
    assert sorted(os.listdir(e.mirror(held))) == ["mountInfo.json", "sb-1"]


def test_the_sweep_goes_through_many_volumes(env):
    """More volumes than one sweep batch: every gone target is swept, every
    other one kept."""
    e = env("--sweep-interval", "1")
    targets = [e.target(f"many{i:03d}") for i in range(150)]
    for t in targets:
        e.stage(t)
    for t in targets[::2]:
        os.rmdir(t)
    assert wait_for(lambda: len(e.volumes()) == 75, 10), len(e.volumes())
    assert sorted(e.volumes()) == sorted(targets[1::2])
    assert sorted(os.listdir(e.proxy.volumes_dir)) == sorted(sha(t) for t in targets[1::2])
    assert sorted(os.listdir(e.proxy.kata_dir)) == sorted(b64(t) for t in targets[1::2])


def test_a_restart_rewrites_only_the_entries_that_are_missing_or_differ(env):
    """An entry that already holds its description is left as it is (no
    write, so no watcher wakes up for nothing); one that is gone or differs
    is written again from the record."""
    e = env()
    same, lost, changed = e.target("same"), e.target("lost"), e.target("changed")
    for t in (same, lost, changed):
        e.stage(t)
    e.register("kata")
    e.claim(same, "kata", "sb-1")
    files = {t: [e.entry(t) / "mountInfo.json", e.mirror(t) / "mountInfo.json"] for t in (same, lost, changed)}
    content = {t: [f.read_bytes() for f in files[t]] for t in files}
    inodes = [f.stat().st_ino for f in files[same]]
    e.stop()

    for d in (e.entry(lost), e.mirror(lost)):  # the volumes directory was on /run, and the node rebooted
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    files[changed][0].write_bytes(json.dumps({**e.info(changed), "device": "/dev/crust-stale"}).encode())
    (e.mirror(same) / "sb-1").unlink()

    e.start()
    assert [f.stat().st_ino for f in files[same]] == inodes, "an entry that was right was written again"
    for t in (same, lost, changed):
        assert [f.read_bytes() for f in files[t]] == content[t]
    assert sorted(os.listdir(e.mirror(same))) == ["mountInfo.json", "sb-1"]
    assert sorted(os.listdir(e.proxy.volumes_dir)) == sorted(sha(t) for t in (same, lost, changed))


# -- the runtime socket ---------------------------------------------------------------------


def health(socket: Path, service: str = "") -> int:
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=10).status


def test_runtime_socket_is_private_and_both_sockets_answer_health(env):
    e = env()
    sock = e.proxy.runtime_socket
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == 0
    assert stat.filemode(st.st_mode) == "srw-------"
    assert mode(sock.parent) & 0o077 == 0
    SERVING = health_pb2.HealthCheckResponse.SERVING
    assert health(sock) == SERVING
    assert health(sock, "crust.runtime.v1.Runtime") == SERVING
    assert health(sock, "crust.registry.v1.Registry") == SERVING
    assert health(e.proxy.socket) == SERVING


def test_a_world_readable_socket_directory_is_refused(root):
    open_dir = root.path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o755)
    argv = [sys.executable, "-m", "crust", "proxy", "--csi-endpoint", f"unix://{root.path}/k.sock",
            "--plugin-endpoint", f"unix://{root.path}/nothing.sock",
            "--runtime-endpoint", f"unix://{open_dir}/runtime.sock", "--volumes-dir", str(root.path / "volumes"),
            "--state-dir", str(root.path / "state"), "--kubelet-root", str(root.path / "kubelet")]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert str(open_dir) in err and "755" in err and "700" in err, err[-2000:]
    assert os.listdir(open_dir) == []
    assert not (root.path / "k.sock").exists()


def test_a_stale_socket_from_a_killed_proxy_is_replaced(env):
    e = env()
    target = e.target("stale")
    e.stage(target)
    sock = e.proxy.runtime_socket
    e.proxy.kill()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode), "SIGKILL leaves the socket file behind"
    e.start()
    st = os.lstat(sock)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert health(sock) == health_pb2.HealthCheckResponse.SERVING
    assert list(e.volumes()) == [target]

    # Something that is not a socket is never replaced.
    e.stop()
    assert not os.path.lexists(sock), "a clean stop removes the socket"
    sock.write_text("not a socket")
    with pytest.raises(RuntimeError):
        e.proxy.start()
    assert "not a socket" in e.proxy.log_path.read_text()
    assert sock.read_text() == "not a socket"
    e.proxy.proc = None
