"""`crust handler` and `crust sandbox` end to end, on real parts.

Real `crust driver` -> `crust shim` -> `crust proxy` processes, a real
`crust handler` registered with the proxy, real loop devices and real mount
namespaces. kubelet is played over the proxy's CSI socket (NodePublishVolume
with defer_fs_ops, target paths laid out as kubelet lays them out); a pod
sandbox is started with `crust sandbox run` on an OCI bundle whose root is an
empty directory (the handler binds the host's /bin, /usr, ... read-only into
it) and whose mounts name the CSI target path.

What is checked is what the kernel, the disk and the daemons say: the host's
/proc/self/mountinfo, the sandbox holder's /proc/<pid>/mountinfo, files seen
through /proc/<pid>/root, gRPC status codes, the JSON of `crust sandbox` and
of `crust demo`, and the proxy's registry (ListClaims, ListHandlers).
Everything lives under the `root` fixture's temporary directory, which kills
the sandbox holders of that root and unmounts and detaches what is below it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from pyroute2.netns import listnetns

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc
from crust.contract.mountinfo import MountInfo, digest
from crust.contract.volumes_dir import VolumesDir
from crust.runtime_handler.index import VolumeIndex
from crust.runtime_handler.resolve import SubpathEscapes, candidates, resolve
from crust.sys import netns
from crust.sys import mount as sysmount
from tests.harness import MIB, AccessMode, kill_processes_rooted_under, loops_left, pid_alive, wait_until

Code = grpc.StatusCode
Usage = csi_pb2.VolumeUsage
PROJECT = Path(__file__).resolve().parents[2]
SIZE = {"ext4": 32 * MIB, "xfs": 300 * MIB}
GROUP_BITS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IXGRP | stat.S_ISGID


def mountinfo_of(pid: int | str) -> list[sysmount.MountEntry]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return sysmount.parse_mountinfo(f.read())


def entries_of(pid: int | str, majmin: tuple[int, int]) -> list[sysmount.MountEntry]:
    return [e for e in mountinfo_of(pid) if (e.major, e.minor) == majmin]


def namespaces_mounting(majmin: tuple[int, int], host_like: str = "", private=()) -> list[int]:
    """Every process (on the whole host) whose mount table has this device's
    file system: reading /proc only, touching nothing. Mount points below
    host_like but outside the private directories are skipped: those are
    copies of the host's own mounts (kept by a namespace someone else created
    while the host had the volume mounted), not sandbox mounts."""
    def counted(e: sysmount.MountEntry) -> bool:
        if (e.major, e.minor) != majmin:
            return False
        if host_like and e.mount_point.startswith(host_like + "/"):
            return e.mount_point.startswith(tuple(str(d) + "/" for d in private))
        return True

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(counted(e) for e in mountinfo_of(entry.name)):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue  # gone, a zombie or a kernel thread
    return found


def holders_under(*dirs: Path) -> list[int]:
    """Sandbox holders (`sleep infinity`) with mount points below one of dirs:
    directories that only sandbox namespaces mount on (a handler's state
    directory, bundles), never the host, so no other namespace lists them."""
    prefixes = tuple(str(d) + "/" for d in dirs)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes().split(b"\0")[:2] != [b"sleep", b"infinity"]:
                continue
            if any(e.mount_point.startswith(prefixes) for e in mountinfo_of(entry.name)):
                found.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


# -- the set-up: driver -> shim -> proxy, and the handler -----------------------------------


@dataclass
class Vol:
    volume_id: str
    pv: str
    fs: str
    staging: Path
    target: Path
    device: str = ""
    majmin: tuple[int, int] = (0, 0)


class Env:
    def __init__(self, root, proxy_extra=(), start_handler: bool = True, **handler_kw):
        self.root = root
        self.driver, self.shim, self.proxy = root.stack(proxy_extra=list(proxy_extra))
        self.handler = root.handler(self.proxy, **handler_kw)
        if start_handler:
            self.handler.start()

    @property
    def path(self) -> Path:
        return self.root.path

    # kubelet, over the proxy's CSI socket ----------------------------------------------------

    @staticmethod
    def cap(fs: str, group: str = "", policy: str = "") -> csi_pb2.VolumeCapability:
        return csi_pb2.VolumeCapability(
            mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs, volume_supplemental_group=group,
                                                       volume_supplemental_group_change_policy=policy),
            access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))

    def create(self, pv: str, fs: str = "ext4") -> Vol:
        vol = self.proxy.create(pv, SIZE[fs], self.cap(fs))
        v = Vol(vol.volume_id, pv, fs, self.proxy.staging(pv), self.proxy.target(f"pod-{pv}", pv))
        self.proxy.stage(v.volume_id, v.staging, self.cap(fs))
        return v

    def publish_deferred(self, v: Vol, group: str = "", policy: str = "") -> csi_pb2.DeferredMount:
        rsp = self.proxy.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(v.target),
            volume_capability=self.cap(v.fs, group, policy), defer_fs_ops=True), timeout=60)
        assert rsp.HasField("deferred_mount")
        d = rsp.deferred_mount
        v.device, v.majmin = d.device, (d.device_major, d.device_minor)
        placeholder = sysmount.at(str(v.target))
        assert placeholder is not None and placeholder.fs_type == "tmpfs" and placeholder.readonly
        assert not sysmount.of_device(*v.majmin), "a deferred publish mounted the file system on the host"
        return d

    def volume(self, pv: str, fs: str = "ext4", group: str = "", policy: str = "") -> Vol:
        v = self.create(pv, fs)
        self.publish_deferred(v, group, policy)
        return v

    def publish_on_host(self, v: Vol) -> None:
        self.proxy.publish(v.volume_id, v.staging, v.target, self.cap(v.fs))
        entry = sysmount.at(str(v.target))
        assert entry is not None and entry.fs_type == v.fs, "the host publish did not mount the file system"

    def unpublish(self, v: Vol) -> None:
        self.proxy.unpublish(v.volume_id, v.target)

    def entry(self, v: Vol) -> dict:
        return json.loads((self.proxy.volumes_dir / digest(str(v.target)) / "mountInfo.json").read_text())

    # the registry, over the proxy's runtime socket --------------------------------------------

    def claims(self) -> list[registry_pb2.Claim]:
        with self.proxy.runtime_channel() as channel:
            return list(registry_pb2_grpc.RegistryStub(channel).ListClaims(
                registry_pb2.ListClaimsRequest(), timeout=10).claims)

    def claim_set(self) -> set[tuple[str, str, str]]:
        return {(c.target_path, c.handler, c.sandbox_id) for c in self.claims()}

    def handlers(self) -> dict[str, registry_pb2.Handler]:
        with self.proxy.runtime_channel() as channel:
            return {h.name: h for h in registry_pb2_grpc.RegistryStub(channel).ListHandlers(
                registry_pb2.ListHandlersRequest(), timeout=10).handlers}

    # sandboxes ---------------------------------------------------------------------------------

    def bundle(self, name: str, script: str, mounts: list[tuple]) -> Path:
        """An OCI bundle: an empty rootfs, `sh -c script`, and bind mounts
        (destination, source[, options])."""
        bundle = self.path / "bundles" / name
        (bundle / "rootfs").mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["/bin/sh", "-c", script], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"},
            "mounts": [{"destination": m[0], "source": m[1], "type": "bind",
                        "options": list(m[2]) if len(m) > 2 else ["rbind"]} for m in mounts],
        }, indent=1))
        return bundle

    def run(self, bundle: Path, sandbox_id: str) -> subprocess.CompletedProcess:
        return self.handler.sandbox("run", "--bundle", str(bundle), "--id", sandbox_id, "--json")

    def run_ok(self, bundle: Path, sandbox_id: str) -> dict:
        out = self.run(bundle, sandbox_id)
        assert out.returncode == 0, out.stderr
        (info,) = json.loads(out.stdout)
        assert info["sandbox_id"] == sandbox_id and info["state"] == "RUNNING"
        return pids(info)

    def sandboxes(self) -> dict[str, dict]:
        out = self.handler.sandbox("list", "--json")
        assert out.returncode == 0, out.stderr
        return {i["sandbox_id"]: pids(i) for i in json.loads(out.stdout)}

    def wait_exited(self, sandbox_id: str, code: int = 0) -> dict:
        info = wait_until(lambda: (self.sandboxes().get(sandbox_id) or {}).get("exited") and
                          self.sandboxes()[sandbox_id], timeout=20, what=f"the process of {sandbox_id} to exit")
        assert info.get("exit_code", 0) == code, (info, self.process_log(sandbox_id))
        return info

    def process_log(self, sandbox_id: str) -> str:
        path = self.handler.state_dir / "run" / sandbox_id / "process.log"
        return path.read_text() if path.exists() else ""

    def delete(self, sandbox_id: str) -> None:
        out = self.handler.sandbox("delete", sandbox_id)
        assert out.returncode == 0, out.stderr

    def mounting(self, v: Vol) -> list[int]:
        """Processes with v's file system mounted as a sandbox mounts it."""
        return namespaces_mounting(v.majmin, str(self.path), (self.handler.state_dir, self.path / "bundles"))

    def holders(self) -> list[int]:
        return holders_under(self.handler.state_dir, self.path / "bundles")

    def delete_sandboxes(self) -> None:
        """Every sandbox the handler lists deleted, if the handler runs (a fixture's teardown)."""
        if self.handler.proc is not None and self.handler.proc.poll() is None:
            for sandbox_id in self.sandboxes():
                self.handler.sandbox("delete", sandbox_id)

    def kill_handler_until_expired(self) -> None:
        """SIGKILL the handler and wait until the proxy sees its lease expire."""
        self.handler.kill()
        wait_until(lambda: self.handlers()["mountns"].lease_expired, timeout=15, what="the lease to expire")

    def restart_handler(self) -> None:
        """Start the handler again after its lease expired: the harness returns
        once the proxy lists it with a fresh lease (a new registration)."""
        assert self.handlers()["mountns"].lease_expired
        self.handler.start()
        wait_until(lambda: self.handler.sandbox("list").returncode == 0, what="the handler's socket")


def pids(info: dict) -> dict:
    """Protobuf JSON writes 64-bit integers as strings."""
    return {**info, "pid": int(info.get("pid", 0)), "process_pid": int(info.get("process_pid", 0))}


def view(info: dict, path: str) -> Path:
    """A path of the sandbox's mount namespace, from the host."""
    return Path(f"/proc/{info['pid']}/root{path}")


def rootfs_of(bundle: Path) -> str:
    return str(bundle / "rootfs")


def kill_container_processes(bundles: Path) -> None:
    kill_processes_rooted_under(str(bundles) + "/")


@pytest.fixture
def make_env(root):
    envs: list[Env] = []

    def make(**kw) -> Env:
        envs.append(Env(root, **kw))
        return envs[-1]

    yield make
    for e in envs:
        if e.handler.proc is not None and e.handler.proc.poll() is None:
            try:
                for sandbox_id in e.sandboxes():
                    e.handler.sandbox("delete", sandbox_id)
            except (AssertionError, subprocess.TimeoutExpired, ValueError):
                pass
        kill_container_processes(e.path / "bundles")


@pytest.fixture
def env(make_env):
    return make_env()


@pytest.fixture
def short_lease(make_env):
    """A proxy whose leases expire after 3 s: a killed handler is seen gone quickly."""
    return make_env(proxy_extra=["--lease-seconds", "3"])


# -- the demo ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fs", ["xfs", "ext4"])
def test_demo_runs_every_step_and_leaves_nothing(root, fs):
    """`crust demo` as a user runs it; its temporary root is made under the
    test's root (TMPDIR) so what it leaves behind is exactly identifiable."""
    tmp = root.path / "tmp"
    tmp.mkdir()
    before = set(tmp.glob("crust-demo-*"))
    proc = subprocess.Popen([sys.executable, "-m", "crust", "demo", "--fs", fs, "--json"], cwd=PROJECT,
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # The demo's own root, seen while it runs (it exists for seconds).
        seen = wait_until(lambda: set(tmp.glob("crust-demo-*")) - before or proc.poll() is not None,
                          timeout=30, interval=0.01, what="the demo's temporary root")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (stdout[-3000:], stderr[-3000:])
    result = json.loads(stdout)
    assert isinstance(seen, set) and len(seen) == 1, "the demo did not make its root in TMPDIR"
    (demo_root,) = seen

    assert result["ok"] is True and result["fs_type"] == fs
    assert result["steps"], "no steps reported"
    assert [s["name"] for s in result["steps"] if not s["ok"]] == []
    names = [s["name"] for s in result["steps"]]
    for step in ("start crust node", "kubelet registers the driver", "NodePublishVolume (deferred)",
                 "run pod sandbox (writes data)", "NodeExpandVolume", "kubelet restart", "stop pod sandbox",
                 "NodePublishVolume (on the host)", "stop crust node"):
        assert step in names
    assert result["host_mounted_during_sandbox"] is False
    assert result["data_verified"] is True
    assert result["size_before"] > 0 and result["size_after"] > result["size_before"]
    assert result["leftovers_cleaned"] == []

    # Nothing left: the root is gone, no loop device is backed by a file
    # below it, nothing is mounted below it, no sandbox holder has it.
    assert set(tmp.glob("crust-demo-*")) == before
    assert not demo_root.exists()
    prefix = str(demo_root) + "/"
    assert loops_left(lambda backing: backing.startswith(prefix)) == {}
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []
    assert holders_under(demo_root / "state", demo_root / "bundle") == []


def test_the_demo_cleanup_kills_only_its_own_sandbox_holders(root):
    """A namespace copied from the host while the demo runs lists the demo's
    host mounts too; only holders with the demo's sandbox-private mounts are
    the demo's to kill."""
    from crust.demo import _kill_sandboxes

    demo_root = root.path / "crust-demo-x"
    on_host = demo_root / "kubelet" / "target"
    private = demo_root / "state" / "handler" / "run" / "pod-1" / "volumes" / "v"
    on_host.mkdir(parents=True)
    private.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "crust-test", str(on_host)], check=True)
    holders = []
    try:
        for _ in range(2):
            holders.append(subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                                             "sleep", "infinity"], start_new_session=True))
        mine = os.readlink("/proc/self/ns/mnt")
        for h in holders:
            wait_until(lambda: os.readlink(f"/proc/{h.pid}/ns/mnt") != mine, what="the namespace")
        foreign, ours = holders
        subprocess.run(["nsenter", f"--target={ours.pid}", "--mount", "--", "mount", "-t", "tmpfs", "-o",
                        "size=4k", "crust-test", str(private)], check=True)
        assert any(e.mount_point == str(on_host) for e in mountinfo_of(foreign.pid))

        _kill_sandboxes(demo_root)
        assert ours.wait(5) == -signal.SIGKILL
        time.sleep(0.2)
        assert foreign.poll() is None, "the demo killed a sandbox that was not its own"
    finally:
        for h in holders:
            h.kill()
            h.wait()


# -- a running sandbox -----------------------------------------------------------------------


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_the_file_system_is_mounted_only_in_the_sandbox(env, fs):
    v = env.volume("pv-run", fs)
    bundle = env.bundle("run", "echo from-sandbox > /data/hello.txt && exec sleep 600",
                        [("/data", str(v.target))])
    info = env.run_ok(bundle, "sb-run")
    (volume,) = info["volumes"]
    assert (volume["target_path"], volume["device"], volume["fs_type"], volume["destinations"]) == \
        (str(v.target), v.device, fs, ["/data"])
    mount_point = volume["mount_point"]

    # The file system: in the holder's mount table (the sandbox-private mount
    # point and the container's /data), never in the host's.
    in_sandbox = entries_of(info["pid"], v.majmin)
    assert sorted(e.mount_point for e in in_sandbox) == sorted([mount_point, rootfs_of(bundle) + "/data"])
    assert all(e.fs_type == fs and not e.readonly for e in in_sandbox)
    assert entries_of("self", v.majmin) == []

    # The process's file: through the sandbox, not on the host's target,
    # which still holds only the empty read-only placeholder.
    written = view(info, mount_point) / "hello.txt"
    wait_until(written.exists, what="the sandbox process's file")
    assert written.read_text() == "from-sandbox\n"
    assert (view(info, rootfs_of(bundle)) / "data" / "hello.txt").read_text() == "from-sandbox\n"
    assert os.listdir(v.target) == []
    placeholder = sysmount.at(str(v.target))
    assert placeholder.fs_type == "tmpfs" and placeholder.readonly
    assert os.listdir(mount_point) == [], "the host sees the sandbox's mount point as an empty directory"
    assert pid_alive(info["process_pid"])

    # The claim names the sandbox and its holder.
    (claim,) = env.claims()
    assert (claim.target_path, claim.handler, claim.sandbox_id, claim.sandbox_pid) == \
        (str(v.target), "mountns", "sb-run", info["pid"])

    # While held, kubelet's unpublish is told to retry.
    with pytest.raises(grpc.RpcError) as exc:
        env.unpublish(v)
    assert exc.value.code() == Code.UNAVAILABLE and "sb-run" in exc.value.details()

    env.delete("sb-run")
    assert not pid_alive(info["pid"]) and not pid_alive(info["process_pid"])
    assert env.mounting(v) == []
    assert env.claims() == [] and env.sandboxes() == {}
    env.unpublish(v)
    env.publish_on_host(v)
    assert (v.target / "hello.txt").read_text() == "from-sandbox\n"
    env.unpublish(v)


# -- subpaths -----------------------------------------------------------------------------------


def assert_nothing_left(env: Env, v: Vol) -> None:
    assert env.sandboxes() == {}
    assert env.claims() == []
    assert env.holders() == []
    assert env.mounting(v) == []
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(str(env.path / "bundles"))] == []


def test_subpaths_show_only_their_directory_and_escapes_are_refused(env):
    v = env.create("pv-sub")
    # A host publish lays the volume out: a deep directory, a file at the
    # top, a symlink out of the volume and a symlink inside it.
    env.publish_on_host(v)
    (v.target / "sub" / "dir").mkdir(parents=True)
    (v.target / "sub" / "dir" / "inner").write_text("deep\n")
    (v.target / "top").write_text("top\n")
    (v.target / "link").symlink_to("/etc")
    (v.target / "sub" / "lnk").symlink_to("dir")
    env.unpublish(v)
    env.publish_deferred(v)

    bundle = env.bundle("sub", "echo new > /sub/new && exec sleep 600", [("/sub", f"{v.target}/sub/dir")])
    info = env.run_ok(bundle, "sb-sub")
    (volume,) = info["volumes"]
    assert volume["destinations"] == ["/sub"] and volume["subpaths"] == ["sub/dir"]
    dest = view(info, rootfs_of(bundle) + "/sub")
    wait_until((dest / "new").exists, what="the sandbox process's file")
    assert sorted(os.listdir(dest)) == ["inner", "new"]
    assert (dest / "inner").read_text() == "deep\n"
    (bound,) = [e for e in entries_of(info["pid"], v.majmin) if e.mount_point == rootfs_of(bundle) + "/sub"]
    assert bound.root == "/sub/dir"
    assert (view(info, volume["mount_point"]) / "sub" / "dir" / "new").read_text() == "new\n"
    assert entries_of("self", v.majmin) == []
    env.delete("sb-sub")
    assert_nothing_left(env, v)

    # '..' is refused before anything is touched.
    for i, source in enumerate([f"{v.target}/sub/../top", f"{v.target}/sub/dir/../../..", f"{v.target}/.."]):
        out = env.run(env.bundle(f"dots-{i}", "exec sleep 600", [("/x", source)]), f"sb-dots-{i}")
        assert out.returncode != 0 and "INVALID_ARGUMENT" in out.stderr and "'..'" in out.stderr, out.stderr
        assert_nothing_left(env, v)

    # A symlink on the way, out of the volume or inside it, is refused, and
    # the refused sandbox is undone (unmounted, released, holder gone).
    for i, source in enumerate([f"{v.target}/link", f"{v.target}/link/passwd", f"{v.target}/sub/lnk/inner"]):
        out = env.run(env.bundle(f"link-{i}", "exec sleep 600", [("/x", source)]), f"sb-link-{i}")
        assert out.returncode != 0 and "INVALID_ARGUMENT" in out.stderr and "symlink" in out.stderr, out.stderr
        assert_nothing_left(env, v)

    env.unpublish(v)


def test_two_containers_share_one_mount_of_the_volume(env):
    v = env.volume("pv-shared", "xfs")
    # /c: a third, read-only view of the same volume.
    script = ("echo shared > /a/x && cat /b/x > /b/copy && "
              "if echo no > /c/y; then echo c-writable > /a/bad; fi; cat /c/x > /a/from-c; exec sleep 600")
    bundle = env.bundle("shared", script, [("/a", str(v.target)), ("/b", str(v.target)),
                                           ("/c", str(v.target), ["rbind", "ro"])])
    info = env.run_ok(bundle, "sb-shared")
    (volume,) = info["volumes"]
    assert volume["destinations"] == ["/a", "/b", "/c"]
    from_c = view(info, rootfs_of(bundle)) / "a" / "from-c"  # written last
    wait_until(lambda: from_c.exists() and from_c.read_text(), what="the copy read via /c")
    assert from_c.read_text() == "shared\n"
    assert (view(info, rootfs_of(bundle)) / "b" / "copy").read_text() == "shared\n"
    assert not (view(info, volume["mount_point"]) / "bad").exists()
    assert not (view(info, volume["mount_point"]) / "y").exists()
    # One mount of the file system plus its views.
    entries = {e.mount_point: e for e in entries_of(info["pid"], v.majmin)}
    assert sorted(entries) == sorted([volume["mount_point"]] + [rootfs_of(bundle) + d for d in ("/a", "/b", "/c")])
    assert all(e.root == "/" for e in entries.values())
    assert [p for p, e in entries.items() if e.readonly] == [rootfs_of(bundle) + "/c"]
    assert entries_of("self", v.majmin) == []
    env.delete("sb-shared")
    assert env.mounting(v) == [] and env.claims() == []
    env.unpublish(v)


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


def test_a_sandbox_has_its_own_network_with_only_loopback(env):
    v = env.volume("pv-net")
    bundle = env.bundle("net", "cat /proc/net/dev && exec sleep 600", [("/data", str(v.target))])
    info = env.run_ok(bundle, "sb-net")
    name = netns.name_for(env.handler.state_dir / "run" / "sb-net")
    assert name in listnetns()
    assert netns.interfaces(name) == {"lo": True}, "only the loopback, and it is up"
    # The pod's process is in that namespace and sees only lo.
    named = os.stat(f"/run/netns/{name}")
    process_ns = os.stat(f"/proc/{info['process_pid']}/ns/net")
    assert (process_ns.st_dev, process_ns.st_ino) == (named.st_dev, named.st_ino)
    assert os.readlink(f"/proc/{info['process_pid']}/ns/net") != os.readlink("/proc/self/ns/net")
    seen = wait_until(lambda: "lo:" in env.process_log("sb-net") and env.process_log("sb-net"),
                      what="the process's /proc/net/dev")
    assert [line.split(":")[0].strip() for line in seen.splitlines() if ":" in line] == ["lo"]
    env.delete("sb-net")
    assert name not in listnetns(), "the sandbox's network namespace outlived it"
    env.unpublish(v)


def test_network_namespaces_are_reconciled_after_the_handler_was_killed(short_lease):
    env = short_lease
    v = env.volume("pv-netgone")
    info = env.run_ok(env.bundle("netgone", "exec sleep 600", [("/data", str(v.target))]), "sb-netgone")
    name = netns.name_for(env.handler.state_dir / "run" / "sb-netgone")
    # A namespace of this handler whose sandbox was never recorded (killed
    # between making it and recording the sandbox).
    stray = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"])
    try:
        wait_until(lambda: os.readlink(f"/proc/{stray.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
                   what="the stray namespace")
        orphan = netns.prefix_for(env.handler.state_dir / "run") + "orphan"
        netns.attach(orphan, stray.pid)
    finally:
        stray.kill()
        stray.wait()
    foreign = "crust-00000000-notours"
    stray = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"])
    try:
        wait_until(lambda: os.readlink(f"/proc/{stray.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
                   what="the foreign namespace")
        netns.attach(foreign, stray.pid)
    finally:
        stray.kill()
        stray.wait()
    try:
        assert {name, orphan, foreign} <= set(listnetns())
        env.kill_handler_until_expired()
        # The sandbox dies while its handler is down.
        os.kill(info["pid"], signal.SIGKILL)
        kill_container_processes(env.path / "bundles")
        env.restart_handler()
        wait_until(lambda: name not in listnetns() and orphan not in listnetns(), timeout=15,
                   what="the dead sandbox's and the orphan's namespaces to be removed")
        assert foreign in listnetns(), "the handler removed a namespace that is not its own"
    finally:
        netns.remove(foreign)
    env.unpublish(v)


# -- fsGroup -------------------------------------------------------------------------------------


def test_fs_group_always_and_on_root_mismatch(env):
    v = env.volume("pv-group", group="2000", policy="Always")
    assert env.entry(v)["metadata"] == {"fsGroup": "2000", "fsGroupChangePolicy": "Always"}
    script = ("echo new > /data/new && mkdir /data/d && echo o > /data/d/other && "
              "chgrp 0 /data/d/other && chmod 0600 /data/d/other")
    info = env.run_ok(env.bundle("group-1", script, [("/data", str(v.target))]), "sb-group-1")
    env.wait_exited("sb-group-1")
    vroot = view(info, info["volumes"][0]["mount_point"])
    st = os.stat(vroot)
    assert st.st_gid == 2000 and st.st_mode & GROUP_BITS == GROUP_BITS
    assert os.stat(vroot / "lost+found").st_gid == 2000, "Always walks the whole tree"
    assert os.stat(vroot / "new").st_gid == 2000, "a file the process creates inherits the group"
    assert os.stat(vroot / "d").st_gid == 2000 and os.stat(vroot / "d").st_mode & stat.S_ISGID
    other = os.stat(vroot / "d" / "other")
    assert (other.st_gid, stat.S_IMODE(other.st_mode)) == (0, 0o600)
    env.delete("sb-group-1")
    env.unpublish(v)

    # OnRootMismatch: the root already has the group and the permissions,
    # so the file with another group is left alone.
    env.publish_deferred(v, group="2000", policy="OnRootMismatch")
    assert env.entry(v)["metadata"] == {"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"}
    info = env.run_ok(env.bundle("group-2", "ls -ln /data/d", [("/data", str(v.target))]), "sb-group-2")
    env.wait_exited("sb-group-2")
    vroot = view(info, info["volumes"][0]["mount_point"])
    assert os.stat(vroot).st_gid == 2000
    other = os.stat(vroot / "d" / "other")
    assert (other.st_gid, stat.S_IMODE(other.st_mode)) == (0, 0o600)
    env.delete("sb-group-2")
    env.unpublish(v)

    # Always changes it.
    env.publish_deferred(v, group="2000", policy="Always")
    info = env.run_ok(env.bundle("group-3", "true", [("/data", str(v.target))]), "sb-group-3")
    vroot = view(info, info["volumes"][0]["mount_point"])
    other = os.stat(vroot / "d" / "other")
    assert other.st_gid == 2000 and stat.S_IMODE(other.st_mode) == 0o660
    env.delete("sb-group-3")
    env.unpublish(v)

    # OnRootMismatch on a fresh volume (root group 0): the tree is walked.
    w = env.volume("pv-group-fresh", group="2000", policy="OnRootMismatch")
    info = env.run_ok(env.bundle("group-4", "echo x > /data/f", [("/data", str(w.target))]), "sb-group-4")
    env.wait_exited("sb-group-4")
    vroot = view(info, info["volumes"][0]["mount_point"])
    st = os.stat(vroot)
    assert st.st_gid == 2000 and st.st_mode & GROUP_BITS == GROUP_BITS
    assert os.stat(vroot / "lost+found").st_gid == 2000 and os.stat(vroot / "f").st_gid == 2000
    env.delete("sb-group-4")
    env.unpublish(w)


# -- one writer ------------------------------------------------------------------------------------


def test_a_second_sandbox_on_a_single_writer_volume_is_refused(env):
    v = env.volume("pv-single")
    a = env.run_ok(env.bundle("a", "exec sleep 600", [("/data", str(v.target))]), "sb-a")
    bundle_b = env.bundle("b", "exec sleep 600", [("/data", str(v.target))])
    out = env.run(bundle_b, "sb-b")
    assert out.returncode != 0
    assert "FAILED_PRECONDITION" in out.stderr and "sandbox sb-a" in out.stderr, out.stderr
    # B left nothing: no sandbox, no claim, no holder, no mount.
    assert list(env.sandboxes()) == ["sb-a"]
    assert env.claim_set() == {(str(v.target), "mountns", "sb-a")}
    assert env.holders() == [a["pid"]]
    assert set(env.mounting(v)) == {a["pid"], a["process_pid"]}
    assert len(entries_of(a["pid"], v.majmin)) == 2
    assert [m for m in sysmount.mounts() if m.mount_point.startswith(str(bundle_b))] == []
    env.delete("sb-a")
    # Once A is gone, B may run.
    b = env.run_ok(bundle_b, "sb-b")
    assert set(env.mounting(v)) == {b["pid"], b["process_pid"]}
    env.delete("sb-b")
    env.unpublish(v)


# -- handler restarts ------------------------------------------------------------------------------


def test_stats_follow_the_kernel_when_the_mount_changes_behind_the_handler(env):
    """The condition is asked of the kernel on every call: a volume remounted
    read-only, or unmounted, inside the sandbox by someone else shows at once
    through the proxy, and so does its recovery."""
    v = env.volume("pv-cond")
    a = env.run_ok(env.bundle("cond", "exec sleep 600", [("/data", str(v.target))]), "sb-cond")
    mount_point = a["volumes"][0]["mount_point"]
    inside = ["nsenter", f"--target={a['pid']}", "--mount", "--"]

    def condition() -> csi_pb2.VolumeCondition:
        return env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=v.volume_id, volume_path=str(v.target)), timeout=30).volume_condition

    assert not condition().abnormal
    subprocess.run(inside + ["mount", "-o", "remount,ro", mount_point], check=True)
    c = condition()
    assert c.abnormal and "read-only" in c.message
    subprocess.run(inside + ["mount", "-o", "remount,rw", mount_point], check=True)
    assert not condition().abnormal
    subprocess.run(inside + ["umount", mount_point], check=True)
    c = condition()
    assert c.abnormal and "not mounted" in c.message
    env.delete("sb-cond")
    assert env.mounting(v) == []
    env.unpublish(v)


def test_a_sandbox_survives_a_handler_restart(short_lease):
    env = short_lease
    v = env.volume("pv-keep")
    bundle = env.bundle("keep", "echo before > /data/a.txt && exec sleep 600", [("/data", str(v.target))])
    a = env.run_ok(bundle, "sb-keep")
    mount_point = a["volumes"][0]["mount_point"]
    wait_until((view(a, mount_point) / "a.txt").exists, what="the sandbox process's file")

    env.kill_handler_until_expired()
    down = env.volume("pv-down")  # published while the handler is down
    # The sandbox runs on without its handler, and its claim holds (its
    # holder lives) although the handler's lease expired.
    assert pid_alive(a["pid"]) and pid_alive(a["process_pid"])
    assert len(entries_of(a["pid"], v.majmin)) == 2
    assert env.claim_set() == {(str(v.target), "mountns", "sb-keep")}
    with pytest.raises(grpc.RpcError) as exc:
        env.unpublish(v)
    assert exc.value.code() == Code.UNAVAILABLE

    env.restart_handler()
    h = env.handlers()["mountns"]
    assert not h.lease_expired and h.lease_age_seconds < 3
    listed = env.sandboxes()
    assert list(listed) == ["sb-keep"] and listed["sb-keep"]["pid"] == a["pid"]
    assert listed["sb-keep"]["state"] == "RUNNING"
    (claim,) = env.claims()
    assert (claim.target_path, claim.sandbox_id, claim.sandbox_pid) == (str(v.target), "sb-keep", a["pid"])

    # Stats through the proxy are still measured inside the sandbox.
    stats = env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v.volume_id, volume_path=str(v.target)), timeout=30)
    assert not stats.volume_condition.abnormal and "sandbox" in stats.volume_condition.message
    by_unit = {u.unit: u for u in stats.usage}
    sv = os.statvfs(view(a, mount_point))
    assert by_unit[Usage.BYTES].total == sv.f_blocks * sv.f_frsize
    assert by_unit[Usage.INODES].total == sv.f_files

    # The restarted handler indexes the volumes published while it was down
    # and after it came back: a new sandbox mounts both.
    w = env.volume("pv-new")
    n = env.run_ok(env.bundle("new", "echo after > /w/b.txt && echo down > /d/c.txt && exec sleep 600",
                              [("/w", str(w.target)), ("/d", str(down.target))]), "sb-new")
    assert sorted(x["target_path"] for x in n["volumes"]) == sorted([str(w.target), str(down.target)])
    wait_until((view(n, rootfs_of(env.path / "bundles" / "new")) / "d" / "c.txt").exists,
               what="the new sandbox's file")
    for x in (w, down):
        assert len(entries_of(n["pid"], x.majmin)) == 2 and entries_of("self", x.majmin) == []
    assert env.claim_set() == {(str(v.target), "mountns", "sb-keep"), (str(w.target), "mountns", "sb-new"),
                               (str(down.target), "mountns", "sb-new")}
    env.delete("sb-new")
    assert env.mounting(w) == [] and env.mounting(down) == []

    # Deleting the survivor after the restart stops its process, unmounts and releases.
    env.delete("sb-keep")
    assert env.claims() == [] and env.sandboxes() == {}
    assert not pid_alive(a["pid"])
    wait_until(lambda: not pid_alive(a["process_pid"]), timeout=5, what="the container process to die")
    assert env.mounting(v) == []
    for x in (v, w, down):
        env.unpublish(x)
    env.publish_on_host(v)
    assert (v.target / "a.txt").read_text() == "before\n"
    env.unpublish(v)


def test_a_handler_killed_and_started_at_once_comes_back_under_its_lease(env):
    """The lease is the handler's identity: kept in its state directory
    (0600), it lets the restarted handler take its name and its sandbox's
    claim back at once, while its old lease is still alive (without it the
    proxy refuses the name until the lease expires)."""
    v = env.volume("pv-again")
    a = env.run_ok(env.bundle("again", "exec sleep 600", [("/data", str(v.target))]), "sb-again")
    lease_file = env.handler.state_dir / "lease"
    assert stat.S_IMODE(os.lstat(lease_file).st_mode) == 0o600
    lease = lease_file.read_text()
    record = env.proxy.state_dir / "handlers" / "mountns.json"
    assert lease not in record.read_text(), "the proxy keeps a hash, not the lease"

    env.handler.kill()
    assert not env.handlers()["mountns"].lease_expired
    env.handler.start()
    wait_until(lambda: env.handler.sandbox("list").returncode == 0, what="the handler's socket")
    wait_until(lambda: env.handlers()["mountns"].lease_age_seconds < 2, timeout=10, what="a renewed lease")
    assert lease_file.read_text() == lease
    log = env.handler.log_path.read_text()
    assert "our name is held by another live handler" not in log and lease not in log
    (claim,) = env.claims()
    assert (claim.target_path, claim.sandbox_id, claim.sandbox_pid) == (str(v.target), "sb-again", a["pid"])
    stats = env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
        volume_id=v.volume_id, volume_path=str(v.target)), timeout=30)
    assert not stats.volume_condition.abnormal
    env.delete("sb-again")
    assert env.claims() == []
    env.unpublish(v)


def test_a_sandbox_that_died_while_the_handler_was_down_is_released(short_lease):
    env = short_lease
    v = env.volume("pv-dead")
    a = env.run_ok(env.bundle("dead", "echo x > /data/x && exec sleep 600", [("/data", str(v.target))]), "sb-dead")
    wait_until((view(a, a["volumes"][0]["mount_point"]) / "x").exists, what="the sandbox process's file")

    env.kill_handler_until_expired()
    os.kill(a["pid"], signal.SIGKILL)
    wait_until(lambda: not pid_alive(a["pid"]), what="the holder to die")
    # The container process still pins the file system in its namespace.
    assert env.mounting(v) == [a["process_pid"]]
    assert env.claim_set() == {(str(v.target), "mountns", "sb-dead")}, "the claim stays until released"

    env.restart_handler()
    wait_until(lambda: env.claims() == [], what="the dead sandbox's claim to be released")
    assert env.sandboxes() == {}
    assert not pid_alive(a["process_pid"]) and env.mounting(v) == []
    # The volume is free again: a new sandbox takes it, then kubelet unpublishes.
    b = env.run_ok(env.bundle("after", "cat /data/x", [("/data", str(v.target))]), "sb-after")
    env.wait_exited("sb-after")
    assert env.process_log("sb-after") == "x\n"
    assert env.claim_set() == {(str(v.target), "mountns", "sb-after")}
    env.delete("sb-after")
    assert not pid_alive(b["pid"])
    env.unpublish(v)


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
