"""`crust demo --cri crio`: the pod started by a private CRI-O
(crust.kubelet.crio) in containerd's place. CRI-O pulls what it runs: the
busybox image and a pause image whose /pause exits on SIGTERM (CRI-O stops
an infra container gracefully) are pushed into a local registry
(crust.kubelet.registry, Debian's docker-registry) that stands in for
`localhost`. crust-runc is an OCI handler (runtime_type "oci", conmon in
front, its settings in the handler's monitor_env); with --runtime kata the
handler is crust's shim v2 (runtime_type "vm"), which CRI-O gives no
environment: the microVM handler's endpoint reaches it in the settings
file the handler's runtime_config_path names, as on a node
(deploy/crio/crust-microvm.conf).

CRI-O is not part of crust: `crio` and `pinns` on PATH, or named by $CRIO
and $PINNS."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from crust.demo.steps import StepFailed
from crust.kubelet import registry as local_registry
from crust.kubelet.crio import Crio, CrioError
from crust.kubelet.crio import available as crio_available
from crust.kubelet.image import Image

# /tmp, not the temporary directory a caller names: its path must be short.
SHORT_ROOT = Path("/tmp")


def short_directory(directory: Path) -> Path:
    """Where the CRI-O of the demo whose CRI-O directory is `directory`
    keeps its own: a short path (CRI-O dials each container's attach
    socket by a path below it, Crio.check_paths), named after `directory`."""
    return SHORT_ROOT / f"crust-crio-{hashlib.sha256(str(directory).encode()).hexdigest()[:12]}"


def locate() -> tuple[str, str]:
    """crio and pinns: $CRIO and $PINNS, else on PATH."""
    found = []
    for name, variable in (("crio", "CRIO"), ("pinns", "PINNS")):
        path = os.environ.get(variable) or shutil.which(name)
        if not path:
            raise StepFailed(f"{name} is not on PATH and ${variable} names none (CRI-O is not part of crust: "
                             "build it from cri-o/cri-o, or name yours)")
        found.append(path)
    return found[0], found[1]


class DemoCrio:
    """A private CRI-O and the registry it pulls from, started and closed
    together; what the demo needs of a CRI daemon (endpoint, cgroup_root,
    restart, close) is CRI-O's."""

    def __init__(self, directory: Path, image: Image, runtimes: dict[str, str], vm_runtimes: dict[str, str],
                 env: dict[str, str], vm_runtime_settings: dict[str, dict] | None = None):
        self.directory = directory
        self.image = image
        self.runtimes, self.vm_runtimes, self.env = runtimes, vm_runtimes, env
        self.vm_runtime_settings = vm_runtime_settings or {}
        self.registry = local_registry.LocalRegistry(directory / "registry")
        self.crio: Crio | None = None
        self.short: Path | None = None

    def start(self) -> DemoCrio:
        binary, pinns = locate()
        problem = crio_available(binary, pinns) or local_registry.available()
        if problem:
            raise StepFailed(problem)
        try:
            self.registry.start()
            pause = local_registry.push_busybox_and_pause(self.registry, self.image)
            self.short = short_directory(self.directory)
            self.crio = Crio(self.short, Path(binary), Path(pinns), pause_image=pause,
                             runtimes=self.runtimes, vm_runtimes=self.vm_runtimes, env=self.env,
                             vm_runtime_settings=self.vm_runtime_settings, mirrors={"localhost": self.registry.url})
            self.crio.start()
        except (CrioError, local_registry.RegistryError) as exc:
            raise StepFailed(str(exc)) from None
        return self

    @property
    def endpoint(self) -> str:
        return self.crio.endpoint

    @property
    def cgroup_root(self) -> str:
        return self.crio.cgroup_root

    def restart(self) -> None:
        self.crio.restart()

    def close(self) -> list[str]:
        """What had to be cleaned up by force (crust.kubelet.crio.Crio.close),
        and what of CRI-O's was still there outside its directory after."""
        forced = []
        if self.crio is not None:
            forced = self.crio.close() + [f"left outside its directory: {left}" for left in sorted(self.crio.left_outside)]
        self.crio = None
        self.registry.close()
        if self.short is not None:
            shutil.rmtree(self.short, ignore_errors=True)
            self.short = None
        return forced
