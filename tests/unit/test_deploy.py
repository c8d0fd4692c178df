"""The cluster install in deploy/kubernetes: every rendered manifest validates
against the Kubernetes API schemas of a recent release (kubernetes-validate
ships them, nothing is fetched), a broken one is caught, the DaemonSet passes
crust exactly the flags and configuration it accepts, the RBAC grants
exactly what the sidecars document and crust's own code calls, and the base
and each overlay render a RuntimeClass only where its runtime is served."""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from crust.cli import build_parser
from crust.driver.config import DRIVER_NAME
from crust.node.config import NodeConfig, Runtime
from crust.node.supervisor import child_argvs
from crust.proxy.kube import API_CALLS
from tests.harness.kube_schema import validate
from tests.harness.kustomize import render

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in (BASE / "overlays").glob("*/kustomization.yaml"))


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = by_kind(docs, kind)
    return doc


def container(docs: list[dict], name: str) -> dict:
    pod = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


@pytest.fixture(scope="module", params=[BASE] + OVERLAYS, ids=lambda p: p.name)
def rendered(request) -> list[dict]:
    return render(request.param)


def test_every_manifest_validates(rendered):
    kinds = sorted(d["kind"] for d in rendered)
    # The base ships no RuntimeClass (it runs no handler); each overlay one.
    runtime_classes = ["RuntimeClass"] if by_kind(rendered, "RuntimeClass") else []
    assert kinds == sorted(["Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                            "RoleBinding", "CSIDriver", "ConfigMap", "DaemonSet", "StorageClass", "StorageClass",
                            "VolumeSnapshotClass", *runtime_classes])
    for doc in rendered:
        validate(doc)
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] in
            ("ServiceAccount", "Role", "RoleBinding", "ConfigMap", "DaemonSet")} == {"crust-system"}


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type", "misplaced field", "missing field", "crd enum"])
def test_a_broken_manifest_is_caught(breakage):
    docs = render(BASE)
    daemonset = copy.deepcopy(one(docs, "DaemonSet"))
    pod = daemonset["spec"]["template"]["spec"]
    if breakage == "unknown field":
        pod["containers"][0]["imagePolicy"] = "Always"
        target = daemonset
    elif breakage == "wrong type":
        pod["containers"][0]["ports"][0]["containerPort"] = "ninety"
        target = daemonset
    elif breakage == "misplaced field":
        target = copy.deepcopy(one(docs, "CSIDriver"))
        target["fsGroupPolicy"] = target["spec"].pop("fsGroupPolicy")
    elif breakage == "missing field":
        del pod["containers"][0]["name"]
        target = daemonset
    else:
        target = copy.deepcopy(one(docs, "VolumeSnapshotClass"))
        target["deletionPolicy"] = "Keep"
    with pytest.raises((kubernetes_validate.ValidationError, ValueError)):
        validate(target)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def test_the_daemonset_passes_what_crust_accepts(rendered):
    node = container(rendered, "crust-node")
    env = {e["name"]: "node-a" for e in node["env"]}
    assert env.keys() == {"NODE_NAME"}
    args = [_expand(a, env) for a in node["args"]]
    parsed = build_parser().parse_args(args)  # exits on a flag `crust node` does not have
    assert (parsed.command, str(parsed.config), parsed.node_id) == ("node", "/etc/crust/node.yaml", "node-a")

    # The ConfigMap is a valid node.yaml for every node, and every flag the
    # supervisor derives from it is one its child accepts.
    config_map = one(rendered, "ConfigMap")
    mounted = next(m for m in node["volumeMounts"] if m["name"] == "config")
    assert Path(mounted["mountPath"]) / "node.yaml" == parsed.config
    path = Path("/tmp") / "crust-deploy-node.yaml"
    try:
        path.write_text(config_map["data"]["node.yaml"])
        config = NodeConfig.load(path, node_id="node-a")
    finally:
        path.unlink(missing_ok=True)
    for _, argv, _ in child_argvs(config, config.supervisor_dir / "policy.json"):
        build_parser().parse_args(argv)
    assert config.driver.distributed and config.driver.mode == "all"
    assert config.registration_dir == Path("/var/lib/kubelet/plugins_registry")

    # Every socket and directory crust uses is a host path the pod mounts.
    pod = one(rendered, "DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m for m in node["volumeMounts"]}
    for needed in (config.kubelet_root, config.run_dir, config.state_dir, Path("/dev")):
        assert str(needed) in mounts and host[mounts[str(needed)]["name"]] == str(needed)
    assert mounts[str(config.kubelet_root)]["mountPropagation"] == "Bidirectional"
    # The shim's private mounts under the state dir outlive a container restart.
    assert mounts[str(config.state_dir)]["mountPropagation"] == "Bidirectional"
    assert config.kubelet_csi_socket.is_relative_to(config.kubelet_root)
    if config.proxy.kata_dir is not None:
        assert any(config.proxy.kata_dir.is_relative_to(m) for m in mounts)
    if config.handler.runtime is Runtime.KATA:
        assert not any(config.handler.kata.cache.is_relative_to(m) for m in mounts), \
            "a host path would hide the guest image the -microvm image carries"
        assert node["image"].endswith("-microvm"), "the microVM handler needs the image with QEMU"
    else:
        assert not node["image"].endswith("-microvm")

    # The sidecars reach the same CSI socket through socket-dir.
    assert host["socket-dir"] == str(config.kubelet_csi_socket.parent)
    for sidecar in ("csi-provisioner", "csi-resizer", "csi-snapshotter", "liveness-probe"):
        c = container(rendered, sidecar)
        assert "--csi-address=/csi/csi.sock" in c["args"]
        assert {"name": "socket-dir", "mountPath": "/csi"} in c["volumeMounts"]
        assert c["image"].startswith("registry.k8s.io/sig-storage/")
    provisioner = container(rendered, "csi-provisioner")
    assert {"--node-deployment=true", "--enable-capacity=true", "--strict-topology=true"} <= set(provisioner["args"])
    assert {e["name"] for e in provisioner["env"]} == {"NODE_NAME", "NAMESPACE", "POD_NAME"}

    # Ports: the liveness probe's and each daemon's metrics port.
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    probe = container(rendered, "liveness-probe")
    assert f"--http-endpoint=:{ports['healthz']}" in probe["args"]
    assert node["livenessProbe"]["httpGet"]["port"] == "healthz"
    assert config.metrics_address == "0.0.0.0"
    assert {ports["metrics-driver"], ports["metrics-shim"], ports["metrics-proxy"]} == \
        {config.driver.metrics_port, config.shim.metrics_port, config.proxy.metrics_port}


def test_the_cluster_objects_agree_with_the_driver(rendered):
    csidriver = one(rendered, "CSIDriver")
    assert csidriver["metadata"]["name"] == DRIVER_NAME
    spec = csidriver["spec"]
    assert spec["podInfoOnMount"] and spec["storageCapacity"] and spec["fsGroupPolicy"] == "File"
    assert spec["volumeLifecycleModes"] == ["Persistent"]
    # The distributed driver advertises no ControllerPublishVolume.
    assert spec["attachRequired"] is False
    classes = {d["metadata"]["name"]: d for d in by_kind(rendered, "StorageClass")}
    assert set(classes) == {"crust", "crust-deferred"}
    for storage_class in classes.values():
        assert storage_class["provisioner"] == DRIVER_NAME
        assert storage_class["volumeBindingMode"] == "WaitForFirstConsumer"
    assert one(rendered, "VolumeSnapshotClass")["driver"] == DRIVER_NAME
    # The proxy defers every volume of crust-deferred (its parameter), a
    # volume of crust only for a pod of a listed runtime class.
    config = yaml.safe_load(one(rendered, "ConfigMap")["data"]["node.yaml"])
    deferral = config["proxy"]["policy"]["deferral"]

    def deferred_by_parameter(storage_class: dict) -> bool:
        return any(storage_class["parameters"].get(k) == v for k, v in deferral["storageClassParameters"].items())

    assert deferred_by_parameter(classes["crust-deferred"]) and not deferred_by_parameter(classes["crust"])
    for runtime_class in by_kind(rendered, "RuntimeClass"):
        assert runtime_class["metadata"]["name"] in deferral["runtimeClasses"]


# What each sidecar's deploy/kubernetes RBAC grants for the features used
# here (as of the versions in daemonset.yaml), minus rules their comments
# mark as needed only for features crust does not use (secrets,
# volumeattachments without an attach step, referencegrants).
PROVISIONER = {
    ("", "persistentvolumes"): {"get", "list", "watch", "create", "patch", "delete"},
    ("", "persistentvolumeclaims"): {"get", "list", "watch", "update"},
    ("storage.k8s.io", "storageclasses"): {"get", "list", "watch"},
    ("", "events"): {"list", "watch", "create", "update", "patch"},
    ("snapshot.storage.k8s.io", "volumesnapshots"): {"get", "list", "watch", "update"},
    ("snapshot.storage.k8s.io", "volumesnapshotcontents"): {"get", "list"},
    ("storage.k8s.io", "csinodes"): {"get", "list", "watch"},
    ("", "nodes"): {"get", "list", "watch"},
}
PROVISIONER_NAMESPACED = {
    ("storage.k8s.io", "csistoragecapacities"): {"get", "list", "watch", "create", "update", "patch", "delete"},
    ("", "pods"): {"get"},  # the owner of CSIStorageCapacity objects (--capacity-ownerref-level=0)
}
RESIZER = {
    ("", "persistentvolumes"): {"get", "list", "watch", "patch"},
    ("", "persistentvolumeclaims"): {"get", "list", "watch"},
    ("", "pods"): {"get", "list", "watch"},
    ("", "persistentvolumeclaims/status"): {"patch"},
    ("", "events"): {"list", "watch", "create", "update", "patch"},
    ("storage.k8s.io", "volumeattributesclasses"): {"get", "list", "watch"},
}
LEADER_ELECTION = {("coordination.k8s.io", "leases"): {"get", "watch", "list", "delete", "update", "create"}}
SNAPSHOTTER = {
    ("", "events"): {"list", "watch", "create", "update", "patch"},
    ("snapshot.storage.k8s.io", "volumesnapshotclasses"): {"get", "list", "watch"},
    ("snapshot.storage.k8s.io", "volumesnapshotcontents"): {"get", "list", "watch", "update", "patch"},
    ("snapshot.storage.k8s.io", "volumesnapshotcontents/status"): {"update", "patch"},
    ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotclasses"): {"get", "list", "watch"},
    ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents"): {"get", "list", "watch", "update", "patch"},
    ("groupsnapshot.storage.k8s.io", "volumegroupsnapshotcontents/status"): {"update", "patch"},
}
# The Kubernetes API requests in crust's own code, and the rule each needs.
CRUST_CALLS = {("GET", "/api/v1/namespaces/{namespace}/pods/{name}"): (("", "pods"), "get")}


def _grants(rules: list[dict]) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert not rule.get("resourceNames") and "*" not in rule["verbs"] + rule["resources"]
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def _union(*parts: dict) -> dict[tuple[str, str], set[str]]:
    total: dict[tuple[str, str], set[str]] = {}
    for part in parts:
        for key, verbs in part.items():
            total.setdefault(key, set()).update(verbs)
    return total


def test_rbac_grants_exactly_what_is_called(rendered):
    assert set(API_CALLS) == set(CRUST_CALLS), "crust calls the Kubernetes API anew: give the call its rule"
    for path in (REPO / "crust").rglob("*.py"):
        if "api" in path.parts or path.name == "kube.py":
            continue
        assert not re.search(r"[\"']/apis?/", path.read_text()), f"{path} speaks to an API server outside kube.py"
    crust = {}
    for key, verb in CRUST_CALLS.values():
        crust.setdefault(key, set()).add(verb)
    cluster = _grants(one(rendered, "ClusterRole")["rules"])
    assert cluster == _union(PROVISIONER, RESIZER, SNAPSHOTTER, crust)
    namespaced = _grants(one(rendered, "Role")["rules"])
    assert _union(namespaced, {("", "pods"): {"get"}}) == _union(PROVISIONER_NAMESPACED, LEADER_ELECTION)
    # Bound to the pod's account, and nothing else is.
    account = one(rendered, "ServiceAccount")["metadata"]["name"]
    assert one(rendered, "DaemonSet")["spec"]["template"]["spec"]["serviceAccountName"] == account
    for binding in by_kind(rendered, "ClusterRoleBinding") + by_kind(rendered, "RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "crust-system"}]
    # The resizer elects a leader: it needs the lease rule and the flag.
    assert "--leader-election=true" in container(rendered, "csi-resizer")["args"]


def test_the_install_doc_applies_what_is_here():
    doc = (REPO / "docs" / "install.md").read_text()
    commands = [shlex.split(line.strip()[2:]) for line in doc.splitlines() if line.strip().startswith("$ kubectl")]
    applied = [c[c.index("-k") + 1] for c in commands if "-k" in c]
    assert "deploy/kubernetes" in applied
    for target in applied:
        assert (REPO / target / "kustomization.yaml").exists(), target


# -- each rendering installs only runtimes that are served ------------------------------------------


def host_handler_unit() -> dict:
    """What deploy/systemd/crust-kata-handler.service (the microVM handler on
    the host, as overlays/host-handler requires) serves and dials."""
    unit = (REPO / "deploy" / "systemd" / "crust-kata-handler.service").read_text()
    (exec_start,) = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart=")]
    argv = shlex.split(exec_start)
    assert Path(argv[0]).name == "crust"
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.kata_command) == ("kata", "handler")
    return {"endpoint": args.endpoint, "proxy": args.proxy_endpoint, "volumes": Path(args.volumes_dir)}


def shim_endpoint() -> str:
    """The socket containerd's runtime `crust` (containerd-shim-crust-v2)
    dials, as deploy/containerd configures it."""
    import tomllib

    from crust.containerd_shim.options import DEFAULT_HANDLER_ENDPOINT, NODE, shim_group

    drop_in = tomllib.loads((REPO / "deploy" / "containerd" / "crust.toml").read_text())
    runtime = drop_in["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crust"]
    settings = Path("/etc/crust/containerd-shim-crust.toml")
    assert Path(runtime["options"]["ConfigPath"]) == settings
    shipped = tomllib.loads((REPO / "deploy" / "containerd" / settings.name).read_text())
    endpoint = shipped.get("handler_endpoint", DEFAULT_HANDLER_ENDPOINT)
    assert endpoint == DEFAULT_HANDLER_ENDPOINT  # the shipped file and the shim agree without it too
    assert shim_group(shipped) == shim_group({}) == NODE   # so do they on which pods share a shim
    return endpoint


def served_runtimes(rendered: list[dict]) -> dict[str, str]:
    """CRI handler -> who serves it on every node of this rendering, from
    what the node pod runs and mounts and what the host units serve."""
    node = container(rendered, "crust-node")
    pod = one(rendered, "DaemonSet")["spec"]["template"]["spec"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounted = {m["mountPath"]: host.get(m["name"]) for m in node["volumeMounts"]}
    path = Path("/tmp") / f"crust-deploy-served-{os.getpid()}.yaml"
    try:
        path.write_text(one(rendered, "ConfigMap")["data"]["node.yaml"])
        config = NodeConfig.load(path, node_id="node-a")
    finally:
        path.unlink(missing_ok=True)

    def on_host(p: Path) -> bool:
        """p is the same path in the pod and on the host."""
        return any(p.is_relative_to(m) and host_path == m for m, host_path in mounted.items())

    served = {}
    # containerd's `crust`: the shim dials one socket, whose handler must
    # also see containerd's bundle directories as they are.
    endpoint = shim_endpoint()
    if config.handler.runtime is Runtime.KATA:
        in_pod = f"unix://{config.handler_socket}" == endpoint and on_host(Path("/run/containerd"))
        if in_pod:
            served["crust"] = "the node pod's microVM handler"
    else:
        unit = host_handler_unit()
        if unit["endpoint"] == endpoint and unit["proxy"] == f"unix://{config.runtime_socket}" \
                and unit["volumes"] == config.volumes_dir and on_host(config.runtime_socket.parent) \
                and on_host(config.volumes_dir):
            served["crust"] = "deploy/systemd/crust-kata-handler.service on the host"
    # Kata's own runtime: it reads the proxy's mirror at Kata's fixed root.
    from crust.kata.sandbox.direct_volume import DEFAULT_ROOT as KATA_ROOT

    if config.proxy.kata_dir == KATA_ROOT and on_host(KATA_ROOT):
        served["kata"] = "Kata Containers, from the proxy's mirror"
    return served


def test_each_rendering_installs_only_runtimes_it_serves(rendered):
    """A RuntimeClass is there only where its CRI handler is served: the
    microVM runtime `crust` by the handler on the host the shim dials (the
    pod's own handler is not reachable: it sees no containerd bundle), Kata
    from the mirror. The base, with no handler, has none."""
    classes = by_kind(rendered, "RuntimeClass")
    served = served_runtimes(rendered)
    for runtime_class in classes:
        handler = runtime_class["handler"]
        assert handler in served, f"RuntimeClass {runtime_class['metadata']['name']}: nothing serves {handler!r}"
        assert runtime_class["scheduling"]["nodeSelector"] == {"crust.dev/microvm": "true"}
    names = sorted(d["metadata"]["name"] for d in classes)
    assert names in ([], ["crust-microvm"])
    config = yaml.safe_load(one(rendered, "ConfigMap")["data"]["node.yaml"])
    if not classes:
        assert config["handler"]["runtime"] == "none"


def test_the_base_installs_no_runtime_and_each_overlay_one():
    assert not by_kind(render(BASE), "RuntimeClass")
    handlers = {p.name: [d["handler"] for d in by_kind(render(p), "RuntimeClass")] for p in OVERLAYS}
    assert handlers == {"host-handler": ["crust"], "kata": ["kata"]}
    # A pod handler in a rendering with the shim's runtime would be unreachable.
    broken = copy.deepcopy(render(OVERLAYS[0]))
    node_config = one(broken, "ConfigMap")
    node_config["data"]["node.yaml"] = node_config["data"]["node.yaml"].replace("runtime: none", "runtime: kata")
    assert "crust" not in served_runtimes(broken)
