"""The mount-namespace handler's test stack, shared by the tests that run pod sandboxes on it.

Env starts real `crust driver` -> `crust shim` -> `crust proxy` processes
and a real `crust handler` registered with the proxy (tests.harness.daemons Root),
plays kubelet over the proxy's CSI socket (NodePublishVolume with
defer_fs_ops, target paths laid out as kubelet lays them out), reads the
proxy's registry (ListClaims, ListHandlers) and starts pod sandboxes with
`crust sandbox run` on OCI bundles whose root is an empty directory (the
handler binds the host's /bin, /usr, ... read-only into it) and whose mounts
name the CSI target path. The readers below ask the kernel: a process's
/proc/<pid>/mountinfo, a sandbox's files through /proc/<pid>/root.

The fixtures: make_env (Envs on the `root` fixture's temporary directory;
at teardown their sandboxes are deleted and their container processes
killed), env (one Env) and short_lease (a proxy whose leases expire after
3 s). A module that uses env or short_lease imports make_env too.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc
from crust.contract.mountinfo import digest
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, AccessMode, kill_processes_rooted_under, wait_until

SIZE = {"ext4": 32 * MIB, "xfs": 300 * MIB}


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


def policy_file(root: Path) -> Path:
    """The proxy's policy file: defer on the StorageClass parameter; no
    Kubernetes API here, so the pod is never looked up (fsGroup comes from
    kubelet)."""
    path = root / "policy.yaml"
    path.write_text('deferral:\n  storageClassParameters:\n    crust.dev/defer: "true"\n  fsGroupFromPod: false\n')
    return path


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
    def __init__(self, root, proxy_extra=(), start_handler: bool = True, shim_extra=(), **handler_kw):
        self.root = root
        self.driver, self.shim, self.proxy = root.stack(proxy_extra=list(proxy_extra), shim_extra=list(shim_extra))
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
