"""`crust node`: one config file brings up driver, shim, proxy (registered
with kubelet) and a handler; a SIGKILLed child comes back; SIGTERM stops
everything and leaves nothing mounted or attached."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crust.common.endpoint import accepts_connections
from crust.kubelet import Kubelet, PersistentVolume, Pod
from crust.node.config import NodeConfig, Runtime
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, loops_left, mount_cap
from tests.harness.daemons import wait_until
from tests.harness.node_run import NodeRun, write_config

DRIVER = "loop.csi.crust.dev"
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


@pytest.fixture
def node_run(root):
    runs: list[NodeRun] = []

    def start(**extra) -> NodeRun:
        runs.append(NodeRun(root.path, write_config(root.path, **extra)))
        return runs[-1]

    yield start
    for run in runs:
        run.stop()


def test_one_config_runs_the_node_restarts_a_killed_child_and_stops_cleanly(root, node_run):
    run = node_run()
    printed = run.wait_serving()
    cfg = run.config
    for where in (cfg.kubelet_csi_socket, cfg.driver_socket, cfg.shim_socket, cfg.runtime_socket,
                  cfg.handler_socket, cfg.registration_dir / f"{DRIVER}-reg.sock"):
        assert str(where) in printed, f"{where} is not printed"
        assert where.is_socket()

    # Kubelet finds the driver by itself and publishes a deferred volume.
    kubelet = Kubelet(cfg.kubelet_root, "node-a", retry_seconds=10)
    assert kubelet.register() == DRIVER
    from crust.api import csi_pb2, csi_pb2_grpc
    import grpc
    with grpc.insecure_channel(f"unix://{kubelet.endpoint}") as channel:
        vol = csi_pb2_grpc.ControllerStub(channel).CreateVolume(csi_pb2.CreateVolumeRequest(
            name="pv-node", capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MIB),
            volume_capabilities=[mount_cap("ext4")], parameters={"crust.dev/defer": "true"}), timeout=60).volume
    pv = PersistentVolume(name="pv-node", volume_handle=vol.volume_id, attributes=dict(vol.volume_context))
    pod = Pod(uid="uid-node", name="node-pod", fs_group=1000)
    target = kubelet.start_pod(pv, pod)
    assert sysmount.at(str(target)).fs_type == "tmpfs"

    # `crust status --config` sees every child, socket and the registration.
    status = subprocess.run([sys.executable, "-m", "crust", "status", "--config", str(run.root / "node.yaml"),
                             "--json"], capture_output=True, text=True, timeout=60, env=ENV)
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert [c["name"] for c in report["supervisor"]["children"]] == ["driver", "shim", "proxy", "handler"]
    assert {s["health"] for s in report["sockets"].values()} == {"SERVING"}
    assert report["proxy"]["kubelet_registration"]["state"] == "registered"
    assert len(report["proxy"]["volumes"]) == 1

    # SIGKILL each of shim and driver: back within 2 s, serving.
    for name, sock in (("shim", cfg.shim_socket), ("driver", cfg.driver_socket)):
        old = run.child(name)["pid"]
        os.kill(old, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: run.child(name)["pid"] != old and run.child(name)["running"], timeout=5,
                   what=f"the {name} to be restarted")
        wait_until(lambda: accepts_connections(sock), timeout=5, what=f"the {name} to serve again")
        assert time.monotonic() - killed < 2.0, f"the {name} took {time.monotonic() - killed:.2f} s to come back"
        child = run.child(name)
        assert child["restarts"] == 1 and child["last_exit"] == "signal SIGKILL"
    # The chain works through the restarted children.
    usage = kubelet.retried(kubelet.volume_stats, pv, pod)
    assert usage is not None
    kubelet.stop_pod(pv, pod)

    # SIGTERM: every child stops, nothing of the node stays mounted or attached.
    assert run.stop() == 0
    assert all(not c["running"] for c in run.status()["children"])
    prefix = str(run.root) + "/"
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []
    # The volume still exists (it was not deleted): its file stays, detached.
    assert loops_left(lambda b: b.startswith(prefix)) == {}
    assert not (cfg.registration_dir / f"{DRIVER}-reg.sock").exists()
    for c in run.status()["children"]:
        assert not Path(f"/proc/{c['pid']}").exists() or "Z" in Path(f"/proc/{c['pid']}/stat").read_text().split()[2]


def test_a_killed_supervisor_takes_its_children_down(root, node_run):
    run = node_run()
    run.wait_serving()
    pids = [c["pid"] for c in run.status()["children"]]
    run.proc.kill()
    run.proc.wait()
    for pid in pids:
        wait_until(lambda: not Path(f"/proc/{pid}").exists(), timeout=20, what=f"child {pid} to exit")


def test_status_of_a_node_whose_file_has_no_node_id_takes_it_as_the_node_did(root):
    """In the DaemonSet the ConfigMap has no nodeId (`crust node --node-id
    $(NODE_NAME)`): `crust status --config` in the pod takes $NODE_NAME, or
    --node-id, instead of refusing the file."""
    config = json.loads(write_config(root.path).read_text())
    del config["nodeId"]
    path = root.path / "shared.yaml"
    path.write_text(json.dumps(config))
    argv = [sys.executable, "-m", "crust", "status", "--config", str(path), "--json"]
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in ENV.items() if k != "NODE_NAME"})
    assert refused.returncode == 2 and "nodeId: Field required" in refused.stderr
    for extra, env in (([], {**ENV, "NODE_NAME": "node-b"}), (["--node-id", "node-b"], ENV)):
        shown = subprocess.run(argv + extra, capture_output=True, text=True, timeout=60, env=env)
        assert "Field required" not in shown.stderr, shown.stderr
        assert json.loads(shown.stdout)["node_id"] == "node-b"


def test_unknown_and_bad_keys_are_refused_with_their_path(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text("nodeId: n1\ndriver:\n  capcity: 10Gi\nhandler:\n  runtime: docker\nrunDir: relative/run\n")
    result = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(path)], capture_output=True,
                            text=True, timeout=30, env=ENV)
    assert result.returncode == 2
    assert "driver.capcity: Extra inputs are not permitted" in result.stderr
    assert "handler.runtime" in result.stderr and "runDir" in result.stderr
    path.write_text("driver: {}\n")
    result = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(path)], capture_output=True,
                            text=True, timeout=30, env=ENV)
    assert result.returncode == 2 and "nodeId: Field required" in result.stderr
    path.write_text("nodeId: n1\ndriver:\n  capacity: 2Gi\n")
    check = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(path), "--check"],
                           capture_output=True, text=True, timeout=30, env=ENV)
    assert check.returncode == 0 and "--capacity 2147483648" in check.stdout
    assert "--kubelet-registration-dir /var/lib/kubelet/plugins_registry" in check.stdout


def test_the_example_config_and_the_cli_agree():
    """deploy/node.yaml validates, and every flag the supervisor passes is one
    its child's --help knows."""
    from crust.cli import build_parser
    from crust.node.supervisor import child_argvs

    repo = Path(__file__).resolve().parents[2]
    config = NodeConfig.load(repo / "deploy" / "node.yaml")
    parser = build_parser()
    for runtime in Runtime:
        variant = config.model_copy(update={"handler": config.handler.model_copy(update={"runtime": runtime})})
        children = child_argvs(variant, Path("/run/crust/node/policy.json"))
        assert [name for name, _, _ in children] == ["driver", "shim", "proxy"] + ([] if runtime == "none"
                                                                                   else ["handler"])
        for _, argv, _ in children:
            parser.parse_args(argv)  # exits (SystemExit) on an unknown flag
    unit = (repo / "deploy" / "systemd" / "crust-node.service").read_text()
    assert "crust node --config /etc/crust/node.yaml" in unit


def test_the_microvm_handlers_disk_bus_is_a_node_setting(root):
    """handler.kata.diskBus reaches the microVM handler as --disk-bus; a
    bus it does not have is refused naming the key, before anything starts."""
    from crust.node.supervisor import child_argvs

    for bus in ("virtio-scsi", "virtio-blk", None):
        kata = {"diskBus": bus} if bus else {}
        config = NodeConfig.load(write_config(root.path, handler={"runtime": "kata", "kata": kata}))
        (argv,) = [argv for name, argv, _ in child_argvs(config, Path("/p.json")) if name == "handler"]
        assert argv[argv.index("--disk-bus") + 1] == (bus or "virtio-blk")
    result = _refused(write_config(root.path, handler={"runtime": "kata", "kata": {"diskBus": "ide"}}))
    assert "handler.kata.diskBus" in result.stderr, result.stderr


def test_the_microvm_handlers_template_and_memory_bounds_are_node_settings(root):
    """The template is on unless the file turns it off; memoryMiB and
    maxMemoryMiB reach the handler as --memory and --max-memory (256 and
    2048 unless set); a ceiling below the floor is refused naming it."""
    from crust.node.supervisor import child_argvs

    for kata, template, memory in (({}, True, ("256", "2048")),
                                   ({"vmTemplate": False, "memoryMiB": 512, "maxMemoryMiB": 512}, False,
                                    ("512", "512"))):
        config = NodeConfig.load(write_config(root.path, handler={"runtime": "kata", "kata": kata}))
        (argv,) = [argv for name, argv, _ in child_argvs(config, Path("/p.json")) if name == "handler"]
        assert ("--vm-template" in argv) is template
        assert (argv[argv.index("--memory") + 1], argv[argv.index("--max-memory") + 1]) == memory
    result = _refused(write_config(root.path, handler={"runtime": "kata", "kata": {"maxMemoryMiB": 128}}))
    assert "maxMemoryMiB 128 is below memoryMiB 256" in result.stderr, result.stderr


def test_the_microvm_handlers_vcpus_are_a_node_setting(root):
    """handler.kata.cpus reaches the microVM handler as --cpus (1 unless
    set); none, or a count that is no number, is refused naming the key."""
    from crust.node.supervisor import child_argvs

    for cpus in (2, None):
        kata = {"cpus": cpus} if cpus else {}
        config = NodeConfig.load(write_config(root.path, handler={"runtime": "kata", "kata": kata}))
        (argv,) = [argv for name, argv, _ in child_argvs(config, Path("/p.json")) if name == "handler"]
        assert argv[argv.index("--cpus") + 1] == str(cpus or 1)
    for bad in (0, "two"):
        result = _refused(write_config(root.path, handler={"runtime": "kata", "kata": {"cpus": bad}}))
        assert "handler.kata.cpus" in result.stderr, result.stderr
    from crust.cli import build_parser

    required = ["--endpoint", "unix:///h.sock", "--proxy-endpoint", "unix:///p.sock", "--volumes-dir", "/v",
                "--state-dir", "/s"]
    assert build_parser().parse_args(["kata", "handler", *required, "--cpus", "2"]).cpus == 2
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["kata", "handler", *required, "--cpus", bad])


def test_a_registration_socket_held_by_another_server_stops_the_start(root):
    """A node-driver-registrar already registers the driver: crust node says
    so and exits, instead of restarting the proxy forever."""
    import socket

    config = write_config(root.path, supervisor={"readyTimeoutSeconds": 30})
    registry = root.path / "kubelet" / "plugins_registry"
    registry.mkdir(parents=True)
    holder = socket.socket(socket.AF_UNIX)
    try:
        holder.bind(str(registry / f"{DRIVER}-reg.sock"))
        holder.listen()
        result = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(config)],
                                capture_output=True, text=True, timeout=60, env=ENV)
    finally:
        holder.close()
    assert result.returncode == 1
    assert "another server is listening there. Is a node-driver-registrar registering this driver?" in result.stderr
    assert (registry / f"{DRIVER}-reg.sock").exists(), "the other server's socket was taken away"
    prefix = str(root.path) + "/"
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []


def _refused(config: Path) -> subprocess.CompletedProcess:
    """`crust node` on config: it must exit 2 before starting anything."""
    result = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(config)], capture_output=True,
                            text=True, timeout=60, env=ENV)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result


def test_the_shims_freeze_timeout_is_a_node_setting(root):
    """shim.freezeTimeoutSeconds reaches the CSI shim as --freeze-timeout-seconds
    (60 unless set); a value out of 1..600 is refused naming the key."""
    from crust.node.supervisor import child_argvs

    for timeout in (15, None):
        shim = {"freezeTimeoutSeconds": timeout} if timeout else {}
        config = NodeConfig.load(write_config(root.path, shim=shim))
        (argv,) = [argv for name, argv, _ in child_argvs(config, Path("/p.json")) if name == "shim"]
        assert argv[argv.index("--freeze-timeout-seconds") + 1] == str(timeout or 60)
    result = _refused(write_config(root.path, shim={"freezeTimeoutSeconds": 601}))
    assert "shim.freezeTimeoutSeconds" in result.stderr, result.stderr


def test_a_socket_path_or_a_metrics_port_used_twice_is_refused_naming_the_key(root):
    run = root.path / "run"
    result = _refused(write_config(root.path, csiSocket=str(run / "driver.sock")))
    assert "csiSocket" in result.stderr and "driver" in result.stderr
    assert not (run / "driver.sock").exists()
    result = _refused(write_config(root.path, csiSocket=str(run / "runtime" / "proxy.sock")))
    assert "csiSocket" in result.stderr and "runtime" in result.stderr
    result = _refused(write_config(root.path, kubeletRegistration={"dir": str(run)},
                                   csiSocket=str(run / f"{DRIVER}-reg.sock")))
    assert "csiSocket" in result.stderr and "kubeletRegistration" in result.stderr
    result = _refused(write_config(root.path, driver={"capacity": "10Gi", "metricsPort": 19321},
                                   proxy={"metricsPort": 19321}))
    assert "proxy.metricsPort" in result.stderr and "driver.metricsPort" in result.stderr


def test_a_state_or_kubelet_root_that_is_not_a_real_directory_is_refused_naming_the_key(root):
    plain = root.path / "a-file"
    plain.write_text("not a directory\n")
    elsewhere = root.path / "elsewhere"
    elsewhere.mkdir()
    link = root.path / "a-link"
    link.symlink_to(elsewhere)
    for key, value in (("stateDir", plain), ("stateDir", link), ("stateDir", plain / "below"),
                       ("runDir", plain), ("kubeletRoot", link), ("kubeletRoot", link / "kubelet"),
                       ("kubeletRoot", plain)):
        result = _refused(write_config(root.path, **{key: str(value)}))
        assert f"{key}: " in result.stderr, (key, value, result.stderr)
        assert plain.read_text() == "not a directory\n"
        assert list(elsewhere.iterdir()) == [], f"{key}={value} created {list(elsewhere.iterdir())}"
    result = _refused(write_config(root.path, driver={"capacity": "10Gi", "dataDir": str(link)}))
    assert "driver.dataDir: " in result.stderr


def test_an_invalid_handler_name_is_refused_naming_the_key(root):
    for name in ("has space", "x" * 64, "slash/name", "a:b"):
        result = _refused(write_config(root.path, handler={"runtime": "mountns", "name": name}))
        assert "handler.name" in result.stderr, (name, result.stderr)


def test_readiness_is_the_childs_own_listener_not_any_listener_on_its_socket(root):
    """A foreign server already listening at the shim's socket: the shim
    cannot bind and exits; the supervisor must not take that server for
    the shim (it reported "serving" while the shim crash-looped)."""
    import socket

    config = write_config(root.path, supervisor={"readyTimeoutSeconds": 20})
    run = root.path / "run"
    run.mkdir(mode=0o700)
    holder = socket.socket(socket.AF_UNIX)
    try:
        holder.bind(str(run / "shim.sock"))
        holder.listen()
        result = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(config)],
                                capture_output=True, text=True, timeout=90, env=ENV)
    finally:
        holder.close()
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "every component is serving" not in result.stdout
    failed = [json.loads(line) for line in result.stderr.splitlines()
              if line.startswith("{") and "child failed to start" in line]
    assert [f["child"] for f in failed] == ["shim"], result.stderr[-3000:]
    prefix = str(root.path) + "/"
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []
