"""`crust node` run as the demo runs it, on a config written for the test's
root: the supervisor of driver, shim, proxy and handler, its status file
read as the node writes it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from crust.demo.node import NodeProcess
from crust.node.config import NodeConfig


def write_config(root: Path, **extra) -> Path:
    """A node config on root's directories (a mount-namespace handler,
    deferral on the StorageClass parameter); extra's keys replace them."""
    config = {
        "nodeId": "node-a", "kubeletRoot": str(root / "kubelet"), "runDir": str(root / "run"),
        "stateDir": str(root / "state"), "driver": {"capacity": "10Gi"},
        "proxy": {"policy": {"deferral": {"storageClassParameters": {"crust.dev/defer": "true"},
                                          "fsGroupFromPod": False}}},
        "handler": {"runtime": "mountns"},
        **extra,
    }
    path = root / "node.yaml"
    path.write_text(json.dumps(config))
    return path


class NodeRun:
    """`crust node` as the demo runs it (crust.demo.node.NodeProcess)."""

    def __init__(self, root: Path, config: Path):
        self.root = root
        self.config = NodeConfig.load(config)
        (root / "kubelet" / "plugins_registry").mkdir(parents=True, exist_ok=True)
        self.out = root / "node.out"
        self.process = NodeProcess(root, config, ready_seconds=60)

    @property
    def proc(self) -> subprocess.Popen:
        return self.process.proc

    def wait_serving(self) -> str:
        self.process.start()
        return self.out.read_text()

    def status(self) -> dict:
        return json.loads(self.config.status_file.read_text())

    def child(self, name: str) -> dict:
        return next(c for c in self.status()["children"] if c["name"] == name)

    def stop(self) -> int | None:
        return self.process.stop()
