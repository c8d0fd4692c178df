"""crust's runtimes driven by CRI-O, the other CRI implementation kubelet
uses: a private CRI-O (crust.kubelet.crio, tests/harness/crio.py) that
pulls its images from a local registry, kubelet's CRI side replayed
against it (crust.kubelet.cri), and
- the configuration CRI-O reads back (`crio config`);
- stock runc: a pod on a bridge of its own writes a line, kubelet reads its
  log, stops and removes it, and the host keeps nothing of it; nor after
  CRI-O was killed under a running pod;
- crust-runc beside runc: a deferred volume mounted only inside the
  container, its bytes on the volume, CRI-O restarted under it, the claim
  released once the container is over (CRI-O has crust-runc delete it
  only at RemoveContainer);
  in kubelet's own order (volumes unmounted before the containers are
  removed) the claim of the stopped container is let go at the unmount.

CRI-O is not part of crust: crio and pinns (cri-o/cri-o) are found on PATH
or by CRIO and PINNS (tests/harness/upstream.py); without them this module is
skipped, naming the missing program, in CI too.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import Container, Kubelet, PersistentVolume, Pod
from crust.kubelet.cri import KubeletRuntime
from crust.kubelet.crio import Crio, CrioError
from tests.harness.demo_run import run_demo
from tests.harness.cri import processes_naming
from tests.harness import upstream
from tests.harness.crio import checked_crio_tools, crio_node, leftovers_of, private_crio
from tests.harness.daemons import wait_until
from tests.harness.upstream import CRIO, PINNS

pytestmark = upstream.suite("CRI-O", CRIO, PINNS)


@pytest.fixture(scope="module")
def crio_tools():
    return checked_crio_tools()


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


def test_a_directory_too_long_for_attach_sockets_is_refused(crio_tools, tmp_path):
    """CRI-O dials a container's attach socket, <attach dir>/<64-hex
    id>/attach, by its path: a directory that makes it longer than a unix
    socket's address is refused before CRI-O starts
    (at start(): a config alone runs nothing), naming the directory
    (else every Attach fails while the container runs)."""
    long = tmp_path / ("d" * max(1, 80 - len(str(tmp_path))))
    crio = Crio(long, crio_tools["crio"], crio_tools["pinns"], pause_image="localhost/crust/pause:1")
    with pytest.raises(CrioError, match="too long"):
        crio.start()
    assert crio.process is None and not long.exists()
    short = Crio(Path("/tmp/crust-crio-abcdefgh"), crio_tools["crio"], crio_tools["pinns"], pause_image="p")
    short.check_paths()


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


def test_close_cleans_up_after_crio_was_killed(crio_tools):
    """SIGKILL CRI-O while a pod of its bridge runs: conmon and the
    container live on (by design); close() still finds and removes
    everything (monitors, containers, storage and pinned namespaces'
    mounts, cgroups, the network)."""
    with private_crio(crio_tools, pod_network=True) as (crio, image):
        rs = crio.runtime_service
        logs = crio.directory / "logs" / "uid-k"
        (logs / "c").mkdir(parents=True)  # conmon makes no directory for a log
        config = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="killed", namespace="default", uid="uid-k"),
                                      log_directory=str(logs),
                                      linux=cri.LinuxPodSandboxConfig(cgroup_parent=f"{crio.cgroup_root}/poduid-k"))
        sandbox = rs.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler="runc"),
                                   timeout=60).pod_sandbox_id
        crio.image_service.PullImage(cri.PullImageRequest(image=cri.ImageSpec(image=image.name)), timeout=60)
        container = rs.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sandbox, sandbox_config=config,
            config=cri.ContainerConfig(metadata=cri.ContainerMetadata(name="c"),
                                       image=cri.ImageSpec(image=image.name, user_specified_image=image.name),
                                       command=["/bin/sleep", "600"], log_path="c/0.log")), timeout=60).container_id
        rs.StartContainer(cri.StartContainerRequest(container_id=container), timeout=60)
        crio.stop(signal.SIGKILL)
        assert any("conmon" in p for p in processes_naming(str(crio.directory))), "conmon should outlive CRI-O"
        forced = crio.close()
        assert len([f for f in forced if f.startswith("conmon pid")]) == 2, forced  # the infra's and the sleep's
        assert len([f for f in forced if f.startswith("container ")]) == 2, forced
        assert leftovers_of(crio) == []


# -- crust-runc under CRI-O ----------------------------------------------------------------------------

# Write into the volume, print what was written, then wait for kubelet's
# SIGTERM and exit with a code of its own.
WORKLOAD = ("head -c 1048576 /dev/urandom > /data/payload && sync && sha256sum /data/payload && "
            "trap 'exit 42' TERM; sleep infinity & wait")


# The handler's warning when its reaper, not the runtime's delete, releases a claim.
REAPED = "releasing the claims of a gone container"


def _host_read(node, pv: PersistentVolume, name: str) -> bytes:
    """The volume published on the host (without the deferral) for a pod
    of no runtime: the file `name` read there, then unpublished."""
    on_host = PersistentVolume(name=pv.name, volume_handle=pv.volume_handle, fs_type=pv.fs_type,
                               attributes={k: v for k, v in pv.attributes.items() if k != "crust.dev/defer"})
    reader = Pod(uid="uid-host-reader", name="host-reader")
    target = node.kubelet.start_pod(on_host, reader)
    try:
        return (target / name).read_bytes()
    finally:
        node.kubelet.stop_pod(on_host, reader)


def test_crust_runc_under_crio_mounts_a_deferred_volume_only_inside_its_container(root, crio_tools):
    """Kubelet -> CRI-O -> conmon -> crust-runc (its settings in the
    handler's monitor_env) -> runc, beside a plain runc pod: the deferred
    volume is mounted in the container and nowhere on the host, the pod's
    bytes land on it, the claim is the pod's, CRI-O restarts under the pod,
    and the claim is released when kubelet stops the pod (the workload's
    own exit code), before CRI-O deletes the container."""
    with crio_node(root, crio_tools) as node:
        plain = Pod(uid="uid-plain", name="plain", host_network=True, runtime_class_name="runc",
                    restart_policy="Never", containers=[Container("c", node.image.name,
                                                                  command=["/bin/sh", "-c", "echo plain runc"])])
        node.runtime.run_pod(plain)
        pv = node.pv("pv-crio", "ext4", size=128 * 1024**2)
        pod = node.pod("crio", pv, WORKLOAD)
        node.kubelet.start_pod(pv, pod)
        entry = node.entry(pod, pv)
        sandbox_id = node.runtime.run_pod(pod)
        container = node.container(pod)
        log = wait_until(lambda: "/data/payload" in (text := Path(container.log_path).read_text(errors="replace"))
                         and text, what="the pod's write in its volume")
        written = log.split("/data/payload")[0].split()[-1]
        target = str(node.kubelet.target_path(pod, pv))
        assert node.claims() == {(target, "mountns", sandbox_id)}
        assert node.host_mounts_of(entry) == [], "the host mounted the deferred file system"
        mounts = node.runtime.exec_sync(container.id, ["/bin/cat", "/proc/self/mountinfo"]).stdout.decode()
        data = [line.split() for line in mounts.splitlines() if line.split()[4] == "/data"]
        assert len(data) == 1 and data[0][2] == f"{entry['device-major']}:{entry['device-minor']}", mounts
        done = node.runtime.wait_container(node.runtime.pod_status(plain).latest("c").id)
        assert (done.exit_code, Path(done.log_path).read_text().split()[-1]) == (0, "runc")

        # CRI-O killed and started again under the running pod: nothing is lost.
        node.containerd.restart(signal.SIGKILL)
        assert node.container(pod).state == cri.CONTAINER_RUNNING
        assert node.claims() == {(target, "mountns", sandbox_id)}
        assert node.host_mounts_of(entry) == []

        node.runtime.kill_pod(pod)
        stopped = node.container(pod)
        assert (stopped.state, stopped.exit_code) == (cri.CONTAINER_EXITED, 42)
        # CRI-O has the runtime delete a container at RemoveContainer only;
        # the container is over, so the handler lets go of its claim first.
        wait_until(lambda: node.claims() == set(), what="the exited container's claim released")
        node.runtime.remove_pod(pod)
        assert node.claims() == set()
        assert REAPED not in node.env.handler.log_path.read_text(), "the claim was not released by the delete"
        node.kubelet.stop_pod(pv, pod)
        assert node.host_mounts_of(entry) == []
        assert hashlib.sha256(_host_read(node, pv, "payload")).hexdigest() == written
        node.runtime.kill_pod(plain)
        node.runtime.remove_pod(plain)


def test_kubelet_unmounts_a_stopped_crust_runc_pods_volume_at_once_under_crio(root, crio_tools):
    """Kubelet's order: a pod's containers stopped, then its volumes torn
    down (NodeUnpublishVolume), its containers removed only later by the
    container GC. Under containerd the runc shim deletes a container as it
    exits; CRI-O deletes it only at RemoveContainer, so the proxy's
    question to the handler (GetSandbox) has the handler let go of the
    exited container's claim, and the unmount succeeds at once, as an
    ordinary end, not the reaper's."""
    with crio_node(root, crio_tools) as node:
        pv = node.pv("pv-crio-order", "ext4", size=128 * 1024**2)
        pod = node.pod("crio-order", pv, WORKLOAD)
        node.kubelet.start_pod(pv, pod)
        node.runtime.run_pod(pod)
        container = node.container(pod)
        wait_until(lambda: "/data/payload" in Path(container.log_path).read_text(errors="replace"),
                   what="the pod's write in its volume")
        node.runtime.kill_pod(pod)
        refused = ""
        try:
            node.kubelet.tear_down(pv, pod)
        except grpc.RpcError as exc:
            refused = f"{exc.code().name}: {exc.details()}"
        finally:
            node.runtime.remove_pod(pod)
            node.kubelet.stop_pod(pv, pod)
        assert not refused, refused
        assert REAPED not in node.env.handler.log_path.read_text()


# -- the demo ------------------------------------------------------------------------------------------


def test_crio_demo_runs_every_step_and_leaves_nothing(root, crio_tools):
    """`crust demo --cri crio --json` as a user runs it (crio and pinns
    named by $CRIO and $PINNS): the pod of RuntimeClass crust-runc started
    by CRI-O, every step held (CRI-O restarted under the pod), the CRI facts
    reported, and nothing of it left: its root, processes, and nothing of
    CRI-O's outside its directory."""
    outside_before = Crio.outside()
    result = run_demo(root, "--cri", "crio", env={"CRIO": str(crio_tools["crio"]), "PINNS": str(crio_tools["pinns"])})
    names = [s["name"] for s in result["steps"]]
    assert "kubelet starts the pod through CRI (writes data)" in names and "CRI-O restarts under the pod" in names
    facts = result["cri"]
    assert facts["runtime"].startswith("cri-o 1.") and facts["runtime_handler"] == "crust-runc"
    assert Crio.outside() == outside_before
