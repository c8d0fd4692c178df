"""The upstream conformance suite (csi-sanity) against crust's stacks, and
the upstream tools it needs: what tests/integration/test_conformance.py and
bench/csi/conformance_ratio.py share.

- the upstream programs, none of them part of crust, are found by
  tests/harness/upstream.py (CSI_SANITY, HOSTPATHPLUGIN, ... or PATH);
- the targets csi-sanity talks to, started in a tests/harness/daemons.py Root:
  start_target(), with the flags of docs/conformance.md;
- csi-sanity's command line (sanity_argv()) and what its ginkgo summary
  says (summary_counts(), failed_specs());
- the counts docs/conformance.md states for each run (stated_counts()):
  the doc is the one place they are written, the test reads them there.
"""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from crust.api import csi_pb2
from tests.harness.daemons import CsiProcess, Root

PROJECT = Path(__file__).resolve().parents[2]
CONFORMANCE_DOC = PROJECT / "docs" / "conformance.md"

MIB = 1024**2
GIB = 1024**3
NODE_ID = "n1"


# -- the targets -------------------------------------------------------------------------------------

# Every optional feature of the reference on, with the limits crust runs
# with (200Gi, 8 volumes per node) and the one mutable parameter
# MUTABLE_YAML names, so that it runs the specs crust runs; -v=5 as its own
# deployment runs it.
REFERENCE_FLAGS = ["-enable-attach", "-capacity=fast=200Gi", "-maxvolumespernode=8", "-attach-limit=8",
                   "-enable-controller-modify-volume", "-accepted-mutable-parameter-names=provisioning",
                   "-check-volume-lifecycle", "-enable-snapshot-metadata", "-v=5"]
# docs/conformance.md's crust command lines.
DRIVER_FLAGS = ["--capacity", "200Gi", "--max-volumes-per-node", "8"]
SHIM_FLAGS = ["--no-advertise-deferral"]
MUTABLE_YAML = "provisioning: thick\n"

# What csi-sanity talks to: the reference alone (the benchmark's base), crust's
# three stacks, and crust's shim in front of the reference (a driver crust
# did not write).
TARGETS = {
    "reference": "hostpathplugin",
    "driver": "crust driver",
    "shim": "crust shim -> crust driver",
    "proxy": "crust proxy -> crust shim -> crust driver",
    "shim-hostpath": "crust shim -> hostpathplugin",
}


@dataclass
class HostpathProcess(CsiProcess):
    """The reference driver (csi-driver-host-path's hostpathplugin), with its
    socket and state directory below a Root."""

    root: Path
    binary: str
    extra: list[str] = field(default_factory=list)
    endpoint_name: str = "hostpath.sock"
    proc: subprocess.Popen | None = None
    channel: grpc.Channel | None = None

    @property
    def socket(self) -> Path:
        return self.root / self.endpoint_name

    @property
    def state_dir(self) -> Path:
        return self.root / "hostpath-state"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.endpoint_name}.log"

    def start(self, timeout: float = 20.0) -> "HostpathProcess":
        self._launch("hostpathplugin", [f"-endpoint=unix://{self.socket}", f"-nodeid={NODE_ID}",
                                        f"-statedir={self.state_dir}", *self.extra],
                     lambda: self.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=2).name,
                     timeout, program=(self.binary,))
        return self


def start_target(root: Root, target: str, hostpath: str | Path | None = None,
                 crust_extra: tuple[str, ...] = ()) -> list[CsiProcess]:
    """The target's processes started in root, backend first; csi-sanity
    talks to the last one's socket. root.close() stops them all.
    crust_extra goes to the crust driver and shim (e.g. a file system type)."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; one of {', '.join(TARGETS)}")
    if target in ("reference", "shim-hostpath"):
        if hostpath is None:
            raise ValueError(f"target {target} needs the hostpathplugin binary")
        backend: CsiProcess = HostpathProcess(root=root.path, binary=str(hostpath), extra=list(REFERENCE_FLAGS))
        root.drivers.append(backend)  # stopped by root.close(), after what fronts it
    else:
        backend = root.driver(node_id=NODE_ID, extra=DRIVER_FLAGS + list(crust_extra))
    chain = [backend.start()]
    if target in ("shim", "proxy", "shim-hostpath"):
        chain.append(root.shim(chain[0], extra=SHIM_FLAGS + list(crust_extra)).start())
    if target == "proxy":
        chain.append(root.proxy(chain[1]).start())
    return chain


# -- csi-sanity --------------------------------------------------------------------------------------


def volume_size(target: str) -> int:
    """--csi.testvolumesize: docs/conformance.md's 1 GiB, but 16 MiB for the
    shim in front of the reference: the shim asks every volume of it as a
    raw block volume, which the reference allocates in full and copies in
    full for each snapshot and clone (at 1 GiB one suite takes 60 to 100 s
    there instead of 3)."""
    return 16 * MIB if target == "shim-hostpath" else GIB


def sanity_argv(tool: str | Path, socket: Path, kube: Path, mutable: Path, access: str = "mount",
                size: int = GIB, extra: tuple[str, ...] = ()) -> list[str]:
    """docs/conformance.md's invocation; the mount and staging directories
    lie below the kubelet root kube, where the proxy accepts paths. The
    expansion asked is twice the size."""
    return [str(tool), f"--csi.endpoint=unix://{socket}", f"--csi.mountdir={kube}/mount",
            f"--csi.stagingdir={kube}/staging", f"--csi.testvolumesize={size}",
            f"--csi.testvolumeexpandsize={2 * size}", "--csi.testnodevolumeattachlimit",
            f"--csi.testvolumemutableparameters={mutable}", f"--csi.testvolumeaccesstype={access}",
            "--ginkgo.no-color", *extra]


_SUMMARY = re.compile(r"^(?:SUCCESS!|FAIL!) -- (.+)$", re.M)


def summary_counts(output: str) -> dict[str, int] | None:
    """Ginkgo's last summary line, `SUCCESS! -- 95 Passed | 0 Failed | 1
    Pending | 0 Skipped` (or FAIL!), as {"passed": 95, "failed": 0, ...};
    None when the run printed none (it ended before its specs)."""
    lines = _SUMMARY.findall(output)
    if not lines:
        return None
    return {word.lower(): int(count) for count, word in re.findall(r"(\d+) (\w+)", lines[-1])}


def failed_specs(output: str) -> list[str]:
    """The specs ginkgo lists under "Summarizing N Failure(s):"."""
    _, marker, tail = output.rpartition("\nSummarizing ")
    return re.findall(r"^\s*\[FAIL\] (.+)$", tail, re.M) if marker else []


def skipped_specs(junit: Path) -> list[str]:
    """The names of the specs a `--ginkgo.junit-report` file lists as
    skipped (the summary line only counts them)."""
    if not junit.exists():
        return []
    return [case.get("name", "").removeprefix("[It] ") for case in ET.parse(junit).getroot().iter("testcase")
            if case.get("status") == "skipped"]


# -- the counts docs/conformance.md states ----------------------------------------------------------

COUNTS_MARKER = "<!-- counts: read by tests/integration/test_conformance.py -->"
COUNT_COLUMNS = ("passed", "failed", "pending", "skipped")


def stated_counts(doc: Path = CONFORMANCE_DOC) -> dict[tuple[str, str], dict[str, int]]:
    """The table after COUNTS_MARKER in the doc, by (run, access type):
    {"passed": 95, "failed": 0, "pending": 1, "skipped": 0}. The run is the
    first column's `name` (a key of TARGETS)."""
    text = doc.read_text()
    if COUNTS_MARKER not in text:
        raise ValueError(f"{doc.name} has no line {COUNTS_MARKER}")
    rows = []
    for line in text.split(COUNTS_MARKER, 1)[1].lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, table = rows[0], rows[2:]  # rows[1] is the |---| line
    needed = ("run", "access type", *COUNT_COLUMNS)
    if not set(needed) <= set(header):
        raise ValueError(f"{doc.name}: the counts table's header {header} lacks one of {needed}")
    stated = {}
    for row in table:
        cells = dict(zip(header, row))
        run = cells["run"].strip("`")
        if run not in TARGETS:
            raise ValueError(f"{doc.name}: the counts table names an unknown run {cells['run']}")
        stated[(run, cells["access type"])] = {k: int(cells[k]) for k in COUNT_COLUMNS}
    return stated
