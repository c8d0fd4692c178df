"""crust's OCI runtime without containerd: its command line split as runc
splits it, the bundle rewritten in place for deferred mounts only, malformed
config.json and specs refused in runc's log (never with a traceback), a link
to another pod's deferred target refused, and deploy/'s configuration of
crust-runc for containerd, CRI-O and Kubernetes."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.harness.cri import OCI_RUNTIME, PYTHON_OCI_RUNTIME
from tests.harness.handler_env import make_env  # noqa: F401 - make_env is a fixture
from tests.harness.oci_runtime import _last_error, _runc_bundle, _runtime


# -- the runtime's command line (no runc needed) ------------------------------------------------------


def test_runc_command_lines_are_split_as_runc_does():
    from crust.oci_runtime.main import CREATE_VALUE_FLAGS, command_options, split_command_line

    args = ["--root", "/run/x", "--log=/b/log.json", "--log-format", "json", "--systemd-cgroup", "create",
            "--bundle", "/b", "--pid-file=/b/init.pid", "--no-pivot", "cid"]
    flags, command, rest = split_command_line(args)
    assert flags == {"--root": "/run/x", "--log": "/b/log.json", "--log-format": "json", "--systemd-cgroup": "true"}
    assert command == "create"
    assert command_options(rest, CREATE_VALUE_FLAGS) == (
        {"--bundle": "/b", "--pid-file": "/b/init.pid", "--no-pivot": "true"}, "cid")
    assert split_command_line(["delete", "--force", "cid"])[1:] == ("delete", ["--force", "cid"])
    assert command_options(["--force", "cid"], set()) == ({"--force": "true"}, "cid")


def test_the_bundle_is_rewritten_in_place_for_deferred_mounts_only():
    from crust.api import handler_pb2
    from crust.oci_runtime.bundle import deferred_candidates, rewrite

    target = "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount"
    spec = {"mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/data", "type": "bind", "source": target, "options": ["rbind", "rprivate", "rw"]},
        {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/kubelet/pods/u/etc-hosts",
         "options": ["rbind", "rprivate", "rw"]}]}
    assert deferred_candidates(spec) == [spec["mounts"][1]]
    device = handler_pb2.DeferredContainerMount(destination="/data", target_path=target, device="/dev/loop7",
                                                fs_type="xfs", options=["rw", "nouuid"])
    out = rewrite(spec, [device])
    assert out["mounts"][0] == spec["mounts"][0] and out["mounts"][2] == spec["mounts"][2]
    assert out["mounts"][1] == {"destination": "/data", "type": "xfs", "source": "/dev/loop7",
                                "options": ["rw", "nouuid"]}
    assert json.loads(out["annotations"]["dev.crust.deferred-volumes"])[0]["target"] == target
    assert spec["mounts"][1]["source"] == target, "the original spec is left as it was"


# -- crust's OCI runtime under hostile bundles ---------------------------------------------------------


@pytest.mark.parametrize("config, words", [
    ("[]", "a JSON object"),
    ("null", "a JSON object"),
    ("{not json", "config.json"),
    ('{"mounts": "/data"}', "mounts"),
    ('{"mounts": {"destination": "/data"}}', "mounts"),
    ('{"mounts": [1, 2]}', "mounts[0]"),
    ('{"mounts": [{"destination": "/data", "type": "bind", "source": 7, "options": ["rbind"]}]}', "mounts[0].source"),
    ('{"mounts": [{"destination": "/data", "type": "bind", "source": "/x", "options": "rbind"}]}', "mounts[0].options"),
    ('{"annotations": ["io.kubernetes.cri.sandbox-id"]}', "annotations"),
])
def test_a_malformed_config_json_is_refused_in_runcs_log_never_with_a_traceback(tmp_path, config, words):
    """The Python runtime reads every spec it is handed (crust-runc hands it
    those that may bind a CSI volume, and runc refuses the others itself)."""
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(config)
    log = tmp_path / "log.json"
    done = _runtime(bundle, log, tmp_path / "state", runtime=PYTHON_OCI_RUNTIME)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    message = _last_error(log)
    assert words in message and "config.json" in message, message
    assert (bundle / "config.json").read_text() == config, "the bundle was changed"


@pytest.mark.parametrize("runc", [None, "/bin/false"])
def test_a_malformed_spec_is_refused_by_the_program_the_front_end_hands_it_to(tmp_path, runc):
    """Through crust-runc: a malformed spec that names a CSI volume's path is
    the Python runtime's to refuse (its message, the field named); one that
    does not is runc's (runc's own message)."""
    for name, config, whose in (
            ("csi", '{"mounts": [{"destination": "/d", "source": "/var/lib/kubelet/pods/u/volumes/'
                    'kubernetes.io~csi/pv/mount", "options": "rbind"}]}', "mounts[0].options"),
            ("plain", '{"mounts": "/data"}', "" if runc == "/bin/false" else "json")):
        bundle = tmp_path / name
        (bundle / "rootfs").mkdir(parents=True)
        (bundle / "config.json").write_text(config)
        log = tmp_path / f"{name}.json"
        done = _runtime(bundle, log, tmp_path / "state", runc=runc or shutil.which("runc"))
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        if whose:
            assert whose in _last_error(log), _last_error(log)
        else:   # /bin/false wrote nothing: runc, not crust, had the call
            assert not log.exists() or not log.read_text().strip()
        assert (bundle / "config.json").read_text() == config, "the bundle was changed"


def test_a_link_to_another_pods_deferred_target_is_refused_and_its_placeholder_never_bound(make_env, tmp_path):
    """A pod's bind source that is a symbolic link to another pod's deferred
    target, as a kubelet CSI path and as any other path: `create` fails with
    the reason in runc's log, nothing is claimed, no container is made, and
    the placeholder is in no container. The volume's own pod still gets it."""
    env = make_env()
    victim = env.volume("pv-victim")
    runc_root = tmp_path / "runc"
    links = {"kubelet-csi-path": env.proxy.target("pod-evil", "pv-evil"), "other-path": tmp_path / "innocent"}
    try:
        for name, link in links.items():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(victim.target)
            bundle = _runc_bundle(tmp_path / name, [{"destination": "/data", "type": "bind", "source": str(link),
                                                     "options": ["rbind", "rw"]}], "pod-evil")
            log = tmp_path / f"{name}.json"
            done = _runtime(bundle, log, tmp_path / "state", runc=shutil.which("runc"),
                            handler=f"unix://{env.handler.socket}", runc_root=runc_root, container_id=name)
            bound = ""
            if done.returncode == 0:
                pid = int((bundle / "init.pid").read_text())
                bound = "; the container got " + " ".join(
                    line for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines() if " /data " in line)
            assert done.returncode != 0, f"{name}: create succeeded{bound}"
            assert "Traceback" not in done.stderr, done.stderr
            message = _last_error(log)
            assert str(link) in message and str(victim.target) in message and "placeholder" in message, message
            assert env.claim_set() == set()
            listed = subprocess.run(["runc", "--root", str(runc_root), "list", "-q"], capture_output=True, text=True)
            assert name not in listed.stdout.split(), "runc made the container"
    finally:
        for name in links:
            subprocess.run(["runc", "--root", str(runc_root), "delete", "--force", name], capture_output=True)
    env.unpublish(victim)


# -- deploy/: the runtime's configuration for containerd, CRI-O and Kubernetes -----------------------------


def test_deploy_configures_crust_runc_for_containerd_cri_o_and_kubernetes(tmp_path):
    import tomllib

    import yaml

    from crust.oci_runtime.main import settings
    from tests.harness.kube_schema import validate

    deploy = Path(__file__).resolve().parents[2] / "deploy"
    drop_in = deploy / "containerd" / "crust-runc.toml"
    # containerd itself merges the drop-in (config dump reads, starts nothing).
    config = tmp_path / "config.toml"
    config.write_text(f'version = 2\nroot = "{tmp_path}/root"\nstate = "{tmp_path}/state"\n'
                      f'imports = ["{drop_in}"]\n[grpc]\n  address = "{tmp_path}/c.sock"\n')
    dump = subprocess.run(["containerd", "--config", str(config), "config", "dump"], capture_output=True,
                          text=True, timeout=30, check=True).stdout
    merged = tomllib.loads(dump)
    runtime = merged["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crust-runc"]
    assert runtime["runtime_type"] == "io.containerd.runc.v2"
    binary = runtime["options"]["BinaryName"]
    assert binary == "/usr/local/bin/crust-runc"   # the front end, as docs/install-node.md builds it
    crio = tomllib.loads((deploy / "crio" / "crust-runc.conf").read_text())["crio"]["runtime"]["runtimes"]
    assert crio["crust-runc"]["runtime_path"] == binary and crio["crust-runc"]["runtime_type"] == "oci"
    runtime_class = yaml.safe_load((deploy / "kubernetes" / "runtimeclass-crust-runc.yaml").read_text())
    validate(runtime_class)
    assert runtime_class["metadata"]["name"] == runtime_class["handler"] == "crust-runc"
    # The runtime's own file is read as the runtime reads it.
    values = settings({"CRUST_OCI_RUNTIME_CONFIG": str(deploy / "oci-runtime.json")})
    assert values["handlerEndpoint"] == "unix:///run/crust/handler.sock" and values["runc"] == "/usr/sbin/runc"
    # ... and as the front end reads it: simply, so a call crust has no work
    # in goes straight to the runc it names.
    done = subprocess.run([str(OCI_RUNTIME), "--version"], capture_output=True, text=True, timeout=30,
                          env={"CRUST_OCI_RUNTIME_CONFIG": str(deploy / "oci-runtime.json"), "PATH": "/nonexistent"})
    assert done.returncode == 0 and done.stdout.startswith("runc version"), (done.stdout, done.stderr)
    (tmp_path / "bad.json").write_text('{"handlerEndpont": "x"}')
    with pytest.raises(Exception, match="unknown key"):
        settings({"CRUST_OCI_RUNTIME_CONFIG": str(tmp_path / "bad.json")})
