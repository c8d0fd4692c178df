"""Test harness for the CRI-O tests: a private CRI-O (crust.kubelet.crio)
pulling the tiny busybox image and its pause image from a local registry,
checks that it left nothing behind, and the node of tests/harness/cri.py
with CRI-O in containerd's place.

CRI-O is not part of crust: crio and pinns (cri-o/cri-o) are found on PATH
or by CRIO and PINNS (tests/harness/upstream.py); a module marked with
`upstream.suite(..., CRIO, PINNS)` is skipped without them."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from crust.kubelet import image as images
from crust.kubelet import cni
from crust.kubelet import registry as local_registry
from crust.kubelet.crio import Crio
from crust.kubelet.crio import available as crio_available
from crust.kubelet.registry import LocalRegistry, push_busybox_and_pause
from tests.harness.cri import OCI_RUNTIME, CriNode, daemon_leftovers, kata_handler_endpoint, microvm_node
from tests.harness import upstream
from tests.harness.upstream import CRIO, PINNS


def crio_tools() -> dict[str, Path]:
    """crio and pinns by name, once a test's `upstream.suite()` mark made
    sure of them."""
    return {program.name: upstream.path(program) for program in (CRIO, PINNS)}


@contextlib.contextmanager
def private_crio(tools: dict[str, Path], runtimes: dict[str, str] | None = None,
                 env: dict[str, str] | None = None, pod_network: bool = False,
                 vm_runtimes: dict[str, str] | None = None, vm_runtime_settings: dict[str, dict] | None = None
                 ) -> Iterator[tuple[Crio, images.Image]]:
    """A started CRI-O that pulls the busybox image (localhost/crust/busybox,
    as containerd's tests name it) and its pause image from a local
    registry standing in for `localhost`; closed and checked clean
    afterwards, whatever the test did."""
    directory = Path(tempfile.mkdtemp(prefix="crust-crio-"))
    image = images.build(directory / "images")
    registry = LocalRegistry(directory / "registry")
    try:
        registry.start()
        pause = push_busybox_and_pause(registry, image)
        with started_crio(directory / "crio", tools, pause, mirrors={"localhost": registry.url},
                          runtimes=runtimes, env=env, pod_network=pod_network, vm_runtimes=vm_runtimes or {},
                          vm_runtime_settings=vm_runtime_settings or {}) as crio:
            yield crio, image
    finally:
        registry.close()
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def started_crio(directory: Path, tools: dict[str, Path], pause_image: str, mirrors: dict[str, str],
                 runtimes: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 **settings) -> Iterator[Crio]:
    """A started CRI-O below `directory` pulling through `mirrors` (registry
    host -> the URL standing in for it); `settings` are more of Crio's
    fields. Closed and checked clean afterwards, whatever the test did."""
    crio = Crio(directory, tools["crio"], tools["pinns"], pause_image=pause_image,
                runtimes=runtimes or {"runc": ""}, env=env or {}, mirrors=mirrors, **settings)
    try:
        crio.start()
        yield crio
    finally:
        crio.close()
    leftovers = leftovers_of(crio)
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
    found += sorted(crio.left_outside)
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


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHIM = Path(sys.executable).parent / "containerd-shim-crust-v2"


def microvm_drop_in() -> tuple[str, dict]:
    """deploy/crio/crust-microvm.conf: the handler it names and its table."""
    runtimes = tomllib.loads((DEPLOY / "crio" / "crust-microvm.conf").read_text())["crio"]["runtime"]["runtimes"]
    (name, table), = runtimes.items()
    return name, table


def microvm_handler(directory: Path, handler_endpoint: str) -> tuple[dict[str, str], dict[str, dict]]:
    """CRI-O's VM handler for the microVM (vm_runtimes, vm_runtime_settings):
    the one of deploy/crio/crust-microvm.conf with the drop-in's settings,
    but this interpreter's shim and a runtime_config_path of the drop-in's
    shape, written below `directory`, naming the microVM handler (the only
    way its endpoint reaches the shim: it is nowhere in CRI-O's
    environment)."""
    name, table = microvm_drop_in()
    settings = directory / "containerd-shim-crust.toml"
    settings.write_text(f'handler_endpoint = "{handler_endpoint}"\n')
    extra = {k: v for k, v in table.items() if k not in ("runtime_path", "runtime_type", "runtime_root")}
    extra["runtime_config_path"] = str(settings)
    return {name: str(SHIM)}, {name: extra}


@contextlib.contextmanager
def crio_microvm_node(root, tools: dict[str, Path], pod_network: bool = False, vm_pool: int = 0,
                      handler_extra: tuple[str, ...] = ()) -> Iterator[CriNode]:
    """The node of tests/cri_harness.cri_microvm_node with CRI-O in
    containerd's place, its VM handler microvm_handler()'s; pod_network:
    pods off the host's network get CRI-O's bridge of their own."""
    vm_runtimes, vm_settings = microvm_handler(root.path, kata_handler_endpoint(root))
    with private_crio(tools, vm_runtimes=vm_runtimes, vm_runtime_settings=vm_settings,
                      pod_network=pod_network) as (crio, image):
        with microvm_node(root, crio, image, vm_pool, handler_extra) as node:
            yield node


def checked_crio_tools() -> dict[str, Path]:
    """A CRI-O test module's tools once what CRI-O needs here is there too;
    the test fails naming what is missing (its `upstream.suite()` mark
    skipped it already when crio or pinns is absent)."""
    tools = crio_tools()
    problems = [p for p in (crio_available(tools["crio"], tools["pinns"]), local_registry.available(),
                            cni.available()) if p]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    return tools
