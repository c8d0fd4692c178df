"""The handler's index of the proxy's watched directory, and resolving mount sources with it.

A sandbox started before its volume's entry exists waits for the index (an
event, not a poll) and mounts the volume once the proxy writes the entry;
the index wakes exactly the callers awaiting the entry written; garbage of
every kind in the watched directory (not digests, invalid JSON, symlinked
descriptions, FIFOs, ...) never stops the handler, and watching costs no
CPU while nothing changes; a mount source resolves to the deepest entry and
its subpath, and '..' escapes are refused. The first and third run on a real
driver -> shim -> proxy stack with a real handler (tests.harness.handler_env); the
others on a real VolumeIndex over a directory of the test's own.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crust.contract.mountinfo import MountInfo, digest
from crust.contract.volumes_dir import VolumesDir
from crust.runtime_handler.index import VolumeIndex
from crust.runtime_handler.resolve import SubpathEscapes, candidates, resolve
from tests.harness.handler_env import Env, entries_of, env, make_env, view  # noqa: F401 - env, make_env: fixtures
from tests.harness.daemons import wait_until


# -- waiting for the index -----------------------------------------------------------------------


def test_a_sandbox_started_before_its_entry_waits_for_the_index(env):
    """The runtime may be asked to start the sandbox while the proxy is still
    publishing: the start waits for the index's update (an event, not a
    poll) and mounts the volume as soon as the entry is there."""
    v = env.create("pv-late")
    v.target.mkdir(parents=True)
    bundle = env.bundle("late", "exec sleep 600", [("/data", str(v.target))])
    started = subprocess.Popen([sys.executable, "-m", "crust", "sandbox", "--handler-endpoint",
                                f"unix://{env.handler.socket}", "run", "--bundle", str(bundle), "--id", "sb-late",
                                "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)  # the run is waiting: no entry yet
        assert started.poll() is None, started.communicate()
        v.target.rmdir()
        env.publish_deferred(v)
        out, err = started.communicate(timeout=30)
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()
    assert started.returncode == 0, err
    (info,) = json.loads(out)
    (volume,) = info["volumes"]
    assert volume["target_path"] == str(v.target) and volume["destinations"] == ["/data"]
    assert entries_of(int(info["pid"]), v.majmin), "the volume is not mounted in the sandbox"
    env.delete("sb-late")
    env.unpublish(v)


def test_the_index_wakes_an_awaiting_caller(tmp_path):
    async def scenario():
        index = VolumeIndex(tmp_path / "volumes").start()
        writer = VolumesDir(tmp_path / "volumes")
        target = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount"
        other = digest(target + "-other")
        try:
            woken = index.awaiting([digest(target)])
            untouched = index.awaiting([other])
            assert not woken.done()
            await writer.write(MountInfo(device="/dev/loop9", fstype="ext4", target_path=target))
            await asyncio.wait_for(woken, 5)
            assert index.get(digest(target)).device == "/dev/loop9"
            assert not untouched.done(), "a write wakes only the callers awaiting that entry"
            index.forget([digest(target)], woken)
            index.forget([other], untouched)
            assert index._awaited == {}
        finally:
            index.stop()

    asyncio.run(scenario())


# -- garbage in the watched directory --------------------------------------------------------


def plant_garbage(env: Env, tag: str) -> dict[str, str]:
    """Bad entries of every kind; returns {what: digest} of the digest-named ones."""
    vdir = env.proxy.volumes_dir
    kubelet = env.proxy.kubelet_root
    outside = env.path / f"outside-{tag}"
    outside.mkdir()
    named = {}

    def entry_dir(what: str) -> Path:
        name = digest(f"/garbage/{tag}/{what}")
        named[what] = name
        return vdir / name

    (vdir / f"garbage-{tag}.txt").write_bytes(b"\x00\xffnot an entry")
    (vdir / f"not-a-digest-{tag}").mkdir()
    (vdir / f"not-a-digest-{tag}" / "mountInfo.json").write_text("{}")
    (vdir / digest(tag).upper()).mkdir()
    (vdir / f".hidden-{tag}").mkdir()
    entry_dir("invalid-json").mkdir()
    (entry_dir("invalid-json") / "mountInfo.json").write_text("{not json")
    entry_dir("empty").mkdir()
    (entry_dir("empty") / "mountInfo.json").write_bytes(b"")
    entry_dir("null").mkdir()
    (entry_dir("null") / "mountInfo.json").write_text("null")
    entry_dir("binary").mkdir()
    (entry_dir("binary") / "mountInfo.json").write_bytes(os.urandom(512))
    # A valid description in a directory whose name is not its target's digest.
    mismatch = MountInfo(device="/dev/null", fstype="ext4", target_path=str(kubelet / "pods" / tag / "elsewhere"))
    entry_dir("mismatch").mkdir()
    (entry_dir("mismatch") / "mountInfo.json").write_bytes(mismatch.to_json())
    # A symlinked mountInfo.json, to a description that would match its directory.
    fake_target = str(kubelet / "pods" / f"fake-{tag}" / "volumes" / "kubernetes.io~csi" / "pv" / "mount")
    (outside / "mountInfo.json").write_bytes(
        MountInfo(device="/dev/null", fstype="ext4", target_path=fake_target).to_json())
    named["symlink"] = digest(fake_target)
    (vdir / named["symlink"]).mkdir()
    (vdir / named["symlink"] / "mountInfo.json").symlink_to(outside / "mountInfo.json")
    # An entry directory that is a symlink, to a directory with a matching description.
    (outside / "dir").mkdir()
    fake_dir_target = fake_target.replace("/pv/", "/pv-dir/")
    (outside / "dir" / "mountInfo.json").write_bytes(
        MountInfo(device="/dev/null", fstype="ext4", target_path=fake_dir_target).to_json())
    named["symlink-dir"] = digest(fake_dir_target)
    (vdir / named["symlink-dir"]).symlink_to(outside / "dir")
    # A digest-named file, a mountInfo.json that is a directory, and a FIFO.
    entry_dir("file").write_text("{}")
    entry_dir("dir-entry").mkdir()
    (entry_dir("dir-entry") / "mountInfo.json").mkdir()
    entry_dir("fifo").mkdir()
    os.mkfifo(entry_dir("fifo") / "mountInfo.json")
    return named


def test_garbage_in_the_volumes_dir_never_stops_the_handler(make_env):
    env = make_env(start_handler=False)
    env.proxy.volumes_dir.mkdir(exist_ok=True)
    before = plant_garbage(env, "before")
    env.handler.start()
    during = plant_garbage(env, "during")
    time.sleep(0.5)  # the watcher sees every event
    assert env.handler.proc.poll() is None, env.handler.log_path.read_text()[-2000:]
    assert not env.handlers()["mountns"].lease_expired

    # The symlinked descriptions were not followed, before nor during; the
    # mismatched one was refused.
    log = env.handler.log_path.read_text()
    skipped = [json.loads(line).get("digest") for line in log.splitlines()
               if line.startswith("{") and "skipping" in line]
    for named in (before, during):
        for what in ("symlink", "symlink-dir", "mismatch"):
            assert named[what] in skipped, what

    # A valid volume published now works end to end.
    v = env.volume("pv-valid")
    info = env.run_ok(env.bundle("valid", "echo ok > /data/ok && exec sleep 600", [("/data", str(v.target))]),
                      "sb-valid")
    wait_until((view(info, info["volumes"][0]["mount_point"]) / "ok").exists, what="the sandbox's file")
    assert len(entries_of(info["pid"], v.majmin)) == 2 and entries_of("self", v.majmin) == []
    # Watching the directory costs nothing while nothing changes.
    cpu = handler_cpu_seconds(env.handler.proc.pid)
    time.sleep(1)
    assert handler_cpu_seconds(env.handler.proc.pid) - cpu < 0.3, "the handler spins on the watched directory"
    env.delete("sb-valid")
    env.unpublish(v)
    assert env.handler.proc.poll() is None


def handler_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- resolving mount sources (unit level, on a real index) ---------------------------------------


def test_resolve_candidates_and_subpaths(root):
    vdir = root.path / "index"
    vdir.mkdir()
    csi = "/k/pods/uid-1/volumes/kubernetes.io~csi"
    target = f"{csi}/pv-1/mount"
    nested = f"{target}/a"  # an entry below another one: the deepest wins
    plain = "/srv/plain"
    above = f"{csi}/pv-1"  # above the volume's mount level: never probed
    for path in (target, nested, plain, above):
        (vdir / digest(path)).mkdir()
        (vdir / digest(path) / "mountInfo.json").write_bytes(
            MountInfo(device="/dev/loop9", fstype="ext4", target_path=path).to_json())
    index = VolumeIndex(vdir)
    index.rescan()
    assert set(index.entries) == {digest(p) for p in (target, nested, plain, above)}

    assert candidates(f"{target}/a/b/c") == [f"{target}/a/b/c", f"{target}/a/b", f"{target}/a", target]
    assert candidates(f"{target}//a/./b/") == [f"{target}/a/b", f"{target}/a", target]
    assert candidates(target) == [target]
    assert candidates(f"{plain}/x/y") == [f"{plain}/x/y"]

    r = resolve(f"{target}/a/b/c", index)
    assert (r.info.target_path, r.digest, r.subpath) == (nested, digest(nested), "b/c")
    r = resolve(f"{target}/b/c", index)
    assert (r.info.target_path, r.subpath) == (target, "b/c")
    r = resolve(target, index)
    assert (r.info.target_path, r.subpath) == (target, "")
    r = resolve(f"{target}/", index)
    assert (r.info.target_path, r.subpath) == (target, "")
    # A non-CSI source only matches itself.
    assert resolve(plain, index).subpath == ""
    assert resolve(f"{plain}/sub", index) is None
    # A path beside the mount level, under the same PV, is not a subpath of it.
    assert resolve(f"{csi}/pv-2/mount/x", index) is None
    assert resolve("relative/path", index) is None
    for escape in (f"{target}/..", f"{target}/a/../b", f"{target}/../mount/a", f"{plain}/../plain"):
        with pytest.raises(SubpathEscapes):
            resolve(escape, index)

    # The index follows removals.
    os.unlink(vdir / digest(nested) / "mountInfo.json")
    index.rescan()
    r = resolve(f"{target}/a/b/c", index)
    assert (r.info.target_path, r.subpath) == (target, "a/b/c")
    # Without the volume's own entry, nothing above its mount level answers.
    os.unlink(vdir / digest(target) / "mountInfo.json")
    index.rescan()
    assert index.get(digest(above)) is not None
    assert resolve(f"{target}/a/b/c", index) is None
    assert resolve(target, index) is None
