"""Pods of RuntimeClass crust-microvm started through CRI by a real
containerd (own root, state, socket and config) with crust's shim v2
(`containerd-shim-crust-v2`, runtime io.containerd.crust.v2) in front of the
microVM handler; kubelet's CRI side replayed from its public source."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc
from crust.kata.vmm.qemu import qemu_pids_under
from crust.kubelet import Container, VolumeMount
from tests.harness.demo_run import run_demo
from tests.harness.cri import (KATA_HANDLER, ON_CONTAINERD2, container_log, containerd_binary, cri_microvm_node,
                               host_network_pod, leftovers_of, private_containerd, processes_naming, shim_pids)
from tests.harness.daemons import wait_until
from tests.harness.microvm_pod import APP, READER, container_df, kubelet_volume_stats, microvm_pod
from tests.harness.mount_watch import MountWatch

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SHIM_RUNTIME = {"crust": "io.containerd.crust.v2"}


# -- deploy/ -------------------------------------------------------------------------------------


def test_deploy_configures_the_crust_runtime_for_containerd_and_kubernetes(tmp_path):
    import tomllib

    from crust.containerd_shim.options import handler_endpoint
    from crust.api import containerd_runtimeoptions_pb2 as runtimeoptions
    from google.protobuf import any_pb2
    from tests.harness.kustomize import render
    from tests.harness.kube_schema import validate

    drop_in = DEPLOY / "containerd" / "crust.toml"
    config = tmp_path / "config.toml"
    config.write_text(f'version = 2\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n'
                      f'imports = ["{drop_in}"]\n[grpc]\n  address = "{tmp_path}/c.sock"\n')
    dump = subprocess.run(["containerd", "--config", str(config), "config", "dump"], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    runtime = tomllib.loads(dump)["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crust"]
    assert runtime["runtime_type"] == "io.containerd.crust.v2"
    # The shim reads the options file the way containerd hands it over.
    options = any_pb2.Any(type_url="runtimeoptions.v1.Options", value=runtimeoptions.Options(
        config_path=str(DEPLOY / "containerd" / "containerd-shim-crust.toml")).SerializeToString())
    assert runtime["options"]["ConfigPath"] == "/etc/crust/containerd-shim-crust.toml"
    assert handler_endpoint(options.SerializeToString()) == "unix:///run/crust/kata-handler.sock"
    host = [d for d in render(DEPLOY / "kubernetes" / "overlays" / "host-handler") if d["kind"] == "RuntimeClass"]
    kata = [d for d in render(DEPLOY / "kubernetes" / "overlays" / "kata") if d["kind"] == "RuntimeClass"]
    for runtime_class in host + kata:
        validate(runtime_class)
    assert [(d["metadata"]["name"], d["handler"]) for d in host] == [("crust-microvm", "crust")]
    assert [(d["metadata"]["name"], d["handler"]) for d in kata] == [("crust-microvm", "kata")]
    assert (Path(__import__("sys").executable).parent / "containerd-shim-crust-v2").exists()


# -- the shim without a handler ---------------------------------------------------------------


def test_a_pod_fails_clearly_without_the_handler_and_leaves_no_shim(tmp_path):
    """containerd starts our shim, whose Create asks the handler named by the
    runtime's ConfigPath file (handed over by CRI on the shim's stdin): the
    error reaches RunPodSandbox naming that socket, and the shim goes."""
    missing = tmp_path / "no-handler.sock"
    settings = tmp_path / "shim.toml"
    settings.write_text(f'handler_endpoint = "unix://{missing}"\n')
    with private_containerd(shim_runtimes=SHIM_RUNTIME, shim_options={"crust": {"ConfigPath": str(settings)}},
                            env={"CRUST_KATA_HANDLER_ENDPOINT": "unix:///nonexistent/elsewhere.sock"}
                            ) as (containerd, image):
        rs = containerd.runtime_service
        config = host_network_pod(containerd, "p0", "uid-p0")
        with pytest.raises(grpc.RpcError) as caught:
            rs.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler="crust"), timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "CreatePod" in caught.value.details() and str(missing) in caught.value.details()
        deadline = time.monotonic() + 10
        while shim_pids(containerd) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not shim_pids(containerd), "the shim stays after its only task failed"
        assert not processes_naming(str(containerd.socket))
    assert not leftovers_of(containerd)


# -- pods in the microVM -----------------------------------------------------------------------

def _handler_wait(root, container_id: str) -> handler_pb2.ProcessState:
    """The container's process as the handler sees it, once it exited."""
    with grpc.insecure_channel(f"unix://{root.path / KATA_HANDLER['endpoint_name']}") as channel:
        return handler_pb2_grpc.PodRuntimeStub(channel).GetProcess(
            handler_pb2.GetProcessRequest(container_id=container_id, wait=True), timeout=60)


@pytest.mark.parametrize(("disk_bus", "containerd"), [
    pytest.param("virtio-blk", "containerd", id="virtio-blk"), pytest.param("virtio-scsi", "containerd", id="virtio-scsi"),
    pytest.param("virtio-blk", "containerd2", id="virtio-blk-containerd2", marks=ON_CONTAINERD2)])
def test_a_pod_runs_in_the_microvm_through_containerd(root, disk_bus, containerd):
    """kubelet -> containerd -> containerd-shim-crust-v2 -> microVM handler ->
    guest: the image's command runs in the guest and writes into a deferred
    ext4 and xfs volume (with the pod's fsGroup), ExecSync's df equals
    NodeGetVolumeStats, ext4 grows online in the guest, a second container
    shares the VM, containerd restarts under the pod, output and exit codes
    reach the container log and ContainerStatus, StopPodSandbox stops the VM
    and releases every claim, and the host's mount table never shows either
    volume. On either disk bus of the handler; through Debian's containerd
    1.6 and a containerd 2.x."""
    with cri_microvm_node(root, handler_extra=("--disk-bus", disk_bus), binary=containerd_binary(containerd)) as node:
        ext4, xfs = node.pv("pv-m-ext4", "ext4", size=256 * 1024**2), node.pv("pv-m-xfs", "xfs")
        image = node.image.name
        pod = microvm_pod(node, "micro", {"ext4": ext4, "xfs": xfs}, [
            Container("app", image, command=["/bin/sh", "-c", APP],
                      volume_mounts=[VolumeMount("ext4", "/ext4"), VolumeMount("xfs", "/xfs")]),
            Container("reader", image, command=["/bin/sh", "-c", READER],
                      volume_mounts=[VolumeMount("ext4", "/ext4")])])
        targets = {str(node.kubelet.start_pod(pv, pod)) for pv in (ext4, xfs)}
        entries = [node.entry(pod, pv) for pv in (ext4, xfs)]
        devices = {(e["device-major"], e["device-minor"]) for e in entries}
        with MountWatch(devices) as watch:
            sandbox_id = node.runtime.run_pod(pod)
            status = node.runtime.pod_status(pod)
            app, reader = status.latest("app"), status.latest("reader")
            wait_until(lambda: "written" in container_log(app), timeout=180, what="the app's writes in the guest")
            log = container_log(app)
            assert "hello-from-the-guest" in log
            # Written by the guest with the pod's fsGroup as the file's group.
            assert " 0 2000 " in " ".join(log.split()) + " ", log
            # It ran in the guest: no process on the host runs the script.
            assert not processes_naming("/ext4/written")
            # One VM and one shim for the pod; the second container ran in it.
            (vm_pid,) = qemu_pids_under(root.path)
            assert len(shim_pids(node.containerd)) == 1
            done = node.runtime.wait_container(reader.id, timeout=120)
            assert (done.state, done.exit_code) == (cri.CONTAINER_EXITED, 3)
            assert "second-sees-ext4" in container_log(done)
            assert {(c[0], c[2]) for c in node.claims()} == {(t, sandbox_id) for t in targets}

            # Stats through the Runtime API equal df inside the guest.
            for pv, path in ((ext4, "/ext4"), (xfs, "/xfs")):
                assert kubelet_volume_stats(node, pv, pod) == container_df(node, app.id, path), path
            # Both on the handler's disk bus: virtio disks or SCSI LUNs in the guest.
            df = node.runtime.exec_sync(app.id, ["/bin/df", "-P", "/ext4", "/xfs"], timeout=60).stdout.decode()
            kind = "/dev/vd" if disk_bus == "virtio-blk" else "/dev/sd"
            assert [line.split()[0][:len(kind)] for line in df.splitlines()[1:]] == [kind, kind], df
            # ext4 grows online in the guest while the container runs.
            before = container_df(node, app.id, "/ext4")["total"]
            grown = 512 * 1024**2
            node.proxy.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
                volume_id=ext4.volume_handle, capacity_range=csi_pb2.CapacityRange(required_bytes=grown)),
                timeout=60)
            node.kubelet.expand(ext4, pod, grown)
            after = container_df(node, app.id, "/ext4")
            assert after["total"] > before + 200 * 1024**2 and kubelet_volume_stats(node, ext4, pod) == after

            # containerd restarts under the running pod: it finds the shim
            # again and loses nothing.
            node.containerd.restart(signal.SIGKILL)
            assert node.runtime.container_status(app.id).state == cri.CONTAINER_RUNNING
            assert kubelet_volume_stats(node, ext4, pod) == container_df(node, app.id, "/ext4") == after
            assert qemu_pids_under(root.path) == [vm_pid] and len(shim_pids(node.containerd)) == 1
            # The container ends by itself while containerd is away again:
            # its exit code and its last words still arrive.
            assert node.runtime.exec_sync(app.id, ["/bin/touch", "/ext4/stop"], timeout=60).exit_code == 0
            node.containerd.stop(signal.SIGKILL)
            exited = _handler_wait(root, app.id)
            assert (exited.status, exited.exit_code) == (handler_pb2.ProcessState.STOPPED, 7)
            node.containerd.start()
            ended = node.runtime.wait_container(app.id, timeout=120)
            if containerd == "containerd2":
                # containerd 2.3, started again, takes a task shim whose
                # processes all ended for a leaked one and removes the task:
                # CRI reports 255, "Unknown", as it does for stock runc's
                # (the docs' support table), and never reads its last output.
                assert (ended.state, ended.exit_code, ended.reason) == (cri.CONTAINER_EXITED, 255, "Unknown")
            else:
                assert (ended.state, ended.exit_code) == (cri.CONTAINER_EXITED, 7)
                wait_until(lambda: "stopping" in container_log(ended), timeout=30,
                           what="the app's last line in its log")

            # Kubelet stops the pod: the VM stops and every claim goes.
            node.runtime.kill_pod(pod)
            wait_until(lambda: qemu_pids_under(root.path) == [], timeout=120, what="the VM to stop")
            assert node.claims() == set()
            node.runtime.remove_pod(pod)
            for pv in (ext4, xfs):
                node.kubelet.stop_pod(pv, pod)
            wait_until(lambda: not shim_pids(node.containerd), timeout=30, what="the pod's shim to exit")
        assert watch.reads > 100 and watch.seen == [], watch.seen


def test_a_killed_vm_is_reported_exited_and_its_claims_released(root):
    """StopContainer's SIGTERM reaches a process in the guest (its own exit
    code comes back); then SIGKILL the pod's QEMU: CRI reports the other
    container exited and the sandbox not ready, and the claim is released;
    kubelet's stop and removal then end the shim."""
    with cri_microvm_node(root) as node:
        pv = node.pv("pv-m-kill", "ext4", size=128 * 1024**2)
        pod = microvm_pod(node, "killed", {"data": pv}, [
            Container("app", node.image.name, command=["/bin/sh", "-c", "echo up > /data/up && echo up; sleep 600"],
                      volume_mounts=[VolumeMount("data", "/data")]),
            Container("graceful", node.image.name, command=[
                "/bin/sh", "-c", "trap 'echo got-term; exit 42' TERM; echo ready; while true; do sleep 1; done"])])
        target = str(node.kubelet.start_pod(pv, pod))
        entry = node.entry(pod, pv)
        sandbox_id = node.runtime.run_pod(pod)
        status = node.runtime.pod_status(pod)
        app, graceful = status.latest("app"), status.latest("graceful")
        wait_until(lambda: "up" in container_log(app) and "ready" in container_log(graceful), timeout=180,
                   what="the containers to run")
        # Kubelet stops one container: SIGTERM in the guest, its own exit code.
        assert node.runtime._stop_container(graceful.id, 10) == ""
        stopped = node.runtime.container_status(graceful.id)
        assert (stopped.state, stopped.exit_code) == (cri.CONTAINER_EXITED, 42)
        wait_until(lambda: "got-term" in container_log(stopped), timeout=30, what="the trap's line in the log")
        assert {(c[0], c[2]) for c in node.claims()} == {(target, sandbox_id)}
        (vm_pid,) = qemu_pids_under(root.path)
        os.kill(vm_pid, signal.SIGKILL)
        status = wait_until(lambda: (s := node.runtime.container_status(app.id)).state == cri.CONTAINER_EXITED and s,
                            timeout=60, what="CRI to report the container exited")
        assert status.exit_code != 0
        wait_until(lambda: node.runtime.pod_status(pod).sandboxes[0].state == cri.SANDBOX_NOTREADY, timeout=60,
                   what="CRI to report the sandbox not ready")
        wait_until(lambda: node.claims() == set(), timeout=60, what="the claim's release")
        node.runtime.kill_pod(pod)
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)
        wait_until(lambda: not shim_pids(node.containerd), timeout=30, what="the pod's shim to exit")
        assert node.host_mounts_of(entry) == []


def test_a_restarted_handler_and_a_killed_shim(root):
    """The handler is killed and started again under a running pod: the
    shim's output copy and exit wait resume, so the container's last line
    and exit code still arrive. Then the pod's shim is SIGKILLed: containerd
    cleans up with `containerd-shim-crust-v2 delete`, which stops the pod in
    the handler: the container is reported exited, the VM stops, the claim
    goes, and so does the dead shim's socket. (A shim per pod: the shared
    shim's death is test_a_nodes_pods_share_one_shim_and_its_death_ends_them_all's.)"""
    with cri_microvm_node(root, shim_group="pod") as node:
        pv = node.pv("pv-m-restart", "ext4", size=128 * 1024**2)
        script = "echo up; while [ ! -e /data/stop ]; do sleep 1; done; echo bye; exit 9"
        first = microvm_pod(node, "restarted", {"data": pv}, [
            Container("app", node.image.name, command=["/bin/sh", "-c", script],
                      volume_mounts=[VolumeMount("data", "/data")])])
        node.kubelet.start_pod(pv, first)
        node.runtime.run_pod(first)
        app = node.runtime.pod_status(first).latest("app")
        wait_until(lambda: "up" in container_log(app), timeout=180, what="the container to run")
        node.env.handler.kill()
        node.env.handler.start(timeout=120)
        assert node.runtime.exec_sync(app.id, ["/bin/touch", "/data/stop"], timeout=60).exit_code == 0
        ended = node.runtime.wait_container(app.id, timeout=120)
        assert (ended.state, ended.exit_code) == (cri.CONTAINER_EXITED, 9)
        wait_until(lambda: "bye" in container_log(ended), timeout=30, what="the last line after the handler's restart")
        node.runtime.kill_pod(first)
        node.runtime.remove_pod(first)
        node.kubelet.stop_pod(pv, first)
        assert node.claims() == set()

        second = microvm_pod(node, "orphaned", {"data": pv}, [
            Container("app", node.image.name, command=["/bin/sh", "-c", "echo up; sleep 600"],
                      volume_mounts=[VolumeMount("data", "/data")])])
        target = str(node.kubelet.start_pod(pv, second))
        sandbox_id = node.runtime.run_pod(second)
        app = node.runtime.pod_status(second).latest("app")
        wait_until(lambda: "up" in container_log(app), timeout=180, what="the second pod's container to run")
        assert {(c[0], c[2]) for c in node.claims()} == {(target, sandbox_id)}
        (shim,) = shim_pids(node.containerd)
        argv = Path(f"/proc/{shim}/cmdline").read_bytes().decode().split("\0")
        socket_path = Path(argv[argv.index("-socket") + 1])
        assert socket_path.is_socket()
        os.kill(shim, signal.SIGKILL)
        status = wait_until(lambda: (s := node.runtime.container_status(app.id)).state == cri.CONTAINER_EXITED and s,
                            timeout=60, what="CRI to report the container exited")
        assert status.exit_code != 0
        wait_until(lambda: node.claims() == set(), timeout=120, what="the claim's release by the shim's delete")
        # The dead shim's socket goes with the shim's delete too.
        wait_until(lambda: not socket_path.exists(), timeout=60, what="the killed shim's socket to be removed")
        wait_until(lambda: qemu_pids_under(root.path) == [], timeout=120, what="the VM to stop")
        node.runtime.kill_pod(second)
        node.runtime.remove_pod(second)
        node.kubelet.stop_pod(pv, second)


def test_a_nodes_pods_share_one_shim_and_its_death_ends_them_all(root):
    """shim_group "node": two pods' containers are served by one shim
    process (containerd is given the same address); removing one pod leaves
    the other answering execs through the same shim, and a pod started
    later joins it. The shim SIGKILLed ends every pod it served (the
    failure domain docs/containerd-shim.md names): containerd's `delete`
    stops each pod in the handler, each container is reported exited, the
    VMs stop and the dead shim's socket goes."""
    with cri_microvm_node(root, shim_group="node") as node:
        def run(name: str):
            made = microvm_pod(node, name, {}, [
                Container("app", node.image.name, command=["/bin/sh", "-c", "echo up; exec sleep 600"])])
            node.runtime.run_pod(made)
            app = node.runtime.pod_status(made).latest("app")
            wait_until(lambda: "up" in container_log(app), timeout=180, what=f"{name}'s container to run")
            return made, app

        first, first_app = run("shared-a")
        second, second_app = run("shared-b")
        (shim,) = shim_pids(node.containerd)
        for app, word in ((first_app, b"a"), (second_app, b"b")):
            answer = node.runtime.exec_sync(app.id, ["/bin/echo", word.decode()], timeout=60)
            assert (answer.exit_code, answer.stdout) == (0, word + b"\n")
        node.runtime.kill_pod(first)
        node.runtime.remove_pod(first)
        wait_until(lambda: len(qemu_pids_under(root.path)) == 1, timeout=120, what="the first pod's VM to stop")
        assert shim_pids(node.containerd) == [shim]
        assert node.runtime.exec_sync(second_app.id, ["/bin/echo", "still"], timeout=60).stdout == b"still\n"
        third, third_app = run("shared-c")
        assert shim_pids(node.containerd) == [shim]
        argv = Path(f"/proc/{shim}/cmdline").read_bytes().decode().split("\0")
        socket_path = Path(argv[argv.index("-socket") + 1])
        os.kill(shim, signal.SIGKILL)
        for app in (second_app, third_app):
            status = wait_until(lambda a=app: (s := node.runtime.container_status(a.id)).state ==
                                cri.CONTAINER_EXITED and s, timeout=60, what="CRI to report the container exited")
            assert status.exit_code != 0
        wait_until(lambda: qemu_pids_under(root.path) == [], timeout=120, what="the VMs to stop")
        wait_until(lambda: not socket_path.exists(), timeout=60, what="the killed shim's socket to be removed")
        for made in (second, third):
            node.runtime.kill_pod(made)
            node.runtime.remove_pod(made)


def test_starts_of_one_pods_containers_give_one_shim_that_shutdown_ends(tmp_path):
    """With a shim per pod (`shim_group` "pod"), containerd's `start`, four
    at once for containers of one pod (the check
    and the bind hold a lock on the socket directory): one
    daemon, one address (written to each bundle's `address` file, printed
    alone on stdout); Shutdown with no task left ends it and its socket."""
    import asyncio
    import json
    import sys

    from google.protobuf import empty_pb2

    from crust.api import containerd_task_pb2 as task_pb
    from crust.common.ttrpc_client import Client

    fake_containerd = str(tmp_path / "containerd.sock")  # only a name: nothing is called there
    bundles = []
    for n in range(4):
        bundle = tmp_path / f"bundle-{n}"
        bundle.mkdir()
        (bundle / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.container-type": "sandbox" if n == 0 else "container",
            "io.kubernetes.cri.sandbox-id": "pod-concurrent"}}))
        bundles.append(bundle)
    shim = Path(sys.executable).parent / "containerd-shim-crust-v2"
    recorded = f"unix://{tmp_path / 'recorded-handler.sock'}"
    env = {**os.environ, "CRUST_KATA_HANDLER_ENDPOINT": recorded, "CRUST_SHIM_GROUP": "pod"}
    starts = [subprocess.Popen([str(shim), "-namespace", "crust-test", "-address", fake_containerd,
                                "-publish-binary", "/bin/false", "-id", f"c-{n}", "start"], cwd=bundle, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for n, bundle in enumerate(bundles)]
    outputs = [p.communicate(timeout=30) for p in starts]
    daemons = []
    try:
        assert [p.returncode for p in starts] == [0] * 4, [o[1] for o in outputs]
        addresses = {out.decode() for out, _ in outputs}
        assert len(addresses) == 1, addresses
        (address,) = addresses
        assert address.startswith("unix:///run/containerd/s/") and "\n" not in address
        assert all((b / "address").read_text() == address for b in bundles)
        daemons = [int(line.split(":")[0]) for line in processes_naming(fake_containerd)]
        assert len(daemons) == 1, daemons

        async def shutdown():
            client = await Client.connect(address.removeprefix("unix://"))
            try:
                connected = await client.call("containerd.task.v2.Task", "Connect", task_pb.ConnectRequest(),
                                              task_pb.ConnectResponse, timeout=10)
                assert connected.shim_pid == daemons[0]
                await client.call("containerd.task.v2.Task", "Shutdown", task_pb.ShutdownRequest(),
                                  empty_pb2.Empty, timeout=10)
            finally:
                await client.close()

        asyncio.run(shutdown())
        wait_until(lambda: not processes_naming(fake_containerd), timeout=15, what="the shim to exit")
        assert not Path(address.removeprefix("unix://")).exists()
        # containerd's cleanup after a dead shim: `delete` asks the handler
        # `start` was told of (containerd gives `delete` no options), and
        # prints the exit containerd could not hear.
        deleted = subprocess.run([str(shim), "-namespace", "crust-test", "-address", fake_containerd, "-id", "c-1",
                                  "-bundle", str(bundles[1]), "delete"], cwd=bundles[1], capture_output=True,
                                 timeout=60, env={**os.environ, "CRUST_KATA_HANDLER_ENDPOINT": "unix:///elsewhere"})
        assert deleted.returncode == 0 and recorded in deleted.stderr.decode(), deleted.stderr
        response = task_pb.DeleteResponse.FromString(deleted.stdout)
        assert response.exit_status == 137 and response.exited_at.seconds > 0
    finally:
        for pid in daemons:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for out, _ in outputs:
            if out.startswith(b"unix://"):
                Path(out.decode().removeprefix("unix://")).unlink(missing_ok=True)


def test_starts_of_a_nodes_pods_give_one_shim_per_handler_that_ends_after_the_grace(tmp_path):
    """With `shim_group` "node" ($CRUST_SHIM_GROUP): `start`s of two pods'
    containers, four at once, give one daemon and one address; a pod of
    another handler gets a shim of its own. With no pod left, Shutdown ends
    each once no `start` touched its socket for the grace, socket and all.
    A value that is no group fails `start`, naming the setting."""
    import asyncio
    import json
    import sys

    from google.protobuf import empty_pb2

    from crust.api import containerd_task_pb2 as task_pb
    from crust.common.ttrpc_client import Client
    from crust.containerd_shim.pods import START_GRACE_SECONDS

    fake_containerd = str(tmp_path / "containerd.sock")  # only a name: nothing is called there
    shim = Path(sys.executable).parent / "containerd-shim-crust-v2"

    def bundle(name: str, kind: str, pod: str) -> Path:
        made = tmp_path / name
        made.mkdir()
        (made / "config.json").write_text(json.dumps({"annotations": {
            "io.kubernetes.cri.container-type": kind, "io.kubernetes.cri.sandbox-id": pod}}))
        return made

    def start(where: Path, task_id: str, handler: str, group: str = "node") -> subprocess.Popen:
        env = {**os.environ, "CRUST_KATA_HANDLER_ENDPOINT": f"unix://{tmp_path / handler}", "CRUST_SHIM_GROUP": group}
        return subprocess.Popen([str(shim), "-namespace", "crust-test", "-address", fake_containerd,
                                 "-publish-binary", "/bin/false", "-id", task_id, "start"], cwd=where, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    made = [(bundle(f"{pod}-{kind}", kind, pod), f"{pod}-{kind}") for pod in ("pod-a", "pod-b")
            for kind in ("sandbox", "container")]
    starts = [start(where, task_id, "a.sock") for where, task_id in made]
    outputs = [p.communicate(timeout=30) for p in starts]
    other = start(bundle("pod-c-sandbox", "sandbox", "pod-c"), "pod-c-sandbox", "c.sock")
    outputs.append(other.communicate(timeout=30))
    refused = start(bundle("pod-d-sandbox", "sandbox", "pod-d"), "pod-d-sandbox", "a.sock", group="cluster")
    _, refusal = refused.communicate(timeout=30)
    try:
        assert [p.returncode for p in starts + [other]] == [0] * 5, [o[1] for o in outputs]
        assert refused.returncode == 1 and b"shim_group: 'cluster' is not one of node, pod" in refusal
        addresses = [out.decode() for out, _ in outputs]
        assert len(set(addresses[:4])) == 1 and addresses[4] != addresses[0], addresses
        daemons = {int(line.split(":")[0]): line for line in processes_naming(fake_containerd)}
        assert len(daemons) == 2 and all(" -id node -shared " in line for line in daemons.values()), daemons

        async def shutdown(address: str) -> None:
            client = await Client.connect(address.removeprefix("unix://"))
            try:
                await client.call("containerd.task.v2.Task", "Shutdown", task_pb.ShutdownRequest(),
                                  empty_pb2.Empty, timeout=10)
            finally:
                await client.close()

        asked = time.monotonic()
        for address in set(addresses):
            asyncio.run(shutdown(address))
        wait_until(lambda: not processes_naming(fake_containerd), timeout=START_GRACE_SECONDS + 20,
                   what="the shared shims to exit")
        # The last start touched the sockets just before: they waited it out.
        assert time.monotonic() - asked > START_GRACE_SECONDS - 3
        assert not any(Path(a.removeprefix("unix://")).exists() for a in addresses)
    finally:
        for line in processes_naming(fake_containerd):
            try:
                os.kill(int(line.split(":")[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        for out, _ in outputs:
            if out.startswith(b"unix://"):
                Path(out.decode().removeprefix("unix://")).unlink(missing_ok=True)


# -- the demo ------------------------------------------------------------------------------------


def test_cri_kata_demo_runs_every_step_and_leaves_nothing(root):
    """`crust demo --cri --runtime kata --json` as a user runs it: the pod of
    RuntimeClass crust-microvm started by containerd through crust's shim,
    every step held, the same CRI facts as with crust-runc (the microVM's
    runtime handler), and nothing of it left."""
    result = run_demo(root, "--cri", "--runtime", "kata", "--fs", "ext4", timeout=600)
    names = [s["name"] for s in result["steps"]]
    assert result["runtime"] == "kata"
    assert "kubelet starts the pod through CRI (writes data)" in names and "containerd restarts under the pod" in names
    facts = result["cri"]
    assert facts["runtime"].startswith("containerd 1.") and facts["runtime_handler"] == "crust"
    assert facts["runtime_class"] == "crust-microvm"
