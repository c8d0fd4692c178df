"""Pods of RuntimeClass crust-microvm started by a real CRI-O (own root,
state, socket and config: crust.kubelet.crio) whose VM handler `crust` is
crust's shim v2 (`containerd-shim-crust-v2`, runtime_type "vm", the
settings of deploy/crio/crust-microvm.conf) in front of the microVM
handler; kubelet's CRI side replayed from its public source.

What CRI-O does with a VM runtime, and what these tests hold it to:
- it starts the shim per container (`start`, no address of its own, no
  event socket): the shim groups them by CRI-O's sandbox id annotation,
  one shim and one VM per pod; it learns each exit by a Wait per task;
- the handler's socket reaches the shim only through the handler's
  runtime_config_path, in the sandbox's CreateTaskRequest (a VM handler's
  shim gets no monitor_env);
- it writes the container's CRI log itself from the shim's stdio fifos;
  exec (ExecSync, and `crictl exec -i` through its streaming server),
  attach, ContainerStats (the guest's cgroup through the shim's Stats) and
  volume stats (kubelet's CSI path, from inside the guest) all reach the
  guest;
- restarted (SIGKILL, then started), it finds its pods again by each
  bundle's `address` and asks State; it does not Wait on a task again, so
  a container that ends afterwards is still reported running by CRI-O
  (its exit is in the shim's State, which CRI-O asks only when a status
  call finds no exit code): kubelet's stop then ends it (the shim answers
  a stop signal to an ended process with success, as stopping is
  idempotent in CRI);
- port-forward is a no-op in CRI-O for a VM runtime (docs/install-node.md).

CRI-O and crictl are not part of crust: crio and pinns (cri-o/cri-o) and
crictl (kubernetes-sigs/cri-tools) are found on PATH or by CRIO, PINNS and
CRICTL (tests/harness/upstream.py); without them this module is skipped, naming the
missing program, in CI too.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from crust.containerd_shim.process import STOPPED
from crust.kata.vmm.qemu import qemu_pids_under
from crust.kubelet import Container, Pod, VolumeMount
from crust.kubelet.crio import Crio
from tests.harness.demo_run import run_demo
from tests.harness.cri import container_log, processes_naming
from tests.harness import upstream
from tests.harness.crio import DEPLOY, SHIM, checked_crio_tools, crio_microvm_node, microvm_drop_in, private_crio
from tests.harness.upstream import CRICTL, CRIO, PINNS
from tests.harness.microvm_pod import APP, READER, container_df, kubelet_volume_stats, microvm_pod
from tests.harness.mount_watch import MountWatch
from tests.harness.pod_http import http_get, serve
from tests.harness.daemons import wait_until

pytestmark = upstream.suite("CRI-O", CRIO, PINNS, CRICTL)
# One line of a CRI log: time, stream, full (F) or partial (P), the text.
CRI_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d) (stdout|stderr) [FP] ")


@pytest.fixture(scope="module")
def crio_tools():
    return checked_crio_tools()


def crictl(crio: Crio, *args: str, stdin: bytes = b"", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(upstream.path(CRICTL)), "--config", str(crio.crictl_config()), *args], input=stdin,
                          capture_output=True, timeout=timeout)


# -- deploy/crio/crust-microvm.conf -------------------------------------------------------------------


def test_crio_merges_the_microvm_drop_in_and_the_shim_reads_its_settings(crio_tools, tmp_path):
    """`crio config` with the drop-in in its config directory: the handler
    `crust` (the RuntimeClass crust-microvm's) is a VM runtime whose binary
    CRI-O accepts as a containerd shim's name, with the shim's settings
    file; that file (deploy/containerd/containerd-shim-crust.toml), handed
    over as CRI-O hands it (runtimeoptions in the CreateTaskRequest), names
    the handler's default socket."""
    from google.protobuf import any_pb2

    from crust.api import containerd_runtimeoptions_pb2 as runtimeoptions
    from crust.containerd_shim.options import configured_endpoint

    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "50-crust-microvm.conf").write_text((DEPLOY / "crio" / "crust-microvm.conf").read_text())
    (tmp_path / "crio.conf").write_text("")
    # Nothing is started: the storage settings only keep the host's unread.
    (tmp_path / "storage.conf").write_text(f'[storage]\ndriver = "vfs"\ngraphroot = "{tmp_path}/storage"\n'
                                           f'runroot = "{tmp_path}/run"\n')
    shown = subprocess.run([str(crio_tools["crio"]), "--config", str(tmp_path / "crio.conf"), "--config-dir",
                            str(tmp_path / "conf.d"), "config"], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ["PATH"], "CONTAINERS_STORAGE_CONF": str(tmp_path / "storage.conf")},
                           check=False)
    assert shown.returncode == 0, shown.stderr[-2000:]
    import tomllib

    merged = tomllib.loads(shown.stdout)["crio"]["runtime"]["runtimes"]["crust"]
    name, table = microvm_drop_in()
    assert name == "crust" and {k: merged[k] for k in table} == table
    assert table["runtime_type"] == "vm" and re.fullmatch(r"containerd-shim-[a-zA-Z0-9\-+]+",
                                                          Path(table["runtime_path"]).name)
    assert Path(table["runtime_path"]).name == SHIM.name and SHIM.exists()
    # The settings file is the one containerd's ConfigPath names.
    assert table["runtime_config_path"] == "/etc/crust/containerd-shim-crust.toml"
    options = any_pb2.Any(type_url="runtimeoptions.v1.Options", value=runtimeoptions.Options(
        config_path=str(DEPLOY / "containerd" / "containerd-shim-crust.toml")).SerializeToString())
    assert configured_endpoint(options.SerializeToString()) == "unix:///run/crust/kata-handler.sock"


def test_a_pod_fails_clearly_without_the_handler_and_leaves_no_shim(crio_tools, tmp_path):
    """The handler's socket named by runtime_config_path does not answer:
    RunPodSandbox fails naming it (the shim asked there, not at the
    default), and CRI-O's cleanup (Delete, Shutdown) ends the shim."""
    missing = tmp_path / "no-handler.sock"
    settings = tmp_path / "shim.toml"
    settings.write_text(f'handler_endpoint = "unix://{missing}"\n')
    name, table = microvm_drop_in()
    extra = {**{k: v for k, v in table.items() if k not in ("runtime_path", "runtime_type", "runtime_root")},
             "runtime_config_path": str(settings)}
    with private_crio(crio_tools, vm_runtimes={name: str(SHIM)}, vm_runtime_settings={name: extra}) as (crio, _):
        config = cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name="p0", namespace="default", uid="uid-p0"),
            log_directory=str(tmp_path / "logs"),
            linux=cri.LinuxPodSandboxConfig(cgroup_parent=f"{crio.cgroup_root}/poduid-p0",
                                            security_context=cri.LinuxSandboxSecurityContext(
                                                namespace_options=cri.NamespaceOption(network=cri.NODE))))
        with pytest.raises(grpc.RpcError) as caught:
            crio.runtime_service.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler=name),
                                               timeout=120)
        assert "CreatePod" in caught.value.details() and str(missing) in caught.value.details(), \
            caught.value.details()
        wait_until(lambda: not crio.shim_pids(), timeout=30, what="the shim to exit")
        assert crio.shim_sockets() == set()
        assert crio.runtime_service.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items == []


# -- a pod in the microVM ------------------------------------------------------------------------------


def test_a_pod_runs_in_the_microvm_through_crio(root, crio_tools):
    """kubelet -> CRI-O -> containerd-shim-crust-v2 -> microVM handler ->
    guest, with a deferred ext4 and xfs volume that only the guest mounts:
    the app writes into both with the pod's fsGroup, a second container of
    the pod shares the VM and reads it, CRI-O's own CRI log has their
    output and ContainerStatus their exit codes, ExecSync and `crictl exec
    -i` run in the guest, attach reaches a shell's standard input,
    ContainerStats are the guest's cgroup's and volume stats equal df in
    the guest; CRI-O is SIGKILLed and started again under the pod and finds
    it (State, exec, stats, its log), kubelet stops the pod (the VM stops,
    every claim goes, the shim exits), and the host's mount table never
    shows either volume."""
    with crio_microvm_node(root, crio_tools) as node:
        crio = node.containerd
        ext4, xfs = node.pv("pv-o-ext4", "ext4", size=256 * 1024**2), node.pv("pv-o-xfs", "xfs")
        image = node.image.name
        pod = microvm_pod(node, "micro-crio", {"ext4": ext4, "xfs": xfs}, [
            Container("app", image, command=["/bin/sh", "-c", APP],
                      volume_mounts=[VolumeMount("ext4", "/ext4"), VolumeMount("xfs", "/xfs")]),
            Container("reader", image, command=["/bin/sh", "-c", READER],
                      volume_mounts=[VolumeMount("ext4", "/ext4")]),
            # A shell reading its standard input, as `kubectl run -i` starts one.
            Container("shell", image, command=["/bin/sh", "-c", "exec sh"], stdin=True, stdin_once=True)])
        targets = {str(node.kubelet.start_pod(pv, pod)) for pv in (ext4, xfs)}
        entries = [node.entry(pod, pv) for pv in (ext4, xfs)]
        devices = {(e["device-major"], e["device-minor"]) for e in entries}
        with MountWatch(devices) as watch:
            sandbox_id = node.runtime.run_pod(pod)
            status = node.runtime.pod_status(pod)
            app, reader, shell = status.latest("app"), status.latest("reader"), status.latest("shell")
            wait_until(lambda: "written" in container_log(app), timeout=180, what="the app's writes in the guest")
            log = container_log(app)
            assert "hello-from-the-guest" in log
            # CRI-O wrote the log itself, in CRI's format, from the shim's fifos.
            assert all(CRI_LOG_LINE.match(line) for line in log.splitlines()), log
            # Written by the guest with the pod's fsGroup as the file's group.
            assert " 0 2000 " in " ".join(log.split()) + " ", log
            assert not processes_naming("/ext4/written")
            # One VM and one shim (CRI-O started one `start` per container):
            # the node's shared one.
            (vm_pid,) = qemu_pids_under(root.path)
            (shim_pid,) = crio.shim_pids()
            argv = Path(f"/proc/{shim_pid}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("-id") + 1] == "node" and "-shared" in argv
            assert argv[argv.index("-address") + 1] == ""
            shim_socket = Path(argv[argv.index("-socket") + 1])
            bundles = _bundles(crio)
            assert len(bundles) == 4   # the infra container (the VM) and three
            assert {(b / "address").read_text() for b in bundles} == {f"unix://{shim_socket}"}
            done = node.runtime.wait_container(reader.id, timeout=120)
            assert (done.state, done.exit_code) == (cri.CONTAINER_EXITED, 3)
            assert "second-sees-ext4" in container_log(done)
            assert {(c[0], c[2]) for c in node.claims()} == {(t, sandbox_id) for t in targets}

            # Volume stats (kubelet's CSI path to the guest) equal df in the guest.
            for pv, path in ((ext4, "/ext4"), (xfs, "/xfs")):
                assert kubelet_volume_stats(node, pv, pod) == container_df(node, app.id, path), path
            # ExecSync runs in the guest, its output and exit code back.
            read = node.runtime.exec_sync(app.id, ["/bin/cat", "/ext4/written", "/xfs/written"], timeout=60)
            assert (read.exit_code, read.stdout) == (0, b"ext4\nxfs\n")
            assert node.runtime.exec_sync(app.id, ["/bin/sh", "-c", "echo no >&2; exit 4"], timeout=60).exit_code == 4
            # ContainerStats: the guest's cgroup of the container.
            stats = node.runtime._call("ContainerStats", cri.ContainerStatsRequest(container_id=app.id)).stats
            assert stats.attributes.id == app.id and stats.cpu.usage_core_nano_seconds.value > 0
            assert 0 < stats.memory.working_set_bytes.value < 256 * 1024**2   # below the guest's RAM
            # Through CRI-O's streaming server: an exec with a standard input ...
            data = bytes(range(1, 256)) * 16 + b"\nlast line\n"
            done = crictl(crio, "exec", "-i", app.id, "sh", "-c", "cat; echo end-of-input", stdin=data)
            assert (done.returncode, done.stdout) == (0, data + b"end-of-input\n"), done.stderr
            # ... and attach: a command written to the shell runs in the guest.
            done = crictl(crio, "attach", "-i", shell.id, stdin=b"echo attached-$((6*7)) $(hostname)\nexit 5\n")
            assert done.returncode == 0 and b"attached-42" in done.stdout, (done.stdout, done.stderr)
            ended = node.runtime.wait_container(shell.id, timeout=60)
            assert ended.exit_code == 5 and "attached-42" in container_log(ended)

            # CRI-O is killed and started again under the running pod: it
            # reads each bundle's address and asks State.
            crio.stop(signal.SIGKILL)
            crio.start()
            assert node.runtime.container_status(app.id).state == cri.CONTAINER_RUNNING
            assert node.runtime.pod_status(pod).sandboxes[0].state == cri.SANDBOX_READY
            assert qemu_pids_under(root.path) == [vm_pid] and crio.shim_pids() == [shim_pid]
            assert kubelet_volume_stats(node, ext4, pod) == container_df(node, app.id, "/ext4")
            again = node.runtime.exec_sync(app.id, ["/bin/sh", "-c", "echo after-the-restart"], timeout=60)
            assert again.stdout == b"after-the-restart\n"
            # The app ends by itself now: CRI-O, which waits on no task after
            # its restart, still reports it running ...
            assert node.runtime.exec_sync(app.id, ["/bin/touch", "/ext4/stop"], timeout=60).exit_code == 0
            wait_until(lambda: _shim_state(shim_socket, app.id)[0] == STOPPED, timeout=60,
                       what="the shim to see the app's exit")
            assert _shim_state(shim_socket, app.id)[1] == 7
            assert node.runtime.container_status(app.id).state == cri.CONTAINER_RUNNING
            # ... but its last words reached the log CRI-O reopened.
            wait_until(lambda: "stopping" in container_log(app), timeout=30, what="the app's last line in its log")

            # Kubelet stops the pod: the VM stops and every claim goes.
            node.runtime.kill_pod(pod)
            wait_until(lambda: qemu_pids_under(root.path) == [], timeout=120, what="the VM to stop")
            assert node.claims() == set()
            # Its stop asked the shim: the exit code is the app's own.
            stopped = node.runtime.container_status(app.id)
            assert (stopped.state, stopped.exit_code) == (cri.CONTAINER_EXITED, 7)
            node.runtime.remove_pod(pod)
            for pv in (ext4, xfs):
                node.kubelet.stop_pod(pv, pod)
            wait_until(lambda: not crio.shim_pids(), timeout=30, what="the pod's shim to exit")
            assert not shim_socket.exists() and crio.shim_sockets() == set()
        assert watch.reads > 100 and watch.seen == [], watch.seen
        assert all(node.host_mounts_of(e) == [] for e in entries)


def _bundles(crio: Crio) -> set[Path]:
    """The bundles of CRI-O's containers (the infra one's too) whose shim
    `start` gave an address."""
    return {a.parent for a in (crio.directory / "run" / "storage").glob("*-containers/*/userdata/address")}


def _shim_state(socket_path: Path, container_id: str) -> tuple[int, int]:
    """(status, exit status) of a container's task as its shim tells it."""
    import asyncio

    from crust.api import containerd_task_pb2 as task_pb
    from crust.common.ttrpc_client import Client

    async def ask():
        client = await Client.connect(str(socket_path))
        try:
            state = await client.call("containerd.task.v2.Task", "State", task_pb.StateRequest(id=container_id),
                                      task_pb.StateResponse, timeout=10)
        finally:
            await client.close()
        return state.status, state.exit_status

    return asyncio.run(ask())



def test_a_pod_on_crios_bridge_answers_at_its_address_from_the_guest(root, crio_tools):
    """A microVM pod off the host's network: CRI-O names the network
    namespace CNI set up, the VM's NIC takes the pod's address, and an
    HTTP server in the guest answers at the address CRI reports. CRI-O's
    StopPodSandbox tears the network down (CNI DEL) before it stops the
    VM: the pod still ends whole (VM, shim, claims) and the bridge, CNI
    results and rules go with CRI-O (the harness's leftovers check)."""
    with crio_microvm_node(root, crio_tools, pod_network=True) as node:
        crio = node.containerd
        pv = node.pv("pv-o-net", "ext4", size=128 * 1024**2)
        pod = Pod(uid="uid-net", name="net", fs_group=2000, host_network=False, runtime_class_name="crust-microvm",
                  volumes={"data": pv}, restart_policy="Never", termination_grace_period_seconds=2,
                  containers=[Container("web", node.image.name, command=["/bin/sh", "-c", serve("from-the-guest")],
                                        volume_mounts=[VolumeMount("data", "/data")])])
        node.kubelet.start_pod(pv, pod)
        sandbox_id = node.runtime.run_pod(pod)
        sandbox = node.runtime._call("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id))
        address = sandbox.status.network.ip
        assert ipaddress.ip_address(address) in crio.network.subnet
        seen: list[str] = []

        def answered() -> bool:
            try:
                body = http_get(address, 80)
            except OSError as exc:
                seen[-1:] = [str(exc)]
                return False
            return body == b"from-the-guest\n"

        wait_until(answered, timeout=120, what=f"the guest's server at {address}; last: {seen}")
        (vm_pid,) = qemu_pids_under(root.path)
        assert not processes_naming("httpd -f -p 80")   # it runs in the guest
        node.runtime.kill_pod(pod)
        wait_until(lambda: qemu_pids_under(root.path) == [], timeout=120, what="the VM to stop")
        assert node.claims() == set()
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)
        wait_until(lambda: not crio.shim_pids(), timeout=30, what="the pod's shim to exit")
        assert crio.shim_sockets() == set()


# -- the demo ------------------------------------------------------------------------------------


def test_crio_kata_demo_runs_every_step_and_leaves_nothing(root, crio_tools):
    """`crust demo --cri crio --runtime kata --json` as a user runs it: the
    pod of RuntimeClass crust-microvm started by CRI-O through crust's shim
    (the handler's endpoint in the settings file runtime_config_path names),
    every step held, CRI-O restarted under the pod, nothing of it left, nor
    anything of CRI-O's outside its directory."""
    outside_before = Crio.outside()
    result = run_demo(root, "--cri", "crio", "--runtime", "kata", "--fs", "ext4", timeout=600,
                      env={"CRIO": str(crio_tools["crio"]), "PINNS": str(crio_tools["pinns"])})
    names = [s["name"] for s in result["steps"]]
    assert result["runtime"] == "kata" and "CRI-O restarts under the pod" in names
    facts = result["cri"]
    assert facts["runtime"].startswith("cri-o 1.") and facts["runtime_handler"] == "crust"
    assert facts["runtime_class"] == "crust-microvm"
    assert Crio.outside() == outside_before
