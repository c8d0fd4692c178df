"""Test harness for the CRI-O tests: a private CRI-O (crust.kubelet.crio)
pulling the tiny busybox image and its pause image from a local registry,
checks that it left nothing behind, and the node of tests/cri_harness.py
with CRI-O in containerd's place.

CRI-O is not part of crust: `../shared/bin/crio` and `../shared/bin/pinns`
beside the repository, or builds of one's own named by CRIO and PINNS
(tests/csi_sanity.locate)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from crust.kubelet import image as images
from crust.kubelet.crio import Crio
from crust.kubelet.registry import LocalRegistry, push_busybox_and_pause
from tests.cri_harness import OCI_RUNTIME, CriNode, daemon_leftovers
from tests.csi_sanity import Tool, locate

CRIO = Tool("crio", "CRIO", "cri-o/cri-o (bin/crio, with cgo: tags seccomp libsqlite3)")
PINNS = Tool("pinns", "PINNS", "cri-o/cri-o (pinns/, static)")


def locate_crio() -> tuple[dict[str, Path], str]:
    """crio and pinns by name, and what is missing ("" when nothing)."""
    found, problems = {}, []
    for tool in (CRIO, PINNS):
        path, problem = locate(tool)
        if path is None:
            problems.append(problem)
        else:
            found[tool.name] = path
    return found, "; ".join(problems)


@contextlib.contextmanager
def private_crio(tools: dict[str, Path], runtimes: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, pod_network: bool = False) -> Iterator[tuple[Crio, images.Image]]:
    """A started CRI-O that pulls the busybox image (localhost/crust/busybox,
    as containerd's tests name it) and its pause image from a local
    registry standing in for `localhost`; closed and checked clean
    afterwards, whatever the test did."""
    directory = Path(tempfile.mkdtemp(prefix="crust-crio-"))
    image = images.build(directory / "images")
    registry = LocalRegistry(directory / "registry")
    crio = None
    try:
        registry.start()
        pause = push_busybox_and_pause(registry, image)
        crio = Crio(directory / "crio", tools["crio"], tools["pinns"], pause_image=pause,
                    runtimes=runtimes or {"runc": ""}, env=env or {}, mirrors={"localhost": registry.url},
                    pod_network=pod_network)
        crio.start()
        yield crio, image
    finally:
        if crio is not None:
            crio.close()
        registry.close()
        shutil.rmtree(directory, ignore_errors=True)
    leftovers = leftovers_of(crio) if crio is not None else []
    assert not leftovers, f"the private CRI-O left: {leftovers}"


def leftovers_of(crio: Crio) -> list[str]:
    """What a closed CRI-O left: its directory, processes naming it (conmon,
    the containers' processes), mounts below it (storage, pinned
    namespaces), cgroups below its cgroup root, its pod network's bridge,
    CNI results and port-mapping rules, and anything of CRI-O's outside its
    directory that it made."""
    found = daemon_leftovers(crio)
    if crio.network is not None:
        network = crio.network
        if Path(f"/sys/class/net/{network.bridge}").exists():
            found.append(f"bridge {network.bridge}")
        found += [f"CNI result {p.name}" for p in Path("/var/lib/cni/results").glob(f"{network.name}-*")]
        rules = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True,
                               timeout=30, check=False).stdout if shutil.which("iptables-save") else ""
        found += [f"iptables rule {line[:120]}" for line in rules.splitlines() if network.name in line]
    found += sorted(crio.made_outside())
    return found


def crio_node_env(root) -> dict[str, str]:
    """crust's OCI runtime's settings as cri_node gives them to containerd."""
    return {"CRUST_HANDLER_ENDPOINT": f"unix://{root.path / 'handler.sock'}",
            "CRUST_OCI_RUNTIME_STATE": str(root.path / "oci-runtime")}


@contextlib.contextmanager
def crio_node(root, tools: dict[str, Path]) -> Iterator[CriNode]:
    """The node of tests/cri_harness.cri_node with CRI-O in containerd's
    place: handlers `runc` and `crust-runc` (crust's OCI runtime, its
    settings in the handler's monitor_env); everything closed (pods first)
    whatever happens."""
    with private_crio(tools, runtimes={"runc": "", "crust-runc": str(OCI_RUNTIME)},
                      env=crio_node_env(root)) as (crio, image):
        node = CriNode(root, crio, image)
        try:
            yield node
        finally:
            node.close()
