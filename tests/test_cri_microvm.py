"""Pods of RuntimeClass crust-microvm started through CRI by a real
containerd (own root, state, socket and config) with crust's shim v2
(`containerd-shim-crust-v2`, runtime io.containerd.crust.v2) in front of the
microVM handler; kubelet's CRI side replayed from its public source."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest

from crust.api import cri_pb2 as cri
from tests.cri_harness import leftovers_of, private_containerd, processes_naming, shim_pids

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
SHIM_RUNTIME = {"crust": "io.containerd.crust.v2"}


def _host_network_pod(containerd, name: str, uid: str) -> cri.PodSandboxConfig:
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, namespace="default", uid=uid),
        log_directory=str(containerd.directory / "logs" / uid),
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{containerd.cgroup_root}/pod{uid}",
            security_context=cri.LinuxSandboxSecurityContext(namespace_options=cri.NamespaceOption(
                network=cri.NODE, pid=cri.CONTAINER, ipc=cri.POD))))


# -- deploy/ -------------------------------------------------------------------------------------


def test_deploy_configures_the_crust_runtime_for_containerd_and_kubernetes(tmp_path):
    import tomllib

    import yaml

    from crust.containerd_shim.main import handler_endpoint
    from crust.api import containerd_runtimeoptions_pb2 as runtimeoptions
    from google.protobuf import any_pb2
    from tests.kustomize import render
    from tests.test_deploy import validate

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
    base = [d for d in render(DEPLOY / "kubernetes") if d["kind"] == "RuntimeClass"]
    kata = [d for d in render(DEPLOY / "kubernetes" / "overlays" / "kata") if d["kind"] == "RuntimeClass"]
    for runtime_class in base + kata:
        validate(runtime_class)
    assert [(d["metadata"]["name"], d["handler"]) for d in base] == [("crust-microvm", "crust")]
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
        config = _host_network_pod(containerd, "p0", "uid-p0")
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
