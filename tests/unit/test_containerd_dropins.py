"""deploy/containerd: the drop-ins for each containerd configuration format
parse, carry the version their containerd takes, and put both of crust's
runtimes where that containerd's CRI plugin reads them, with the same
settings in every format and the names the RuntimeClasses use.

- format 2 (containerd 1.6, 1.7): plugins."io.containerd.grpc.v1.cri".containerd.runtimes.<name>
- format 3 (2.0 to 2.2) and 4 (2.3+): plugins."io.containerd.cri.v1.runtime".containerd.runtimes.<name>,
  with `sandboxer = "podsandbox"` (a pause container per pod); a drop-in's
  version must not be above the root file's, so each format has its files.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CONTAINERD = REPO / "deploy" / "containerd"
FORMATS = {2: CONTAINERD, 3: CONTAINERD / "version3", 4: CONTAINERD / "version4"}
CRI_PLUGIN = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime", 4: "io.containerd.cri.v1.runtime"}
# The keys of a runtime in containerd 2.x's CRI configuration (its Runtime
# struct); containerd warns of any other.
RUNTIME_KEYS = {"runtime_type", "runtime_path", "pod_annotations", "container_annotations", "options",
                "privileged_without_host_devices", "privileged_without_host_devices_all_devices_allowed",
                "cgroup_writable", "base_runtime_spec", "cni_conf_dir", "cni_max_conf_num", "snapshotter",
                "sandboxer", "io_type"}
EXPECTED = {
    "crust": ("io.containerd.crust.v2", {"ConfigPath": "/etc/crust/containerd-shim-crust.toml"}),
    "crust-runc": ("io.containerd.runc.v2", {"BinaryName": "/usr/local/bin/crust-runc"}),
}
FILES = {"crust": "crust.toml", "crust-runc": "crust-runc.toml"}


def runtime_classes() -> set[tuple[str, str]]:
    """(RuntimeClass name, its CRI handler) of every class the repository ships."""
    found = set()
    for path in (REPO / "deploy" / "kubernetes").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "RuntimeClass":
                found.add((doc["metadata"]["name"], doc["handler"]))
    return found


@pytest.mark.parametrize("version", sorted(FORMATS))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_dropin_is_what_its_containerd_reads(version, name):
    config = tomllib.loads((FORMATS[version] / FILES[name]).read_text())
    assert config["version"] == version
    assert set(config) == {"version", "plugins"}
    assert set(config["plugins"]) == {CRI_PLUGIN[version]}
    runtimes = config["plugins"][CRI_PLUGIN[version]]["containerd"]["runtimes"]
    assert set(runtimes) == {name}
    runtime = runtimes[name]
    runtime_type, options = EXPECTED[name]
    assert runtime["runtime_type"] == runtime_type and runtime["options"] == options
    if version >= 3:
        assert runtime["sandboxer"] == "podsandbox"
        assert set(runtime) <= RUNTIME_KEYS, set(runtime) - RUNTIME_KEYS
    else:
        assert "sandboxer" not in runtime  # containerd 1.x has no such key


def test_the_runtime_classes_name_the_dropins_runtimes():
    """crust's RuntimeClasses name these runtimes (the kata overlay points
    crust-microvm at Kata's own runtime instead)."""
    classes = runtime_classes()
    assert {("crust-microvm", "crust"), ("crust-runc", "crust-runc")} <= classes
    assert {h for _, h in classes} <= set(EXPECTED) | {"kata"}


def test_no_other_toml_hides_in_deploy_containerd():
    """A file added for one format without the others fails here."""
    names = {version: sorted(p.name for p in d.glob("*.toml") if p.name in FILES.values())
             for version, d in FORMATS.items()}
    assert all(found == sorted(FILES.values()) for found in names.values()), names
    assert sorted(p.name for p in CONTAINERD.glob("*.toml")) == \
        sorted([*FILES.values(), "containerd-shim-crust.toml"])
    assert all(sorted(p.name for p in FORMATS[v].iterdir()) == sorted(FILES.values()) for v in (3, 4))
