#!/usr/bin/env python3
"""A pod's network through the microVM (crust-microvm: the VM's NIC on a tap
redirected to CNI's veth) against runc's, side by side in one run.

Each RuntimeClass gets a node of its own (tests/harness/pod_nodes.py
pod_node: a private containerd with a CNI bridge, the crust stack for the
microVM), a web pod (busybox httpd serving a small page and a --mib MiB
file) and a client pod, started through CRI as kubelet starts them. Then:

1. host -> pod latency: --requests sequential GETs of the small page from
   the host, each on a new connection (as a Service's probe or a short
   request arrives), the median and the 90th percentile;
2. host -> pod throughput: GETs of the big file from the host, MiB/s
   (median of --runs);
3. pod -> pod: the client pod's busybox wget of the small page --requests
   times, and of the big file --runs times, timed inside the client
   (/proc/uptime, 10 ms), so that the exec's own round trip (seconds under
   tcg) is not counted.

The load average is printed before and after; the microVM's numbers are
under whatever accelerator the handler chose (tcg on the development
machines).

    .venv/bin/python bench/runtime/pod_network.py [--runs 5] [--requests 50] [--mib 16] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib.benchlib import accelerator_under  # noqa: E402
from bench.lib.run_record import machine, run_header, write_json  # noqa: E402
from tests.harness.daemons import Root  # noqa: E402
from tests.harness.pod_http import eventually_get, http_get, serve  # noqa: E402
from tests.harness.pod_nodes import KEEP_RUNNING, pod_node  # noqa: E402

WGET_LOOP = """t() {{ read -r up _ < /proc/uptime; echo "$up"; }}
a=$(t); i=0; while [ $i -lt {n} ]; do wget -q -O /dev/null http://{ip}/{path} || exit 1; i=$((i+1)); done; b=$(t)
echo "$a $b"
"""


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def get_bytes(address: str, path: str) -> int:
    """GET path over HTTP/1.0, the body's length."""
    buffer = bytearray(1 << 20)
    with socket.create_connection((address, 80), timeout=30) as sock:
        sock.sendall(f"GET /{path} HTTP/1.0\r\nHost: {address}\r\n\r\n".encode())
        head, total = b"", 0
        while n := sock.recv_into(buffer):
            if total == 0 and b"\r\n\r\n" not in head:
                head += bytes(buffer[:n])
                if b"\r\n\r\n" in head:
                    total = len(head.partition(b"\r\n\r\n")[2])
                continue
            total += n
    return total


def in_client(node, client_id: str, ip: str, path: str, n: int) -> float:
    """Seconds the client pod took for n wgets of path, timed inside it."""
    done = node.runtime.exec_sync(client_id, ["/bin/sh", "-c", WGET_LOOP.format(n=n, ip=ip, path=path)], timeout=300)
    assert done.exit_code == 0, (done.exit_code, done.stderr)
    start, end = done.stdout.split()
    return float(end) - float(start)


def measure(runtime_class: str, args, seen: dict) -> dict:
    root = Root()
    try:
        with pod_node(runtime_class, root, pod_network=True) as node:
            big = f"dd if=/dev/urandom of=/www/big bs=1M count={args.mib} 2>/dev/null && "
            web = node.pod("web", host_network=False, volumes={}, containers=[
                node.container("server", "mkdir -p /www && " + big + serve("small").removeprefix("mkdir -p /www && "))])
            client = node.pod("client", host_network=False, volumes={},
                              containers=[node.container("client", KEEP_RUNNING)])
            with node.running(web), node.running(client):
                ip = node.runtime.pod_status(web).ready_sandbox().network.ip
                if runtime_class == "crust-microvm":  # the pods' VMs, from their QEMU's command line
                    seen["accelerator"] = accelerator_under(root.path)
                eventually_get(ip, 80, b"small\n", f"{runtime_class}: the web pod")
                client_id = node.status(client, "client").id
                latencies = []
                for _ in range(args.requests):
                    started = time.perf_counter()
                    http_get(ip, 80)
                    latencies.append((time.perf_counter() - started) * 1e3)
                throughput = []
                for _ in range(args.runs):
                    started = time.perf_counter()
                    assert get_bytes(ip, "big") == args.mib << 20
                    throughput.append(args.mib / (time.perf_counter() - started))
                pod_small = in_client(node, client_id, ip, "", args.requests) / args.requests * 1e3
                pod_big = [args.mib / in_client(node, client_id, ip, "big", 1) for _ in range(args.runs)]
        return {"host_to_pod_ms_median": statistics.median(latencies),
                "host_to_pod_ms_p90": percentile(latencies, 0.9),
                "host_to_pod_mib_s": statistics.median(throughput),
                "pod_to_pod_ms": pod_small, "pod_to_pod_mib_s": statistics.median(pod_big),
                # The spread behind each median: [min, max] of its runs.
                "host_to_pod_ms_min_max": [min(latencies), max(latencies)],
                "host_to_pod_mib_s_min_max": [min(throughput), max(throughput)],
                "pod_to_pod_mib_s_min_max": [min(pod_big), max(pod_big)]}
    finally:
        root.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="big-file transfers per measurement")
    parser.add_argument("--requests", type=int, default=50, help="small requests per latency measurement")
    parser.add_argument("--mib", type=int, default=16, help="size of the big file, MiB")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run as root (pods, loop devices, mounts)")
    before = load()
    seen: dict = {}
    results = {rc: measure(rc, args, seen) for rc in ("runc", "crust-microvm")}
    after = load()
    print(f"load average before {before}, after {after}")
    print(f"{'':24}{'runc':>12}{'crust-microvm':>16}{'ratio':>8}")
    for key, label in (("host_to_pod_ms_median", "host->pod GET, ms (med)"),
                       ("host_to_pod_ms_p90", "host->pod GET, ms (p90)"),
                       ("host_to_pod_mib_s", "host->pod MiB/s"),
                       ("pod_to_pod_ms", "pod->pod GET, ms"),
                       ("pod_to_pod_mib_s", "pod->pod MiB/s")):
        runc, vm = results["runc"][key], results["crust-microvm"][key]
        print(f"{label:24}{runc:12.2f}{vm:16.2f}{vm / runc:8.2f}")
    if args.json:
        write_json(args.json, {**run_header("pod_network", None, machine(), vm=True), **seen, "load_before": before,
                               "load_after": after, "args": vars(args) | {"json": args.json.name},
                               "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
