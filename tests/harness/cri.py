"""Test harness for the CRI tests: a private containerd (crust.kubelet.containerd)
with the tiny busybox image imported, and checks that it left nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from crust.api import handler_pb2, handler_pb2_grpc
from crust.contract.mountinfo import digest
from crust.kubelet import Container, Kubelet, PersistentVolume, Pod, VolumeMount
from crust.kubelet import image as images
from crust.kubelet.containerd import CGROUP_FS, SHIM_SOCKETS, Containerd, is_shim
from crust.kubelet.cri import KubeletRuntime
from crust.oci_runtime import frontend
from crust.sys import mount as sysmount
from tests.harness import upstream
from tests.harness.handler_log import entries
from tests.harness.pool_log import READY, wait_for_pool
from tests.harness.upstream import CONTAINERD2


@contextlib.contextmanager
def private_containerd(runtimes: dict[str, str] | None = None, env: dict[str, str] | None = None,
                       shim_runtimes: dict[str, str] | None = None, shim_options: dict[str, dict] | None = None,
                       mirrors: dict[str, str] | None = None, pod_network: bool = False,
                       sandbox_image: str = "", binary: str = "containerd"
                       ) -> Iterator[tuple[Containerd, images.Image]]:
    """A started containerd (the one on PATH unless binary names another)
    with the busybox image (also its pause image, unless another is named);
    closed and checked clean afterwards, whatever the test did."""
    directory = Path(tempfile.mkdtemp(prefix="crust-cri-"))
    image = images.build(directory / "images")
    containerd = Containerd(directory / "containerd", sandbox_image=sandbox_image or image.name,
                            runtimes=runtimes or {"runc": ""}, env=env or {}, shim_runtimes=shim_runtimes or {},
                            shim_options=shim_options or {}, mirrors=mirrors or {}, pod_network=pod_network,
                            binary=binary)
    try:
        containerd.start()
        containerd.import_image(image)
        yield containerd, image
    finally:
        containerd.close()
        shutil.rmtree(directory, ignore_errors=True)
    leftovers = leftovers_of(containerd)
    assert not leftovers, f"the private containerd left: {leftovers}"


def host_network_pod(containerd: Containerd, name: str, uid: str) -> cri.PodSandboxConfig:
    """A bare pod sandbox config on the host's network, its logs and cgroup
    below the private containerd's."""
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, namespace="default", uid=uid),
        log_directory=str(containerd.directory / "logs" / uid),
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{containerd.cgroup_root}/pod{uid}",
            security_context=cri.LinuxSandboxSecurityContext(namespace_options=cri.NamespaceOption(
                network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD))))


def processes_naming(text: str) -> list[str]:
    """Processes whose command line holds text (a path of ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in argv:
            command = argv.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {command[:200]}")
    return found


@contextlib.contextmanager
def shims_killed_here(containerd: Containerd) -> Iterator[None]:
    """Around a test's SIGKILL of this containerd's shims: containerd's runc
    shim leaves its socket in containerd's socket directory when killed (its
    delete does not remove it), so the sockets the bundles name now are
    removed afterwards if nobody answers on them any more."""
    from crust.sys.sockets import remove_if_dead

    sockets = containerd.shim_sockets()
    try:
        yield
    finally:
        for path in sockets:
            remove_if_dead(str(path))


def shim_pids(containerd: Containerd) -> list[int]:
    """The shims (runc's, crust's) serving this containerd."""
    ours = str(containerd.socket).encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if argv and is_shim(argv) and ours in argv:
            found.append(int(entry.name))
    return found


def daemon_leftovers(daemon) -> list[str]:
    """What a closed private CRI daemon (containerd, CRI-O) left of its
    own: its directory, processes naming it, mounts below it, cgroups
    below its cgroup root."""
    found = []
    if daemon.directory.exists():
        found.append(f"directory {daemon.directory}")
    found += processes_naming(str(daemon.directory))
    prefix = str(daemon.directory) + "/"
    found += [m.mount_point for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]
    name = daemon.cgroup_root.strip("/")
    found += [str(h / name) for h in CGROUP_FS.iterdir() if (h / name).exists()] if CGROUP_FS.is_dir() else []
    return found


def leftovers_of(containerd: Containerd) -> list[str]:
    """What a closed containerd left: daemon_leftovers, its shim sockets,
    its pod network's bridge."""
    found = daemon_leftovers(containerd)
    if containerd.network is not None and Path(f"/sys/class/net/{containerd.network.bridge}").exists():
        found.append(f"bridge {containerd.network.bridge}")
    if containerd._made_shim_dir and SHIM_SOCKETS.exists():
        sockets = os.listdir(SHIM_SOCKETS / "s") if (SHIM_SOCKETS / "s").is_dir() else []
        if not sockets:
            found.append(f"{SHIM_SOCKETS} (made for our shims, left empty)")
    return found


# crust's OCI runtime as containerd runs it for the RuntimeClass crust-runc:
# crust-runc, the front end `./run` builds beside this interpreter (which
# it starts on crust's entry script where crust has work), built here too
# when it is missing or stale.
# The Python runtime as pip installed it, for the tests that call it directly.
PYTHON_OCI_RUNTIME = Path(sys.executable).parent / "crust-oci-runtime"
OCI_RUNTIME = Path(sys.executable).parent / "crust-runc"
frontend.build(OCI_RUNTIME)


def container_log(status: cri.ContainerStatus) -> str:
    """What the container has written to its CRI log so far."""
    try:
        return Path(status.log_path).read_text(errors="replace")
    except OSError:
        return ""


class CriNode:
    """A node as kubelet sees it: the crust stack (driver, shim, proxy
    serving kubelet's registration, the mount-namespace handler), kubelet's
    CSI side registered with it, a private containerd whose `crust-runc`
    handler is crust's OCI runtime, and kubelet's CRI side against it.
    `containerd` may as well be a private CRI-O (tests/harness/crio.py):
    kubelet needs only its endpoint and cgroup root."""

    def __init__(self, root, containerd: Containerd, image: images.Image, handler_kw: dict | None = None,
                 runtime_classes: dict[str, str] | None = None):
        from tests.harness.handler_env import Env, policy_file

        self.root = root
        kubelet_root = root.path / "kubelet"
        (kubelet_root / "plugins_registry").mkdir(parents=True)
        # handler_kw: another handler than the mount-namespace one (the
        # microVM handler, whose start may build its guest image first).
        self.env = Env(root, proxy_extra=["--kubelet-registration-dir", str(kubelet_root / "plugins_registry"),
                                          "--policy", str(policy_file(root.path))],
                       start_handler=handler_kw is None, **(handler_kw or {}))
        if handler_kw is not None:
            self.env.handler.start(timeout=900)
        self.proxy = self.env.proxy
        self.kubelet = Kubelet(kubelet_root, "node-a", retry_seconds=10)
        self.kubelet.register()
        self.containerd, self.image = containerd, image
        self.runtime = KubeletRuntime(self.kubelet, containerd.endpoint, cgroup_root=containerd.cgroup_root,
                                      runtime_classes=runtime_classes or {"crust-runc": "crust-runc", "runc": "runc"},
                                      pod_logs_dir=root.path / "pod-logs", retry_seconds=0)
        self.runtime.connect()

    def pv(self, name: str, fs: str = "xfs", size: int = 320 * 1024**2, defer: bool = True) -> PersistentVolume:
        from tests.harness.daemons import mount_cap

        vol = self.proxy.create(name, size, mount_cap(fs), parameters={"crust.dev/defer": "true"} if defer else {})
        return PersistentVolume(name=name, volume_handle=vol.volume_id, attributes=dict(vol.volume_context), fs_type=fs)

    def pod(self, name: str, pv: PersistentVolume, script: str, runtime_class: str = "crust-runc",
            fs_group: int | None = 2000, **kw) -> Pod:
        return Pod(uid=f"uid-{name}", name=name, fs_group=fs_group, host_network=True,
                   runtime_class_name=runtime_class, volumes={"data": pv}, restart_policy="Never",
                   termination_grace_period_seconds=2,
                   containers=[Container("app", self.image.name, command=["/bin/sh", "-c", script],
                                         volume_mounts=[VolumeMount("data", "/data")])], **kw)

    def handler_containers(self) -> list[handler_pb2.ContainerInfo] | None:
        """The containers the handler holds volumes for (None: it does not answer)."""
        with grpc.insecure_channel(f"unix://{self.env.handler.socket}") as channel:
            try:
                return list(handler_pb2_grpc.ContainerVolumesStub(channel).ListContainers(
                    handler_pb2.ListContainersRequest(), timeout=2).containers)
            except grpc.RpcError:
                return None

    def restart_handler(self) -> None:
        """SIGKILL the handler and start it again; back once it answers."""
        from tests.harness.daemons import wait_until

        self.env.handler.kill()
        self.env.handler.start()
        wait_until(lambda: self.handler_containers() is not None, what="the restarted handler's socket")

    def claims(self) -> set[tuple[str, str, str]]:
        return self.env.claim_set()

    def container(self, pod: Pod) -> cri.ContainerStatus:
        return self.runtime.pod_status(pod).latest("app")

    def entry(self, pod: Pod, pv: PersistentVolume) -> dict:
        return json.loads((self.proxy.volumes_dir / digest(str(self.kubelet.target_path(pod, pv)))
                           / "mountInfo.json").read_text())

    def host_mounts_of(self, entry: dict) -> list[str]:
        """Where the host's mount table has the volume's file system."""
        return [m.mount_point for m in sysmount.of_device(entry["device-major"], entry["device-minor"])]

    def close(self) -> None:
        self.runtime.close()


@contextlib.contextmanager
def cri_node(root, binary: str = "containerd") -> Iterator[CriNode]:
    """The node, its containerd running crust's OCI runtime against the
    node's handler; everything closed (pods first) whatever happens."""
    env = {"CRUST_HANDLER_ENDPOINT": f"unix://{root.path / 'handler.sock'}",
           "CRUST_OCI_RUNTIME_STATE": str(root.path / "oci-runtime")}
    with private_containerd(runtimes={"runc": "", "crust-runc": str(OCI_RUNTIME)}, env=env,
                            binary=binary) as (containerd, image):
        node = CriNode(root, containerd, image)
        try:
            yield node
        finally:
            node.close()


KATA_HANDLER = dict(name="kata", endpoint_name="kata.sock", command=("kata", "handler"))


@contextlib.contextmanager
def cri_microvm_node(root, pod_network: bool = False, vm_pool: int = 0,
                     handler_extra: tuple[str, ...] = (), binary: str = "containerd",
                     shim_group: str = "") -> Iterator[CriNode]:
    """The node with the microVM handler, its containerd's runtime `crust`
    being crust's shim v2 in front of it (RuntimeClass crust-microvm);
    pod_network: pods off the host's network get a bridge of their own;
    handler_extra: more of the handler's arguments; shim_group: which pods
    share a shim process (the shim's default when empty)."""
    env = {"CRUST_KATA_HANDLER_ENDPOINT": kata_handler_endpoint(root),
           **({"CRUST_SHIM_GROUP": shim_group} if shim_group else {})}
    with private_containerd(shim_runtimes={"crust": "io.containerd.crust.v2"}, env=env,
                            pod_network=pod_network, binary=binary) as (containerd, image):
        with microvm_node(root, containerd, image, vm_pool, handler_extra) as node:
            yield node


# The containerds a CRI test may run against: Debian's (1.6, on PATH) and,
# where the machine has one, a containerd 2.x (tests/harness/upstream.py's
# CONTAINERD2; its tests skipped without it).
ON_CONTAINERD2 = upstream.suite("containerd 2.x", CONTAINERD2)
CONTAINERDS = [pytest.param("containerd", id="containerd"),
               pytest.param("containerd2", id="containerd2", marks=ON_CONTAINERD2)]


def containerd_binary(name: str) -> str:
    """A CONTAINERDS param's binary."""
    return str(upstream.path(CONTAINERD2)) if name == "containerd2" else "containerd"


def kata_handler_endpoint(root) -> str:
    """Where the node's microVM handler listens."""
    return f"unix://{root.path / KATA_HANDLER['endpoint_name']}"


@contextlib.contextmanager
def microvm_node(root, daemon, image: images.Image, vm_pool: int = 0,
                 handler_extra: tuple[str, ...] = ()) -> Iterator[CriNode]:
    """The node of a CRI daemon (containerd, CRI-O) whose runtime handler
    `crust` is crust's shim v2, with the microVM handler serving it
    (RuntimeClass crust-microvm); closed (pods first) whatever happens."""
    # CRUST_TEST_KATA_CACHE: another guest image cache than the default, as for tests/harness/kata_env.py.
    cache = os.environ.get("CRUST_TEST_KATA_CACHE")
    node = CriNode(root, daemon, image,
                   handler_kw={**KATA_HANDLER, "extra": ["--kata-dir", str(root.path / "kata"),
                                                         *(["--cache", cache] if cache else []),
                                                         "--vm-pool", str(vm_pool), *handler_extra]},
                   runtime_classes={"crust-microvm": "crust", "runc": "runc"})
    try:
        if vm_pool:
            # The pool boots at nice 10: on a busy machine its first VM can
            # take longer than the test's set-up, and a pod that comes
            # earlier boots a VM of its own, which is not what a test with
            # a pool is about.
            wait_for_pool(node.env.handler, lambda: entries(node.env.handler, READY), "the pool's first VM")
        yield node
    finally:
        node.close()
