"""What the tests of crust's OCI runtime and its front end crust-runc share
(tests/integration/test_cri_oci_runtime.py, test_cri_runc_front_end.py):
running the runtime on a bundle as runc's callers do, the error it left in
runc's log, and a bundle whose config mounts given paths."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from crust.kubelet import image as images
from tests.harness.cri import OCI_RUNTIME


def _runtime(bundle: Path, log: Path, state: Path, runc: str = "/bin/false", handler: str = "",
             runc_root: Path | None = None, container_id: str = "hostile",
             runtime: Path = OCI_RUNTIME) -> subprocess.CompletedProcess:
    """crust's runtime's `create` as containerd's runc shim runs it (JSON
    log): crust-runc, the front end, unless another runtime is named."""
    env = {**os.environ, "CRUST_OCI_RUNTIME_CONFIG": str(state / "no-such-config.json"), "CRUST_RUNC": runc,
           "CRUST_OCI_RUNTIME_STATE": str(state), "CRUST_HANDLER_ENDPOINT": handler or f"unix://{state}/none.sock"}
    root = ["--root", str(runc_root)] if runc_root else []
    # Output to a file: a container that runc made would hold a pipe open.
    with open(log.with_suffix(".out"), "w+") as out:
        done = subprocess.run([str(runtime), *root, "--log", str(log), "--log-format", "json", "create",
                               "--bundle", str(bundle), "--pid-file", str(bundle / "init.pid"), container_id],
                              stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=120, env=env)
        out.seek(0)
        done.stderr = out.read()
    return done


def _last_error(log: Path) -> str:
    """The message of the last error line of runc's JSON log (what the shim reports)."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    errors = [line["msg"] for line in lines if line.get("level") == "error"]
    assert errors, f"no error line in {log}: {lines}"
    return errors[-1]


def _runc_bundle(path: Path, mounts: list[dict], sandbox_id: str) -> Path:
    """A bundle runc runs: `runc spec`'s defaults, a busybox root, the mounts added."""
    (path / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy2(images.find_busybox(), path / "rootfs" / "bin" / "busybox")
    subprocess.run(["runc", "spec"], cwd=path, check=True)
    spec = json.loads((path / "config.json").read_text())
    spec["process"].update(terminal=False, args=["/bin/busybox", "sleep", "600"])
    spec["mounts"] += mounts
    spec["annotations"] = {"io.kubernetes.cri.sandbox-id": sandbox_id, "io.kubernetes.cri.container-type": "container"}
    (path / "config.json").write_text(json.dumps(spec))
    return path
