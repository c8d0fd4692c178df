"""deploy/node.yaml lists every key of `crust node`'s configuration
(crust.node.config.NodeConfig, down to the deferral policy), and nothing
else, and is a valid configuration; every key is in docs/install-node.md's
table too."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import BaseModel

from crust.node.config import NodeConfig

REPO = Path(__file__).resolve().parents[2]
NODE_YAML = REPO / "deploy" / "node.yaml"


def model_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key path of a model, by the names a file uses (aliases); a
    field whose type is a model is a section, any other a leaf."""
    keys = set()
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= model_keys(annotation, key + ".")
        else:
            keys.add(key)
    return keys


def file_keys(data: dict, sections: set[str], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        path = prefix + key
        if path in sections and isinstance(value, dict):
            keys |= file_keys(value, sections, path + ".")
        else:
            keys.add(path)
    return keys


def sections_of(model: type[BaseModel], prefix: str = "") -> set[str]:
    found = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            key = prefix + (field.alias or name)
            found |= {key} | sections_of(annotation, key + ".")
    return found


def test_node_yaml_lists_every_key_of_the_model_and_no_other():
    data = yaml.safe_load(NODE_YAML.read_text())
    wanted = model_keys(NodeConfig)
    listed = file_keys(data, sections_of(NodeConfig))
    assert not wanted - listed, f"keys deploy/node.yaml does not list: {sorted(wanted - listed)}"
    assert not listed - wanted, f"keys deploy/node.yaml has that the model has not: {sorted(listed - wanted)}"
    assert "proxy.policy.deferral.runtimeClasses" in wanted and "driver.distributed" in wanted


def test_node_yaml_is_a_valid_configuration():
    config = NodeConfig.load(NODE_YAML)
    assert config.node_id == "node-a"
    assert config.kubelet_csi_socket == Path("/var/lib/kubelet/plugins/loop.csi.crust.dev/csi.sock")
    assert config.driver.data_dir == config.state_dir / "driver"


def test_install_node_names_every_key():
    """The table of docs/install-node.md, section 2, names each key (a row
    may name several of one section: `handler.kata.accel`, `memoryMiB`)."""
    doc = (REPO / "docs" / "install-node.md").read_text()
    section = doc[doc.index("## 2. Configure"):doc.index("## 3. Run it")]
    named = set(re.findall(r"`([A-Za-z][\w.]*)`", section))
    missing = []
    for key in model_keys(NodeConfig):
        last = key.rsplit(".", 1)[-1]
        if key not in named and last not in named and not key.startswith("proxy.policy."):
            missing.append(key)
    assert not missing, f"keys docs/install-node.md does not name: {sorted(missing)}"
