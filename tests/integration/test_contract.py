"""The runtime contract stands alone: a runtime author who takes the handler
library (or writes to the contract package directly) pulls in neither the
proxy, nor the shim, nor the driver."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import crust.contract
import crust.kata
import crust.runtime_handler

FORBIDDEN = ("crust.proxy", "crust.csi_shim", "crust.driver", "crust.node")


def modules_of(package) -> list[str]:
    """The package and every module below it, subpackages' too (a
    `python -m` entry point aside: importing it runs it)."""
    return [package.__name__] + [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
                                 if not m.name.endswith(".__main__")]


def test_handler_library_kata_and_contract_import_no_daemon():
    for package in (crust.contract, crust.runtime_handler, crust.kata):
        for module in modules_of(package):
            # A fresh interpreter per module: what it imports, transitively.
            loaded = subprocess.run(
                [sys.executable, "-c", f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"],
                capture_output=True, text=True, timeout=60, check=True)
            crust_modules = [m for m in json.loads(loaded.stdout) if m.startswith("crust.")]
            bad = [m for m in crust_modules if m.startswith(FORBIDDEN)]
            assert bad == [], f"{module} imports {bad}"
    assert "crust.contract.mountinfo" in modules_of(crust.contract)
    assert "crust.kata.pod.pods" in modules_of(crust.kata)
