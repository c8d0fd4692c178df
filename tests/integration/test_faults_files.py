"""Damaged and planted files in the directories crust shares, device
identity at every hand-over, and a lost watcher: end to end, on real parts.

Real `crust driver` -> `crust shim` -> `crust proxy` and a `crust handler`
(tests.harness.handler_env's Env), real loop devices and mount namespaces. Each
test damages what a buggy root component could (a mountInfo.json that is
not JSON, cut short, of wrong types, empty, 8 MiB, a directory, a symlink,
a FIFO; a subdirectory inside an entry; a record that names a path outside
its daemon's directories; an entry naming another device), then plays
kubelet and the runtime, and checks what the daemons answer (never
INTERNAL, UNKNOWN or a traceback), what is on disk afterwards (the entry
rewritten from the proxy's record) and what is mounted (nothing crust was
not given, in any mount namespace).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crust.api import csi_pb2, runtime_pb2, runtime_pb2_grpc
from crust.contract.mountinfo import MountInfo, digest, kata_name
from tests.harness import hostile
from tests.harness.daemons import MIB
from tests.harness.handler_env import Env, make_env, namespaces_mounting  # noqa: F401 - make_env is a fixture
from tests.harness.daemons import wait_until

Code = grpc.StatusCode
BAD = {Code.INTERNAL, Code.UNKNOWN, Code.DEADLINE_EXCEEDED}


def publish_request(v, defer: bool = True) -> csi_pb2.NodePublishVolumeRequest:
    return csi_pb2.NodePublishVolumeRequest(
        volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(v.target),
        volume_capability=Env.cap(v.fs), defer_fs_ops=defer)


def code_of(call, request, timeout: float = 30) -> tuple[Code, str]:
    try:
        call(request, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return Code.OK, ""


def entry_file(env: Env, target: Path) -> Path:
    return env.proxy.volumes_dir / digest(str(target)) / "mountInfo.json"


def mirror_file(env: Env, target: Path) -> Path:
    return env.proxy.kata_dir / kata_name(str(target)) / "mountInfo.json"


def record_of(env: Env, target: Path) -> dict:
    return json.loads((env.proxy.state_dir / "volumes" / f"{digest(str(target))}.json").read_text())


def tracebacks(env: Env) -> list[str]:
    text = "".join(p.read_text(errors="replace") for p in env.path.glob("*.log"))
    return hostile.tracebacks(text)


def remove_any(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def damage(path: Path, kind: str, outside: Path, lie: bytes) -> None:
    """Replace the file at path by a damaged or planted one of this kind."""
    good = path.read_bytes() if path.is_file() and not path.is_symlink() else lie
    remove_any(path)
    if kind == "not-json":
        path.write_bytes(b"{not json at all")
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "wrong-types":
        path.write_text(json.dumps({"device": 7, "fstype": ["ext4"], "target-path": 1, "options": "ro"}))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.write(good[:-1] + b" " * (8 * MIB))
            f.write(b"}")
    elif kind == "directory":
        path.mkdir()
        (path / "inner").mkdir()
        (path / "inner" / "file").write_text("x")
    elif kind == "symlink":
        planted = outside / f"planted-{path.parent.name[:16]}.json"
        planted.write_bytes(lie)
        path.symlink_to(planted)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        raise ValueError(kind)


DAMAGE = ["not-json", "truncated", "wrong-types", "empty", "oversized", "directory", "symlink", "fifo"]


def probe_time(env: Env) -> float:
    started = time.monotonic()
    env.proxy.identity.Probe(csi_pb2.ProbeRequest(), timeout=5)
    return time.monotonic() - started


# -- a damaged entry or mirror, and kubelet's retried publish --------------------------------------


def test_a_damaged_entry_is_rewritten_from_the_record_by_the_retried_publish(make_env):
    env = make_env(start_handler=False)
    v = env.volume("pv-dmg")
    other = env.volume("pv-other")  # the device a planted description names
    outside = env.path / "outside"
    outside.mkdir()
    good = entry_file(env, v.target).read_bytes()
    good_mirror = MountInfo.model_validate_json(good).kata_json()
    lie = MountInfo.model_validate_json(good).model_copy(update={
        "device": other.device, "device_major": other.majmin[0], "device_minor": other.majmin[1]}).to_json()
    request = publish_request(v)
    expected = env.proxy.node.NodePublishVolume(request, timeout=60)
    for kind in DAMAGE:
        for path in (entry_file(env, v.target), mirror_file(env, v.target)):
            damage(path, kind, outside, lie)
        # kubelet retries the publish (it lost the answer); meanwhile the
        # proxy's loop serves other calls.
        answer: dict = {}
        worker = threading.Thread(target=lambda: answer.update(
            zip(("code", "details"), code_of(env.proxy.node.NodePublishVolume, request))))
        worker.start()
        assert probe_time(env) < 2, f"{kind}: the proxy's event loop is blocked"
        worker.join(60)
        assert answer.get("code") == Code.OK, (kind, answer)
        assert env.proxy.node.NodePublishVolume(request, timeout=60) == expected
        for path, content in ((entry_file(env, v.target), good), (mirror_file(env, v.target), good_mirror)):
            assert path.is_file() and not path.is_symlink(), (kind, path)
            assert path.read_bytes() == content, (kind, path)
        for planted in outside.iterdir():
            assert planted.read_bytes() == lie  # never written through the link
    assert not tracebacks(env)
    env.unpublish(v)
    env.unpublish(other)
    assert not entry_file(env, v.target).parent.exists() and not mirror_file(env, v.target).parent.exists()


# -- whatever is planted inside an entry ---------------------------------------------------------


def plant_inside(entry: Path, outside: Path) -> None:
    """A subdirectory tree, a link out, a FIFO and a directory named like a
    temporary, inside an entry (or its mirror)."""
    (entry / "sub" / "deep" / "deeper").mkdir(parents=True)
    (entry / "sub" / "deep" / "deeper" / "file").write_text("planted")
    (entry / "sub" / "out-link").symlink_to(outside)
    os.mkfifo(entry / "a-fifo")
    (entry / ".mountInfo.json.0123456789ab.tmp").mkdir()
    (entry / ".mountInfo.json.0123456789ab.tmp" / "x").write_text("x")


def test_anything_inside_an_entry_is_cleared_by_unpublish_sweep_and_start(make_env):
    env = make_env(start_handler=False, proxy_extra=["--sweep-interval", "0.3"])
    outside = env.path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("outside, must survive")
    unpublished, swept, kept = env.volume("pv-unpub"), env.volume("pv-swept"), env.volume("pv-kept")
    for v in (unpublished, swept, kept):
        for path in (entry_file(env, v.target), mirror_file(env, v.target)):
            plant_inside(path.parent, outside)

    # kubelet's unpublish: OK, the entry and its mirror are gone.
    code, details = code_of(env.proxy.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
        volume_id=unpublished.volume_id, target_path=str(unpublished.target)))
    assert code == Code.OK, details
    assert not entry_file(env, unpublished.target).parent.exists()
    assert not mirror_file(env, unpublished.target).parent.exists()

    # A target gone behind kubelet's back: the periodic sweep removes its entry.
    os.system(f"umount '{swept.target}'")
    swept.target.rmdir()
    wait_until(lambda: not entry_file(env, swept.target).parent.exists()
               and not mirror_file(env, swept.target).parent.exists(), timeout=10, what="the sweep")

    # A restart finds an entry no record explains, full of planted things,
    # and a live entry with them: it starts, removes the first and keeps
    # the second as its record says.
    stray = env.proxy.volumes_dir / digest("/nowhere/stray")
    stray.mkdir()
    plant_inside(stray, outside)
    env.proxy.restart()
    assert not stray.exists()
    assert MountInfo.model_validate_json(entry_file(env, kept.target).read_bytes()).device == kept.device
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    assert (outside / "keep").read_text() == "outside, must survive"
    log = env.proxy.log_path.read_text()
    assert "sweep failed" not in log
    assert not tracebacks(env)
    env.unpublish(kept)


# -- a damaged Kata mirror and the claim --------------------------------------------------------


MIRROR_DAMAGE = DAMAGE + ["entry-is-a-file", "entry-is-a-link", "marker-is-a-fifo", "marker-is-a-directory"]


def test_a_damaged_kata_mirror_is_rewritten_and_the_claim_recorded_once_all_is_done(make_env):
    env = make_env()
    outside = env.path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("outside, must survive")
    for n, kind in enumerate(MIRROR_DAMAGE):
        v = env.volume(f"pv-m{n}")
        good = entry_file(env, v.target).read_bytes()
        mirror = mirror_file(env, v.target)
        sandbox_id = f"sb-m{n}"
        if kind == "entry-is-a-file":
            shutil.rmtree(mirror.parent)
            mirror.parent.write_text("planted")
        elif kind == "entry-is-a-link":
            shutil.rmtree(mirror.parent)
            mirror.parent.symlink_to(outside)
        elif kind == "marker-is-a-fifo":
            os.mkfifo(mirror.parent / sandbox_id)  # an open for writing would block
        elif kind == "marker-is-a-directory":
            (mirror.parent / sandbox_id / "x").mkdir(parents=True)
            (mirror.parent / "sb-other").mkdir()
        else:
            damage(mirror, kind, outside, good)
        bundle = env.bundle(f"m{n}", "exec sleep 600", [("/data", str(v.target))])
        out = env.run(bundle, sandbox_id)
        assert out.returncode == 0, (kind, out.stderr)
        assert (str(v.target), "mountns", sandbox_id) in env.claim_set(), kind
        assert mirror.read_bytes() == MountInfo.model_validate_json(good).kata_json(), kind
        assert sorted(os.listdir(mirror.parent)) == ["mountInfo.json", sandbox_id], kind
        assert os.path.isfile(mirror.parent / sandbox_id) and not os.path.islink(mirror.parent / sandbox_id)
        assert record_of(env, v.target)["claim"]["sandbox_id"] == sandbox_id
        env.delete(sandbox_id)
        assert sorted(os.listdir(mirror.parent)) == ["mountInfo.json"], kind
        env.unpublish(v)
    assert (outside / "keep").read_text() == "outside, must survive"
    for planted in outside.glob("planted-*"):
        assert MountInfo.model_validate_json(planted.read_bytes())  # never written through the link
    assert not tracebacks(env)


def test_kata_direct_volumes_take_planted_files_without_blocking(tmp_path):
    """Kata's layout, read by the microVM handler: a FIFO where the marker
    or the description goes never blocks, and removal takes anything."""
    from crust.kata.sandbox.direct_volume import DirectVolumes, entry_name

    volumes = DirectVolumes(tmp_path / "dv")
    path = "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount"
    info = '{"volume-type": "block", "device": "/dev/loop9", "fstype": "ext4"}'
    volumes.add(path, info)
    entry = tmp_path / "dv" / entry_name(path)
    os.mkfifo(entry / "sb-1")  # the marker's name, planted as a FIFO

    done: list = []
    worker = threading.Thread(target=lambda: done.append(volumes.claim(path, "sb-1")), daemon=True)
    worker.start()
    worker.join(5)
    assert done == [None], "claiming blocked on a FIFO"
    assert (entry / "sb-1").is_file() and volumes.sandbox_of(path) == "sb-1"
    volumes.release(path, "sb-1")
    assert volumes.sandbox_of(path) is None

    for planted in ("fifo", "big", "directory"):
        (entry / "mountInfo.json").unlink() if not (entry / "mountInfo.json").is_dir() else \
            shutil.rmtree(entry / "mountInfo.json")
        if planted == "fifo":
            os.mkfifo(entry / "mountInfo.json")
        elif planted == "big":
            (entry / "mountInfo.json").write_bytes(info.encode()[:-1] + b" " * (8 * MIB) + b"}")
        else:
            (entry / "mountInfo.json" / "x").mkdir(parents=True)
        done.clear()
        worker = threading.Thread(target=lambda: done.append(volumes.read(path)), daemon=True)
        worker.start()
        worker.join(5)
        assert done == [None], planted
    (entry / "sub" / "deep").mkdir(parents=True)
    (entry / "sub" / "link").symlink_to(tmp_path)
    assert volumes.remove(path) is True and not entry.exists() and tmp_path.exists()


# -- device identity -----------------------------------------------------------------------------------


def mounted_anywhere(env: Env, v) -> list[int]:
    """Processes (any mount namespace) with v's file system mounted as a sandbox mounts it."""
    return env.mounting(v)


def write_entry(path: Path, data: bytes) -> None:
    """Rewrite an entry as another root component would (atomically)."""
    tmp = path.parent / ".planted.tmp"
    tmp.write_bytes(data)
    os.rename(tmp, path)


def test_the_handler_mounts_the_claimed_device_never_the_one_an_entry_names(make_env):
    env = make_env()
    v, other = env.volume("pv-id"), env.volume("pv-victim")
    truth = entry_file(env, v.target).read_bytes()
    lie = MountInfo.model_validate_json(truth).model_copy(update={
        "device": other.device, "device_major": other.majmin[0], "device_minor": other.majmin[1]}).to_json()
    write_entry(entry_file(env, v.target), lie)
    time.sleep(0.5)  # the handler's watcher has read the rewritten entry
    bundle = env.bundle("identity", "exec sleep 600", [("/data", str(v.target))])
    out = env.run(bundle, "sb-identity")
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr, out.stderr
    assert other.device in out.stderr and v.device in out.stderr, out.stderr
    assert mounted_anywhere(env, other) == [] and mounted_anywhere(env, v) == []
    assert env.sandboxes() == {} and env.claim_set() == set()
    assert "device identity refused" in env.handler.log_path.read_text()
    # The claim made the proxy write the entry again from its record: the
    # next start finds the truth and mounts the volume's own device.
    wait_until(lambda: entry_file(env, v.target).read_bytes() == truth, what="the entry rewritten")
    time.sleep(0.3)
    info = env.run_ok(bundle, "sb-identity")
    assert info["pid"] in env.mounting(v) and mounted_anywhere(env, other) == []
    env.delete("sb-identity")
    assert not tracebacks(env)
    env.unpublish(v)
    env.unpublish(other)


def test_a_container_gets_the_claimed_device_never_the_one_an_entry_names(make_env):
    """The same rule for crust's OCI runtime (runc mounts the device the
    handler describes): the description comes from the claim's answer."""
    from crust.api import handler_pb2, handler_pb2_grpc

    env = make_env()
    v, other = env.volume("pv-ctr"), env.volume("pv-ctr-victim")
    truth = entry_file(env, v.target).read_bytes()
    lie = MountInfo.model_validate_json(truth).model_copy(update={
        "device": other.device, "device_major": other.majmin[0], "device_minor": other.majmin[1]}).to_json()
    write_entry(entry_file(env, v.target), lie)
    time.sleep(0.5)  # the handler's watcher has read the rewritten entry
    request = handler_pb2.PrepareContainerRequest(
        container_id="ctr-identity", sandbox_id="pod-identity", bundle=str(env.path / "bundles" / "ctr"),
        mounts=[handler_pb2.ContainerMount(destination="/data", type="bind", source=str(v.target),
                                           options=["rbind"])])
    with grpc.insecure_channel(f"unix://{env.handler.socket}") as channel:
        containers = handler_pb2_grpc.ContainerVolumesStub(channel)
        code, details = code_of(containers.PrepareContainer, request)
        assert code == Code.FAILED_PRECONDITION and other.device in details, (code, details)
        assert env.claim_set() == set()
        wait_until(lambda: entry_file(env, v.target).read_bytes() == truth, what="the entry rewritten")
        time.sleep(0.3)
        (described,) = containers.PrepareContainer(request, timeout=30).mounts
        assert described.device == v.device
        containers.ReleaseContainer(handler_pb2.ReleaseContainerRequest(container_id="ctr-identity"), timeout=30)
    assert env.claim_set() == set()
    assert not tracebacks(env)
    env.unpublish(v)
    env.unpublish(other)


def test_the_runtime_api_cannot_repoint_a_volume_kubelet_published(make_env):
    env = make_env(start_handler=False)
    v, other = env.volume("pv-kubelet"), env.volume("pv-elsewhere")
    truth = entry_file(env, v.target).read_bytes()
    Req = runtime_pb2.RuntimeStageVolumeRequest
    with env.proxy.runtime_channel() as channel:
        runtime = runtime_pb2_grpc.RuntimeStub(channel)

        def stage(device: str, majmin: tuple[int, int]) -> tuple[Code, str]:
            return code_of(runtime.RuntimeStageVolume, Req(
                volume_type=Req.BLOCK, volume_target_path=str(v.target), volume_backing_path=device,
                fs_type="ext4", volume_id=v.volume_id, capacity_bytes=32 * MIB, device_major=majmin[0],
                device_minor=majmin[1]))

        for device, majmin, words in ((other.device, other.majmin, "published by kubelet"),
                                      (other.device, (0, 0), "published by kubelet"),
                                      (other.device, v.majmin, "not the"),
                                      ("/dev/null", (1, 3), "not a block device")):
            code, details = stage(device, majmin)
            assert code == Code.FAILED_PRECONDITION and words in details, (device, majmin, code, details)
            assert entry_file(env, v.target).read_bytes() == truth
            assert mirror_file(env, v.target).read_bytes() == MountInfo.model_validate_json(truth).kata_json()
        # The same device again is no change: accepted.
        code, details = stage(v.device, v.majmin)
        assert code == Code.OK, details
    assert "device identity refused" in env.proxy.log_path.read_text()
    assert not tracebacks(env)
    env.unpublish(v)
    env.unpublish(other)


def test_a_device_handed_over_is_refused_unless_its_numbers_are_the_paths(tmp_path):
    """crust.contract.device: the rule every hand-over applies."""
    from crust.common.errors import FailedPrecondition
    from crust.contract import device

    found = None
    for name in sorted(os.listdir("/sys/dev/block")):
        path = f"/dev/{(Path('/sys/dev/block') / name / 'uevent').read_text().split('DEVNAME=')[1].split()[0]}"
        if os.path.exists(path):
            found = (path, tuple(int(n) for n in name.split(":")))
            break
    assert found is not None, "no block device node on this host"
    path, numbers = found
    assert device.handed_over(path, *numbers, target_path="/t", source="test") == numbers
    assert device.handed_over(path, 0, 0, target_path="/t", source="test") == numbers  # filled in
    assert device.handed_over(str(tmp_path / "absent"), 7, 3, target_path="/t", source="test") == (7, 3)
    with pytest.raises(FailedPrecondition, match=f"is {numbers[0]}:{numbers[1]}, not the"):
        device.handed_over(path, numbers[0], numbers[1] + 1000, target_path="/t", source="test")
    (tmp_path / "file").write_text("x")
    for not_block in ("/dev/null", str(tmp_path / "file"), str(tmp_path)):
        with pytest.raises(FailedPrecondition, match="not a block device"):
            device.handed_over(not_block, 1, 3, target_path="/t", source="test")
    entry = MountInfo(device=path, fstype="ext4", target_path="/t", device_major=numbers[0],
                      device_minor=numbers[1])
    assert device.agree(entry, entry) == entry
    for claimed, words in ((entry.model_copy(update={"device_minor": numbers[1] + 1}), "names device"),
                           (entry.model_copy(update={"target_path": "/u"}), "answered for /u"),
                           (entry.model_copy(update={"device_major": 0, "device_minor": 0}), "no device number")):
        with pytest.raises(FailedPrecondition, match=words):
            device.agree(entry, claimed)


# -- the handler's directory watcher ------------------------------------------------------------------


def handler_health(env: Env) -> int:
    with grpc.insecure_channel(f"unix://{env.handler.socket}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def start_in_sandbox(env: Env, v, sandbox_id: str) -> dict:
    info = env.run_ok(env.bundle(sandbox_id, "exec sleep 600", [("/data", str(v.target))]), sandbox_id)
    assert info["pid"] in env.mounting(v), "the volume is not mounted in the sandbox"
    return info


def test_a_dead_watcher_is_noticed_and_rebuilt_and_new_volumes_reach_their_sandbox(make_env):
    env = make_env()
    before = env.volume("pv-before")
    # Entry directories swapped and removed under the watcher, as a proxy
    # being restarted and a cleanup could: watchdog's inotify thread dies
    # of a KeyError in its book-keeping.
    churn = env.proxy.volumes_dir / digest("/churn")
    deadline = time.monotonic() + 30
    while not any(words in env.handler.log_path.read_text() for words in ("lost a thread", "KeyError")):
        assert time.monotonic() < deadline, "the watcher never died: the fault was not reproduced"
        for _ in range(50):
            churn.mkdir()
            (churn / "mountInfo.json").write_text("{}")
            os.rename(churn, churn.with_name(churn.name + ".old"))
            churn.mkdir()
            shutil.rmtree(churn.with_name(churn.name + ".old"))
            shutil.rmtree(churn)
    # A volume published after the death is seen: its sandbox mounts it
    # (not the placeholder), and so does one published before.
    after = env.volume("pv-after")
    start_in_sandbox(env, after, "sb-after")
    start_in_sandbox(env, before, "sb-before")
    log = env.handler.log_path.read_text()
    assert "the watcher of the volumes directory is lost" in log and "the watcher is rebuilt" in log
    assert handler_health(env) == SERVING
    for sandbox_id in ("sb-after", "sb-before"):
        env.delete(sandbox_id)
    assert not tracebacks(env), tracebacks(env)
    env.unpublish(before)
    env.unpublish(after)


def test_health_says_the_watcher_is_lost_until_the_directory_can_be_watched_again(make_env):
    env = make_env()
    vdir = env.proxy.volumes_dir
    assert handler_health(env) == SERVING
    # The watched directory replaced (by a file): the watch is on a gone
    # directory and cannot be made again until a directory is back.
    os.rename(vdir, vdir.with_name("volumes.away"))
    vdir.write_text("not a directory")
    wait_until(lambda: handler_health(env) == NOT_SERVING, timeout=5, what="NOT_SERVING")
    time.sleep(1.5)
    assert handler_health(env) == NOT_SERVING  # and it stays so while it cannot watch
    vdir.unlink()
    os.rename(vdir.with_name("volumes.away"), vdir)
    wait_until(lambda: handler_health(env) == SERVING, timeout=5, what="SERVING again")
    log = env.handler.log_path.read_text()
    assert "the watcher of the volumes directory is lost" in log and "the watcher is rebuilt" in log
    v = env.volume("pv-back")
    start_in_sandbox(env, v, "sb-back")
    env.delete("sb-back")
    assert not tracebacks(env)
    env.unpublish(v)


def test_a_deferred_target_whose_entry_is_not_seen_fails_the_start_never_binds_the_placeholder(make_env):
    env = make_env()
    v = env.volume("pv-unseen")
    shutil.rmtree(entry_file(env, v.target).parent)  # removed behind the proxy's back
    bundle = env.bundle("unseen", "exec sleep 600", [("/data", str(v.target))])
    out = env.run(bundle, "sb-unseen")
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and "deferred" in out.stderr, out.stderr
    assert env.sandboxes() == {} and env.mounting(v) == [] and env.claim_set() == set()
    # kubelet's retried publish writes the entry again; then the sandbox starts with its volume.
    env.proxy.node.NodePublishVolume(publish_request(v), timeout=60)
    assert entry_file(env, v.target).is_file()
    start_in_sandbox(env, v, "sb-unseen")
    env.delete("sb-unseen")
    assert not tracebacks(env)
    env.unpublish(v)


def test_a_bind_through_a_link_to_another_pods_deferred_target_fails_the_start(make_env):
    """A sandbox's bind source that is a symbolic link to another pod's
    deferred target (as a kubelet CSI path, and as any path): the start is
    refused naming both paths; the placeholder is bound nowhere, nothing is
    claimed; the volume's own sandbox still starts with it."""
    env = make_env()
    v = env.volume("pv-linked")
    links = [env.proxy.target("pod-evil", "pv-evil"), env.path / "innocent"]
    for n, link in enumerate(links):
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(v.target)
        bundle = env.bundle(f"linked-{n}", "exec sleep 600", [("/data", str(link))])
        out = env.run(bundle, f"sb-linked-{n}")
        assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr, out.stderr
        assert str(link) in out.stderr and str(v.target) in out.stderr and "placeholder" in out.stderr, out.stderr
        assert env.sandboxes() == {} and env.claim_set() == set()
    start_in_sandbox(env, v, "sb-own")
    env.delete("sb-own")
    assert not tracebacks(env)
    env.unpublish(v)


# -- records that name another place or device -------------------------------------------------------


def test_records_naming_a_target_outside_the_kubelet_root_or_another_device_never_become_entries(make_env):
    env = make_env(start_handler=False)
    v, other = env.volume("pv-rec"), env.volume("pv-rec-other")
    records = env.proxy.state_dir / "volumes"
    real = json.loads((records / f"{digest(str(v.target))}.json").read_text())
    # A target outside the kubelet root (it exists, so a start would keep it).
    outside = env.path / "elsewhere" / "mount"
    outside.mkdir(parents=True)
    lying = json.loads(json.dumps(real))
    lying["target_path"] = str(outside)
    lying["info"]["target-path"] = str(outside)
    (records / f"{digest(str(outside))}.json").write_text(json.dumps(lying))
    # A record whose description is of another target than its own.
    inside = env.proxy.target("pod-x", "pv-x")
    inside.mkdir(parents=True)
    mismatched = json.loads(json.dumps(real))
    mismatched["target_path"] = str(inside)
    (records / f"{digest(str(inside))}.json").write_text(json.dumps(mismatched))
    # The shim's record of v names another volume's device node as its backend target.
    shim_record = env.shim.state_dir / "volumes"
    (path,) = [p for p in shim_record.glob("*.json") if json.loads(p.read_text())["volume_id"] == v.volume_id]
    shim = json.loads(path.read_text())
    shim["backend_target"] = other.device
    path.write_text(json.dumps(shim))

    env.shim.restart()
    env.proxy.restart()
    for target in (outside, inside):
        assert not (env.proxy.volumes_dir / digest(str(target))).exists()
        assert not (env.proxy.kata_dir / kata_name(str(target))).exists()
        assert not (records / f"{digest(str(target))}.json").exists()  # set aside for a human
    assert "not inside the kubelet root" in env.proxy.log_path.read_text()
    # kubelet's retried publish of v: never a description of the other device.
    code, details = code_of(env.proxy.node.NodePublishVolume, publish_request(v))
    assert code not in BAD, details
    entry = MountInfo.model_validate_json(entry_file(env, v.target).read_bytes())
    assert (entry.device, entry.device_major, entry.device_minor) == (v.device, *v.majmin)
    assert not tracebacks(env)
    env.unpublish(other)


def test_a_record_set_aside_twice_keeps_both_and_frees_its_name(tmp_path):
    """A directory planted at a record's name, set aside, planted again: the
    second is set aside under a name of its own (a directory cannot be
    renamed over the first), so the record's name is free for the next write."""
    from pydantic import BaseModel

    from crust.common.recordstore import RecordStore

    class Rec(BaseModel):
        name: str

    store = RecordStore(tmp_path / "records", Rec)
    for round_ in range(3):
        (tmp_path / "records" / "k.json" / "inside").mkdir(parents=True)
        assert store.get("k") is None
        store.put_sync("k", Rec(name=f"r{round_}"))
        assert store.get("k") == Rec(name=f"r{round_}")
        store.delete_sync("k")
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["k.1.corrupt", "k.2.corrupt", "k.corrupt"]
