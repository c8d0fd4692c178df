"""`crust demo` (crust.demo.csi)."""

from crust.demo.csi import NodeProcess, _kill_sandboxes, run_demo

__all__ = ["NodeProcess", "_kill_sandboxes", "run_demo"]
