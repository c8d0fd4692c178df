"""The scenarios of docs/performance.md (bench/lib/render.py): which committed
results are runs of each, and the table its newest run makes.

A scenario is one bench under one setting. Which runs belong to it is read
from the result itself (its benchmark, its command line, the settings its


figures are keyed by), so that a new result file of the same setting
becomes the scenario's current table without an edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.lib.csi_tables import (
    call_cpu, conformance_ratio, driver_lifecycle, file_io, handler_bench, hop_cost, large_requests, peer_gate,
    proxy_bench, scale_deferred, shim_latency, snapshot_freeze,
)
from bench.lib.figures import middle, num, spread
from bench.lib.pod_tables import (
    RUNC_POD_START, agent_port, kata_bench, luks_io, named_rows, pod_burst, pod_churn, pod_density,
    pod_density_beside, pod_exec_longevity, pod_idle_cpu, pod_logs, pod_network, pod_share, pod_start,
    pod_start_beside, pod_start_buses, pod_start_microvm, runc_against_microvm, shim_memory, with_before,
)
from bench.lib.run_record import script_of


@dataclass(frozen=True)
class Scenario:
    id: str
    title: str
    benchmark: str
    table: Callable[[dict], tuple[list[str], list[list]]]
    command: str  # how to reproduce it when no result is committed
    anchor: str = ""  # what the figures are held against, when the table has no anchor column
    has: str = ""  # a key the result's "results" must hold
    flags: tuple[str, ...] = ()  # words its command line must hold
    without: tuple[str, ...] = ()  # words its command line must not hold

    def matches(self, name: str, result: dict) -> bool:
        if result.get("benchmark") != self.benchmark:
            return False
        words = str(result.get("command", "")).split()
        joined = " ".join(words)
        if any(flag not in joined for flag in self.flags) or any(w in words for w in self.without):
            return False
        return not self.has or self.has in result.get("results", {})


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("pod-start-microvm-cold", "Pod start, crust-microvm, a VM booted per pod", "pod_start_microvm",
             pod_start_microvm("pool 0"), ".venv/bin/python bench/runtime/pod_start_microvm.py --pools 0",
             anchor=RUNC_POD_START,
             has="pool 0", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-template", "Pod start, crust-microvm, VMs cloned from a template",
             "pod_start_microvm", pod_start_microvm("template"),
             ".venv/bin/python bench/runtime/pod_start_microvm.py --pools template",
             anchor=RUNC_POD_START,
             has="template", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-first-pods",
             "Pod start, crust-microvm, a node's first pods beside the template's making",
             "pod_start_microvm", pod_start_beside("template-first", "template"),
             ".venv/bin/python bench/runtime/pod_start_microvm.py --pools template-first,template --floor-boots 0",
             has="template-first", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-pool", "Pod start, crust-microvm, a VM from a warm pool", "pod_start_microvm",
             pod_start_microvm("pool 1"), ".venv/bin/python bench/runtime/pod_start_microvm.py --pools 1",
             anchor=RUNC_POD_START,
             has="pool 1", without=("--cpus", "--disk-buses")),
    Scenario("pod-start-microvm-buses", "Pod start on each disk bus", "pod_start_microvm", pod_start_buses,
             ".venv/bin/python bench/runtime/pod_start_microvm.py --pools 0,template,1 --disk-buses virtio-blk,virtio-scsi",
             flags=("--disk-buses",)),
    Scenario("pod-exec", "ExecSync into a running container", "pod_exec",
             with_before(runc_against_microvm("figures", "ms")),
             ".venv/bin/python bench/runtime/pod_exec.py --rounds 5", without=("--busy",)),
    Scenario("pod-exec-busy", "ExecSync into a running container, both host CPUs busy", "pod_exec",
             with_before(runc_against_microvm("figures", "ms")),
             ".venv/bin/python bench/runtime/pod_exec.py --rounds 5 --busy 2", flags=("--busy 2",)),
    Scenario("pod-exec-longevity", "Many execs into one container (an exec probe for weeks)", "pod_exec_longevity",
             pod_exec_longevity, ".venv/bin/python bench/runtime/pod_exec_longevity.py --execs 10000 --block 1000",
             anchor="the first block of the same run: the last within 10% of it, for both runtimes."),
    Scenario("pod-logs", "A container's logs, host idle", "pod_logs", with_before(pod_logs),
             ".venv/bin/python bench/runtime/pod_logs.py --rounds 5 --busy 0", flags=("--busy 0",)),
    Scenario("pod-logs-busy", "A container's logs, both host CPUs busy", "pod_logs", with_before(pod_logs),
             ".venv/bin/python bench/runtime/pod_logs.py --rounds 5 --busy 2", flags=("--busy 2",)),
    Scenario("guest-crun", "The guest's OCI runtime", "guest_crun", named_rows("variants", "what runs (ms)"),
             ".venv/bin/python bench/microvm/guest_crun.py --rounds 5",
             anchor="no OCI runtime (`bench/microvm/guest_maker.c` doing the spec's parts) and `sh -c true`, rows of the "
                    "same run."),
    Scenario("agent-port", "The guest agent's transport", "agent_port", agent_port,
             ".venv/bin/python bench/microvm/agent_port.py --rounds 5"),
    Scenario("microvm-handler", "The microVM handler: sandboxes, stats, expansion", "kata_bench", kata_bench,
             ".venv/bin/python bench/microvm/kata_bench.py --parts 1,2,3 --runs 3 --stats-rounds 50"),
    Scenario("pod-idle-cpu", "An idle pod's CPU", "pod_idle_cpu", pod_idle_cpu,
             ".venv/bin/python bench/runtime/pod_idle_cpu.py",
             anchor="the floor row: a VM alone, with no pod in it (same run)."),
    Scenario("pod-density", "Idle pods on one node", "pod_density", with_before(pod_density),
             ".venv/bin/python bench/runtime/pod_density.py --pods 20", flags=("--pods 20",)),
    Scenario("pod-density-shim", "The shim's memory: ttrpc to the handler against gRPC (a few idle pods)",
             "pod_density", with_before(shim_memory), ".venv/bin/python bench/runtime/pod_density.py --pods 4",
             flags=("--pods 4",)),
    Scenario("pod-density-beside", "Idle pods restored from the template, beside the commit before",
             "pod_density", pod_density_beside,
             ".venv/bin/python bench/runtime/pod_density.py --pods 5 --vm-source template", flags=("--pods 5",),
             without=("boot",)),
    Scenario("pod-density-lockdown", "Idle pods restored from the template, the guest kernel locked down",
             "pod_density", with_before(pod_density),
             ".venv/bin/python bench/runtime/pod_density.py --pods 10 --settle 10 --seconds 10",
             flags=("--pods 10",), without=("boot",)),
    Scenario("pod-density-boot-lockdown", "Idle pods booted, the guest kernel locked down", "pod_density",
             with_before(pod_density),
             ".venv/bin/python bench/runtime/pod_density.py --pods 5 --settle 10 --seconds 10 --vm-source boot",
             flags=("--pods 5", "--vm-source boot")),
    Scenario("pod-density-boot", "Idle pods booted", "pod_density", with_before(pod_density),
             ".venv/bin/python bench/runtime/pod_density.py --pods 10 --settle 10 --seconds 10 --vm-source boot",
             flags=("--pods 10", "--vm-source boot")),
    Scenario("pod-burst", "Pods asked for at once", "pod_burst", pod_burst,
             ".venv/bin/python bench/runtime/pod_burst.py --pods 20 --settings template,pool4", flags=("--pods 20",)),
    Scenario("pod-burst-by-process", "Pods asked for at once: their CPU by process", "pod_burst",
             with_before(pod_burst), ".venv/bin/python bench/runtime/pod_burst.py --pods 10 --settings template",
             flags=("--pods 10",)),
    Scenario("pod-churn", "Pod lives one after another", "pod_churn", pod_churn,
             ".venv/bin/python bench/runtime/pod_churn.py --lives 1000",
             anchor="the issue's limit: no more than 5% growth of the daemons' memory and descriptors."),
)


_HEADER_KEYS = {"benchmark", "command", "date", "machine", "commit", "dirty", "dirty_paths", "code", "accelerator",
                "accel", "load_before", "load_after", "load", "loadavg_start", "loadavg_end", "load_start", "args"}


def flat(result: dict):
    """Any result: its figures, one row per summary or number, in the order
    the bench wrote them (at most 40 rows)."""
    rows: list[list] = []

    def walk(prefix: str, value) -> None:
        if len(rows) >= 40:
            return
        if isinstance(value, dict) and middle(value) is not None:
            rows.append([prefix, spread(value)])
        elif isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix} / {key}" if prefix else key, sub)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append([prefix, num(value)])

    for key, value in result.items():
        if key not in _HEADER_KEYS:
            walk(key, value)
    return ["figure", "value"], rows


def _pending(id: str, title: str, bench: str, command: str, anchor: str = "") -> Scenario:
    return Scenario(id, title, bench, lambda result: TABLES.get(bench, flat)(result),
                    f".venv/bin/python {script_of(bench)} {command}".rstrip(), anchor=anchor)


TABLES = {"hop_cost": hop_cost, "shim_latency": shim_latency, "proxy_bench": proxy_bench,
          "peer_gate": peer_gate, "large_requests": large_requests, "driver_lifecycle": driver_lifecycle,
          "handler_bench": handler_bench, "file_io": file_io, "call_cpu": call_cpu, "pod_start": pod_start,
          "conformance_ratio": conformance_ratio, "guest_boot": named_rows("ways", "way (ms)"),
          "pod_share": pod_share, "pod_network": pod_network, "luks_io": luks_io, "scale_deferred": scale_deferred,
          "snapshot_freeze": snapshot_freeze}


SCENARIOS += (
    _pending("hop-cost", "What each hop costs: driver, shim, proxy", "hop_cost", "--rounds 500 --cpu-calls 3000 --bare",
             anchor="the driver alone, and `bench/lib/bare_hop.py` forwarding raw bytes (`--bare`)."),
    _pending("shim-passthrough", "Passthrough against the driver", "shim_latency", "--rounds 300 --publishes 40",
             anchor="the same RPC sent straight to the driver, interleaved."),
    _pending("driver-lifecycle", "Driver lifecycle at 10 and 1,000 volumes", "driver_lifecycle", "--json OUT.json"),
    _pending("handler", "The mount-namespace runtime handler", "handler_bench", "--json OUT.json"),
    _pending("proxy", "The proxy", "proxy_bench", "--json OUT.json"),
    _pending("peer-gate", "The peer gate on the runtime socket", "peer_gate", "--calls 4000 --json OUT.json",
             anchor="the same server on a plain socket, interleaved."),
    _pending("large-requests", "Memory under large requests", "large_requests", "--json OUT.json"),
    _pending("luks-io", "Encrypted volumes in the guest", "luks_io", "--json OUT.json",
             anchor="the same volume unencrypted, in the same guest."),
    _pending("pod-start-runc", "Pod start through containerd, runc and crust-runc", "pod_start", "--json OUT.json",
             anchor="plain runc through the same containerd."),
    _pending("guest-boot", "The guest's boot", "guest_boot", "--json OUT.json"),
    _pending("pod-share", "The pod's shared directory", "pod_share", "--json OUT.json"),
    _pending("pod-network", "The pod's network", "pod_network", "--json OUT.json",
             anchor="runc's pod network on the same node, in the same run (measured first)."),
    _pending("file-io", "Small files on the event loop", "file_io", "--json OUT.json"),
    _pending("scale-deferred", "1,000 deferred volumes", "scale_deferred", "--volumes 1000 --json OUT.json"),
    _pending("conformance", "The conformance suite against the Go reference", "conformance_ratio", "--json OUT.json",
             anchor="the Go hostpath plugin running the same suite."),
    _pending("call-cpu", "CPU per CSI call", "call_cpu", "--json OUT.json",
             anchor="the Go hostpath plugin (csi-driver-host-path) sent the same calls, by turns."),
    _pending("snapshot-freeze", "A pod's writes during a snapshot, with and without the freeze", "snapshot_freeze",
             "--snapshots 20 --json OUT.json", anchor="the same pod's snapshots with `crust.dev/freeze: never`."),
)
