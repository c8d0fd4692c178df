"""crust's runtimes driven by CRI-O, the other CRI implementation kubelet
uses: a private CRI-O (crust.kubelet.crio, tests/crio_harness.py) that
pulls its images from a local registry, kubelet's CRI side replayed
against it (crust.kubelet.cri), and
- stock runc: a pod on a bridge of its own writes a line, kubelet reads its
  log, stops and removes it, and the host keeps nothing of it.

CRI-O is not part of crust: `../shared/bin/crio` and `../shared/bin/pinns`
beside the repository, or builds of one's own named by CRIO and PINNS.
Without them this module is skipped; with CI=true it fails.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import Container, Kubelet, Pod, cni
from crust.kubelet import registry as local_registry
from crust.kubelet.cri import KubeletRuntime
from crust.kubelet.crio import Crio
from tests.crio_harness import leftovers_of, locate_crio, private_crio

CRIO_TOOLS, CRIO_PROBLEM = locate_crio()
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")
if CRIO_PROBLEM and not IN_CI:
    pytest.skip(CRIO_PROBLEM, allow_module_level=True)


@pytest.fixture(scope="module")
def crio_tools():
    if CRIO_PROBLEM:
        pytest.fail(f"CI=true and CRI-O is missing: {CRIO_PROBLEM}", pytrace=False)
    problems = [p for p in (local_registry.available(), cni.available()) if p]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    return CRIO_TOOLS


# -- the private CRI-O's configuration ---------------------------------------------------------------


def test_crio_reads_back_the_configuration_we_write(crio_tools, tmp_path):
    """`crio config` (nothing started) merges our file: every path of its
    own, vfs, cgroupfs, our pause image and policy, and each handler: the
    OCI ones with conmon in the pod's cgroup and the runtimes' settings in
    monitor_env, a VM one as a shim binary."""
    shim = str(Path(sys.executable).parent / "containerd-shim-crust-v2")
    crio = Crio(tmp_path / "crio", crio_tools["crio"], crio_tools["pinns"], pause_image="localhost/crust/pause:1",
                runtimes={"runc": "", "crust-runc": "/usr/local/bin/crust-runc"}, vm_runtimes={"crust": shim},
                env={"CRUST_HANDLER_ENDPOINT": "unix:///run/crust/handler.sock"})
    crio.directory.mkdir()
    crio.write_config()
    shown = subprocess.run([str(crio.binary), "--config", str(crio.config_path), "--config-dir",
                            str(crio.directory / "conf.d"), "config"], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ["PATH"], "CONTAINERS_STORAGE_CONF": str(crio.storage_conf)},
                           check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    # What equals CRI-O's default is shown commented out: its storage
    # defaults are our storage.conf's.
    assert f'# root = "{crio.directory / "storage"}"' in shown.stdout and '# storage_driver = "vfs"' in shown.stdout
    merged = tomllib.loads(shown.stdout)["crio"]
    assert merged["api"]["listen"] == str(crio.socket)
    assert (merged["runtime"]["cgroup_manager"], merged["runtime"]["default_runtime"]) == ("cgroupfs", "runc")
    assert merged["image"]["pause_image"] == "localhost/crust/pause:1"
    assert merged["image"]["signature_policy"] == str(crio.directory / "policy.json")
    handlers = merged["runtime"]["runtimes"]
    # crun is one of CRI-O's defaults, whatever the file says (never used here).
    assert sorted(handlers) == ["crun", "crust", "crust-runc", "runc"]
    for name in ("runc", "crust-runc"):
        assert (handlers[name]["runtime_type"], handlers[name]["monitor_cgroup"]) == ("oci", "pod")
        assert "CRUST_HANDLER_ENDPOINT=unix:///run/crust/handler.sock" in handlers[name]["monitor_env"]
        assert handlers[name]["runtime_path"] == crio.runtime_path(name)
    assert (handlers["crust"]["runtime_type"], handlers["crust"]["runtime_path"]) == ("vm", shim)
    paths = [path for table in (merged, merged["runtime"]) for key, value in table.items()
             if key.endswith(("_dir", "_dirs", "_file", "_persist"))
             for path in (value if isinstance(value, list) else [value]) if path]
    outside = [path for path in paths if not path.startswith(str(crio.directory) + "/")]
    assert len(paths) >= 10 and outside == [], outside


# -- runc under CRI-O ----------------------------------------------------------------------------------


def test_runc_under_crio_runs_a_pod_and_the_host_keeps_nothing(crio_tools):
    """A pod on CRI-O's own bridge through kubelet's calls: its container
    writes a line and exits, kubelet reads the log, stops and removes the
    pod (the pause process exits on SIGTERM), and an orderly close needs no
    forced cleanup: no process, mount (storage, pinned namespaces), cgroup,
    bridge, CNI result or rule, nftables table of CRI-O's is left."""
    with private_crio(crio_tools, pod_network=True) as (crio, image):
        kubelet = Kubelet(crio.directory / "node" / "kubelet", "node-a")
        runtime = KubeletRuntime(kubelet, crio.endpoint, cgroup_root=crio.cgroup_root, retry_seconds=0,
                                 runtime_classes={"plain": "runc"}, pod_logs_dir=crio.directory / "node" / "logs")
        version = runtime.connect()
        assert (version.runtime_name, version.runtime_api_version) == ("cri-o", "v1") and runtime.network_ready
        pod = Pod(uid="uid-crio-runc", name="crio-runc", runtime_class_name="plain", restart_policy="Never",
                  termination_grace_period_seconds=2,
                  containers=[Container("c", image.name, command=["/bin/sh", "-c", "echo hello from cri-o; exit 3"])])
        sandbox_id = runtime.run_pod(pod)
        sandbox = runtime.pod_status(pod).sandboxes[0]
        assert sandbox.id == sandbox_id and sandbox.state == cri.SANDBOX_READY
        assert ipaddress.ip_address(sandbox.network.ip) in crio.network.subnet
        status = runtime.wait_container(runtime.pod_status(pod).latest("c").id)
        assert (status.state, status.exit_code) == (cri.CONTAINER_EXITED, 3)
        assert Path(status.log_path).read_text().endswith(" stdout F hello from cri-o\n")
        runtime.kill_pod(pod)
        assert runtime.pod_status(pod).sandboxes[0].state == cri.SANDBOX_NOTREADY
        runtime.remove_pod(pod)
        assert not crio.runtime_service.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items
        runtime.close()
        assert crio.close() == []
        assert leftovers_of(crio) == []
