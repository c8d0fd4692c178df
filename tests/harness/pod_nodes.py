"""A node whose RuntimeClass runs pods through CRI, for the tests and
benchmarks of pods as kubelet starts them: a private containerd (and, for
crust's runtimes, the crust stack they use; tests/harness/cri.py) with
kubelet's volume manager replayed (crust.kubelet.volumes) and its CRI side
(crust.kubelet.cri): PodNode, pod_node, the `node` fixture (once per
RuntimeClass of RUNTIME_CLASSES), and a reading of the CRI log (cri_log).

runc (containerd's default handler) is the baseline. CRUST_POD_RUNTIME_CLASSES
(comma-separated) runs the `node` tests under others: crust-runc (crust's
OCI runtime) or crust-microvm (crust's shim v2 and the microVM handler).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import Container, Kubelet, Pod, VolumeManager, VolumeMount
from crust.kubelet import image as images
from crust.kubelet.containerd import Containerd
from crust.kubelet.cri import KubeletRuntime
from crust.sys import mount as sysmount
from tests.harness.cri import cri_microvm_node, cri_node, private_containerd
from tests.harness.daemons import wait_until

KNOWN_RUNTIME_CLASSES = ("runc", "crust-runc", "crust-microvm")
# runc is the baseline every case is checked against; crust-microvm shares
# the pod's volumes with its VM through virtio-fs.
RUNTIME_CLASSES = [name for name in os.environ.get("CRUST_POD_RUNTIME_CLASSES", "runc,crust-microvm").split(",")
                   if name]
# A container that keeps running until kubelet stops it, then exits 0.
KEEP_RUNNING = "trap 'exit 0' TERM; sleep infinity & wait"
# How soon a configMap update must be visible in a running container. With
# runc the container reads the very directory the writer switched; the
# bound is for runtimes that share it through a file system of their own.
UPDATE_VISIBLE_WITHIN = 5.0
CA_CRT = "-----BEGIN CERTIFICATE-----\nMIIBcluster-ca\n-----END CERTIFICATE-----\n"
MiB = 1024 * 1024


def sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def mounts_below(path: Path) -> list[str]:
    prefix = str(path) + "/"
    return [m.mount_point for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]


def service_links(total: int) -> dict[str, str]:
    """The variables kubelet gives a container for each Service of its
    namespace, for as many Services as make `total` bytes."""
    env: dict[str, str] = {}
    n = 0
    while sum(len(k) + len(v) + 2 for k, v in env.items()) < total:
        name, ip = f"SERVICE_{n:04d}", f"10.96.{n // 250}.{n % 250 + 1}"
        env.update({f"{name}_SERVICE_HOST": ip, f"{name}_SERVICE_PORT": "8080",
                    f"{name}_PORT": f"tcp://{ip}:8080", f"{name}_PORT_8080_TCP": f"tcp://{ip}:8080",
                    f"{name}_PORT_8080_TCP_PROTO": "tcp", f"{name}_PORT_8080_TCP_PORT": "8080",
                    f"{name}_PORT_8080_TCP_ADDR": ip})
        n += 1
    return env


# -- the node: a containerd whose RuntimeClass runs the pods, kubelet's two managers -------------------


@dataclass
class PodNode:
    runtime: KubeletRuntime
    image: images.Image
    runtime_class: str
    host_dir: Path  # where hostPath volumes of the tests point
    containerd: Containerd
    handler_log: Path | None = None  # the microVM handler's log (crust-microvm only)
    handler: object | None = None    # the microVM handler's process (tests.harness.daemons.HandlerProcess)

    def image_with(self, tag: str, *files: images.File) -> str:
        """The busybox image with a layer of these files on top, imported; its name."""
        busybox = images.find_busybox()
        made = images.assemble([images.layer_tar(busybox), images.layer_of(list(files))],
                               {"Env": [f"PATH={images.PATH}"], "Cmd": ["sh"], "WorkingDir": "/"},
                               created_by="crust tests")
        archive = self.host_dir / f"{tag}.oci.tar"
        name = f"{images.REPOSITORY}:{tag}"
        made.write_archive(archive, name, tag)
        self.containerd.import_image(images.Image(archive=archive, name=name, image_id=made.config_digest,
                                                  busybox_version=""))
        return name

    @property
    def volumes(self) -> VolumeManager:
        return self.runtime.volumes

    @property
    def kubelet_root(self) -> Path:
        return self.runtime.kubelet.root

    def pod(self, name: str, containers: list[Container], volumes: dict, runtime_class: str = "", **kw) -> Pod:
        """runtime_class: another than the node's (runc beside crust-microvm)."""
        kw.setdefault("host_network", True)
        kw.setdefault("restart_policy", "Never")
        return Pod(uid=f"uid-{name}", name=name, runtime_class_name=runtime_class or self.runtime_class,
                   termination_grace_period_seconds=2, containers=containers, volumes=volumes, **kw)

    def container(self, name: str, script: str, *mounts: VolumeMount, **kw) -> Container:
        return Container(name, self.image.name, command=sh(script), volume_mounts=list(mounts), **kw)

    def status(self, pod: Pod, name: str) -> cri.ContainerStatus:
        found = self.runtime.pod_status(pod).latest(name)
        assert found is not None, f"no container {name} in pod {pod.name}"
        return found

    def read_until(self, container_id: str, path: str, expected: bytes, what: str, **wait) -> None:
        """Read path in the container (ExecSync cat) until it holds expected,
        across an atomic-writer update: every read must succeed, under runc
        (the writer's rename is atomic for the container's own lookups) and
        in the microVM (the guest reads its own copy of such a volume, which
        its agent switches to each new version the same way:
        crust.kata.vmm.share)."""
        failed: list[tuple[int, bytes]] = []

        def read() -> bool:
            out = self.runtime.exec_sync(container_id, ["/bin/cat", path])
            if out.exit_code != 0:
                failed.append((out.exit_code, out.stderr))
            return out.stdout == expected

        wait_until(read, what=what, **wait)
        assert failed == [], failed

    def run(self, container_id: str, *cmd: str) -> bytes:
        """A command in the container (ExecSync); its output, exit code 0 required."""
        out = self.runtime.exec_sync(container_id, list(cmd))
        assert out.exit_code == 0, (cmd, out.exit_code, out.stderr)
        return out.stdout

    @contextlib.contextmanager
    def running(self, pod: Pod) -> Iterator[None]:
        """The pod's volumes set up and the pod started; afterwards stopped,
        removed, its volumes torn down, and nothing of it left."""
        try:
            self.volumes.set_up(pod)
            self.runtime.run_pod(pod)
            yield
        finally:
            self.stop(pod)
        self.assert_gone(pod)

    def stop(self, pod: Pod) -> None:
        self.runtime.kill_pod(pod)
        self.runtime.remove_pod(pod)
        self.volumes.tear_down(pod)
        assert self.volumes.clean_pod_dir(pod)

    def assert_gone(self, pod: Pod) -> None:
        assert not self.volumes.pod_dir(pod).exists()
        assert mounts_below(self.kubelet_root) == []


@contextlib.contextmanager
def pod_node(runtime_class: str, root, pod_network: bool = False, vm_pool: int = 0,
             handler_extra: tuple[str, ...] = ()) -> Iterator[PodNode]:
    """A node whose RuntimeClass `runtime_class` runs pods: a private
    containerd (and, for crust's runtimes, the crust stack they use);
    pod_network: a bridge for the pods off the host's network (CNI);
    vm_pool: VMs the microVM handler boots ahead of its pods;
    handler_extra: more flags of the microVM handler."""
    host_dir = root.path / "host"
    host_dir.mkdir()
    if runtime_class == "runc":
        with private_containerd(pod_network=pod_network) as (containerd, image):
            kubelet = Kubelet(root.path / "kubelet", "node-a")
            runtime = KubeletRuntime(kubelet, containerd.endpoint, cgroup_root=containerd.cgroup_root,
                                     runtime_classes={"runc": "runc"}, pod_logs_dir=root.path / "pod-logs",
                                     retry_seconds=0)
            try:
                runtime.connect()
                yield PodNode(runtime, image, runtime_class, host_dir, containerd)
            finally:
                runtime.close()
    elif runtime_class == "crust-microvm":
        with cri_microvm_node(root, pod_network=pod_network, vm_pool=vm_pool, handler_extra=handler_extra) as node:
            yield PodNode(node.runtime, node.image, runtime_class, host_dir, node.containerd,
                          handler_log=node.env.handler.log_path, handler=node.env.handler)
            if vm_pool:
                log = node.env.handler.log_path.read_text(errors="replace")
                assert '"msg": "pod takes a pooled VM"' in log, "no pod took a VM the pool booted"
    elif runtime_class == "crust-runc":
        if pod_network:
            raise ValueError("the crust-runc node has no pod network of its own yet")
        with cri_node(root) as node:
            yield PodNode(node.runtime, node.image, runtime_class, host_dir, node.containerd)
    else:
        raise ValueError(f"unknown RuntimeClass {runtime_class!r}: one of {KNOWN_RUNTIME_CLASSES}")


@pytest.fixture(params=RUNTIME_CLASSES)
def node(request, root) -> Iterator[PodNode]:
    with pod_node(request.param, root) as made:
        yield made
        kubelet_root = made.kubelet_root
    assert mounts_below(kubelet_root) == []


CRI_STAMP = re.compile(r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(?P<fraction>\d+))?(?P<zone>Z|[+-]\d\d:\d\d)$")


def cri_log(path: str) -> list[tuple[float, str]]:
    """The CRI log's lines: (when containerd read the line, the line). The
    time is RFC 3339 with up to nine digits of a second, trailing zeros cut."""
    lines = []
    for line in Path(path).read_text(errors="replace").splitlines():
        stamp, _stream, _tag, text = (line.split(" ", 3) + ["", "", ""])[:4]
        match = CRI_STAMP.match(stamp)
        assert match, f"not a CRI log time: {stamp!r}"
        fraction = (match["fraction"] or "")[:6].ljust(6, "0")
        moment = datetime.fromisoformat(f"{match['time']}.{fraction}{match['zone'] or ''}")
        lines.append((moment.timestamp(), text))
    return lines
