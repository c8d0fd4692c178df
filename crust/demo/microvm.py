"""`crust demo --runtime kata` (and `--cri --runtime kata`): what changes
when the pod's sandbox is a microVM of crust's microVM handler. The story
is the same (crust.demo.csi); the node runs the microVM handler, the pod's
process prints to the guest's console, the guest kernel grows any file
system online, and under CRI containerd runs crust's shim v2, a microVM
per pod."""

from __future__ import annotations

import json
from pathlib import Path

# containerd's runtime type of crust's shim (containerd-shim-crust-v2).
SHIM_RUNTIME_TYPE = "io.containerd.crust.v2"


def handler_config(run_dir: Path) -> dict:
    """The node config's handler section: the microVM handler, with Kata's
    direct-volume directory under the demo's root."""
    return {"runtime": "kata", "kata": {"kataDir": str(run_dir / "kata-direct-volumes")}}


def shim_containerd(directory: Path, sandbox_image: str, runtime_handler: str, env: dict[str, str]):
    """A private containerd whose runtime handler is crust's shim v2 in
    front of the node's microVM handler (its endpoint in `env`); and what
    that is, for the step's line."""
    from crust.kubelet.containerd import Containerd

    how = f"containerd-shim-crust-v2 ({SHIM_RUNTIME_TYPE}) in front of the microVM handler"
    containerd = Containerd(directory, sandbox_image=sandbox_image, shim_runtimes={runtime_handler: SHIM_RUNTIME_TYPE},
                            env=env)
    return containerd, how


def accelerator(node_log: Path) -> str:
    """The microVM handler logs the accelerator it chose, and why."""
    for line in node_log.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == "accelerator":
            return f"; microVMs run with {entry.get('accel')} ({entry.get('reason')})"
    return ""
