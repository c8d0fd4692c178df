"""`crust proxy`'s watched directories: the KEP entries under --volumes-dir and the Kata mirror under --kata-dir.

A real driver -> shim -> proxy stack (tests.harness.proxy_runtime_env), staged and
unstaged over the proxy's runtime socket. Checked here: what a stage
writes (the entry's and the mirror's directories and files, their modes,
JSON that validates against specs/mountinfo.schema.json and that Kata's
direct-volume parsers accept, no secret on disk) and what an unstage
removes; read-only reaching Kata as the "ro" option; a Kata name over 255
bytes; a reader never seeing a partial file; a SIGKILL mid-burst leaving
only whole files and a restart leaving no temporaries; the sweep removing
only the entries nobody needs; a restart rewriting only the entries that
are missing or differ. What is asserted is what is on disk and what the
registry lists; everything lives below the `root` fixture's temporary
directory.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from pathlib import Path

import grpc

from crust.api import runtime_pb2_grpc
from tests.harness.kata_readers import go_parse, runtime_rs_parse
from tests.harness.proxy_runtime_env import GIB, REPO, Req, b64, env, mode, sha  # noqa: F401 - env: the stack fixture

SCHEMA = json.loads((REPO / "specs" / "mountinfo.schema.json").read_text())
TOKENS = "csi.storage.k8s.io/serviceAccount.tokens"
SECRET = "eyJhbGciOi-SECRET-TOKEN-VALUE"


# -- independent expectations (not crust's own helpers) -------------------------------------


_ANNOTATIONS = {"title", "description", "default", "$id", "$schema"}
_KNOWN = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "items", "const", "enum",
                         "minimum"}
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
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in enum {schema['enum']!r}"
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


def kata_parses(data: bytes) -> None:
    """What both of Kata's direct-volume parsers take (tests.harness.kata_readers):
    the keys and types runtime-rs requires, its raw-block volume type, and
    the same values through the Go runtime's lenient decoder."""
    rs = runtime_rs_parse(data)
    assert rs["volume-type"] == "directvol", "runtime-rs mounts only \"directvol\" as a raw-block volume"
    go = go_parse(data)
    assert (go["device"], go["fstype"], go["metadata"], go["options"]) == \
        (rs["device"], rs["fstype"], rs["metadata"], rs["options"])


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
    kata_parses((mirror / "mountInfo.json").read_bytes())
    kata = json.loads((mirror / "mountInfo.json").read_bytes())
    assert kata == {**data, "volume-type": "directvol"}  # the same file, with Kata 4's volume type

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
    kata_parses((e.mirror(target) / "mountInfo.json").read_bytes())
    assert "ro" in json.loads((e.mirror(target) / "mountInfo.json").read_bytes())["options"]

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
                if root == e.proxy.kata_dir:
                    kata_parses(f.read_bytes())
                else:
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
