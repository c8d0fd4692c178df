"""Format versions: every record and mountInfo.json names the format it was
written in; a crust reads its own and every older one, and refuses a newer
one, naming the file and both versions, before it acts on anything: here
the daemons that refuse to start; the formats themselves are tested in
tests/unit/test_common_formats.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from crust.common.formats import FORMAT_KEY
from crust.csi_shim.records import ShimVolumeRecord
from crust.driver.records import NodeVolumeRecord
from crust.proxy.records import Decision, DeferredVolume
from crust.runtime_handler.handler import SandboxRecord
from crust.sys import mount as sysmount

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


# -- the daemons refuse at start ---------------------------------------------------------------------


def _newer(model: type[BaseModel]) -> bytes:
    return json.dumps({FORMAT_KEY: 99, "note": f"a {model.__name__} from a newer crust"}).encode()


def _daemon(kind: str, root: Path) -> tuple[list[str], Path, type[BaseModel]]:
    """(argv, where a record of its goes, its model) for each daemon."""
    sock = f"unix://{root}/{kind}.sock"
    if kind == "driver":
        return (["driver", "--endpoint", sock, "--node-id", "n1", "--data-dir", str(root / "data")],
                root / "data" / "node" / "n1" / "volumes" / "vol-1.json", NodeVolumeRecord)
    if kind == "shim":
        return (["shim", "--endpoint", sock, "--backend-endpoint", f"unix://{root}/none.sock",
                 "--proxy-endpoint", f"unix://{root}/none2.sock", "--state-dir", str(root / "shim")],
                root / "shim" / "volumes" / "k.json", ShimVolumeRecord)
    if kind == "proxy":
        return (["proxy", "--csi-endpoint", sock, "--plugin-endpoint", f"unix://{root}/none.sock",
                 "--runtime-endpoint", f"unix://{root}/runtime/proxy.sock", "--volumes-dir", str(root / "volumes"),
                 "--state-dir", str(root / "proxy"), "--kubelet-root", str(root / "kubelet")],
                root / "proxy" / "decisions" / "d.json", Decision)
    return (["handler", "--endpoint", sock, "--proxy-endpoint", f"unix://{root}/runtime/proxy.sock",
             "--volumes-dir", str(root / "volumes"), "--state-dir", str(root / "handler")],
            root / "handler" / "sandboxes" / "pod-1.json", SandboxRecord)


@pytest.mark.parametrize("kind", ["driver", "shim", "proxy", "handler"])
def test_a_daemon_refuses_to_start_over_a_record_of_a_newer_format(tmp_path, kind):
    argv, record, model = _daemon(kind, tmp_path)
    record.parent.mkdir(parents=True, mode=0o700)
    record.write_bytes(_newer(model))
    result = subprocess.run([sys.executable, "-m", "crust", *argv, "--log-format", "text"], capture_output=True,
                            text=True, timeout=60, env=ENV)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    message = [line for line in result.stderr.splitlines() if line.startswith(f"crust {kind}: ")]
    assert message, result.stderr
    assert str(record) in message[0] and "format version 99" in message[0] and "reads versions 1 to 1" in message[0]
    assert record.read_bytes() == _newer(model)  # untouched
    assert not (tmp_path / f"{kind}.sock").exists()  # nothing served


def test_crust_node_over_a_newer_proxy_record_stops_with_the_proxys_message(root):
    """What a rollback shows when a newer crust changed a format: the node
    does not come up, and its log says which file, which versions."""
    from tests.harness.node_run import write_config

    config = write_config(root.path)
    record = root.path / "state" / "proxy" / "volumes" / ("0" * 64 + ".json")
    record.parent.mkdir(parents=True, mode=0o700)
    record.write_bytes(_newer(DeferredVolume))
    (root.path / "kubelet" / "plugins_registry").mkdir(parents=True)
    result = subprocess.run([sys.executable, "-m", "crust", "node", "--config", str(config)], capture_output=True,
                            text=True, timeout=90, env=ENV)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "every component is serving" not in result.stdout
    assert f"crust proxy: {record}: DeferredVolume record format version 99 was written by a newer crust" \
        in result.stderr, result.stderr[-3000:]
    assert record.read_bytes() == _newer(DeferredVolume)
    prefix = str(root.path) + "/"
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []
