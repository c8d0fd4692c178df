#!/usr/bin/env python3
"""What a guest process costs through the guest agent's port in one VM:
the Python agent (crust/guest/), ttrpc on the virtio-serial port, many
calls in flight.

Each round, in turns: a guest process `sh -c true` started, waited for,
its output read and forgotten; ten such processes asked for at once; and
10 MiB of output read to its end. Times are the host's, around the calls.
After the rounds, the agent's memory as its guest counts it (VmRSS and its
peak VmHWM in /proc/<agent>/status, read by a process it started).

    .venv/bin/python bench/microvm/agent_port.py [--rounds 5] [--accel tcg|kvm] [--cache DIR] [--json OUT.json]

Median, min and max per figure, the output's rate, the machine and its load
before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.lib import benchlib  # noqa: E402
from crust.api import agent_pb2  # noqa: E402
from crust.kata.image import build as kata_image
from crust.kata.agent.client import AgentClient  # noqa: E402
from crust.kata.vmm.qemu import Vm, VmConfig  # noqa: E402
from tests.harness.guest_vm import run_script  # noqa: E402

PORT_OUTPUT = 10 << 20


async def port_run(client: AgentClient, exec_id: str, script: str) -> int:
    process = json.dumps({"args": ["sh", "-c", script], "env": ["PATH=/usr/bin:/bin"], "cwd": "/"}).encode()
    await client.call("ExecProcess", agent_pb2.ExecProcessRequest(exec_id=exec_id, process=process), timeout=60)
    length = 0
    for method in ("ReadStdout", "ReadStderr"):
        offset = 0
        while True:
            rsp = await client.call(method, agent_pb2.ReadStreamRequest(exec_id=exec_id, offset=offset,
                                                                        max_bytes=1 << 20), timeout=120)
            offset += len(rsp.data)
            if rsp.eof:
                break
        length += offset
    await client.call("WaitProcess", agent_pb2.WaitProcessRequest(exec_id=exec_id), timeout=60)
    await client.call("RemoveProcess", agent_pb2.RemoveProcessRequest(exec_id=exec_id), timeout=60)
    return length


async def measure(client: AgentClient, rounds: int, samples: dict[str, list[float]]) -> None:
    serial = 0

    def next_id() -> str:
        nonlocal serial
        serial += 1
        return f"b{serial}"

    async def timed(coro) -> float:
        started = time.monotonic()
        await coro
        return (time.monotonic() - started) * 1e3

    ways = {
        "port: sh -c true": lambda: port_run(client, next_id(), "true"),
        "port: 10 at once": lambda: asyncio.gather(*(port_run(client, next_id(), "true") for _ in range(10))),
        "port: 10 MiB out": lambda: port_run(client, next_id(), f"head -c {PORT_OUTPUT} /dev/zero"),
    }
    for way in ways.values():
        await way()  # a first run of each, not counted (the guest's caches)
    for turn in range(rounds):
        for name in benchlib.rotated(list(ways), turn):
            ms = await timed(ways[name]())
            samples.setdefault(name, []).append(ms)
            print(f"round {turn + 1}/{rounds} {name}: {ms:.0f} ms", flush=True)


async def agent_memory(client: AgentClient) -> dict[str, int]:
    """The agent's VmRSS and VmHWM in KiB: the parent of the guest process
    that reads them is the agent."""
    code, out, err = await run_script(client, "memory", "grep -E '^(VmRSS|VmHWM):' /proc/$PPID/status", 60)
    if code != 0:
        raise RuntimeError(f"the agent's status: exit {code}: {err.decode(errors='replace')}")
    return {line.split(":")[0]: int(line.split()[1]) for line in out.decode().splitlines()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accel", choices=("tcg", "kvm"), default="tcg")
    parser.add_argument("--cache", type=Path, default=kata_image.DEFAULT_CACHE,
                        help=f"guest image cache (default {kata_image.DEFAULT_CACHE})")
    parser.add_argument("--json", help="write the results there (- for stdout)")
    args = parser.parse_args(argv)
    if benchlib.not_root("agent_port.py", "QEMU and the image cache"):
        return 1
    benchlib.raise_on_signals()
    results = benchlib.run_header("agent_port", argv, benchlib.machine(), vm=True)
    base = Path(tempfile.mkdtemp(prefix="crust-agent-port-"))

    def body() -> None:
        built = kata_image.build(args.cache)
        samples: dict[str, list[float]] = {}

        async def run() -> None:
            vm = Vm("crust-agent-port", base / "vm", VmConfig(kernel=built.kernel, initrd=built.initrd,
                                                               accel=args.accel))
            await vm.start(ready_timeout=120)   # ready once its agent answers on the port
            try:
                client = await vm.port.ready()
                await measure(client, args.rounds, samples)
                results["agent_memory_kib"] = await agent_memory(client)
            finally:
                await vm.kill()

        results["load_before"] = benchlib.loadavg()
        asyncio.run(run())
        results["load_after"] = benchlib.loadavg()
        results["accelerator"] = args.accel
        results["ways"] = benchlib.ms_rows(samples)
        port_out = results["ways"]["port: 10 MiB out"]
        results["output_mib_per_s"] = {"port": round(PORT_OUTPUT / 2**20 / (port_out["median_ms"] / 1e3), 2)}
        print(f"\nthe guest agent's port, {args.accel}, median of {args.rounds} (min-max); "
              f"{benchlib.machine_summary(results['machine'])}")
        benchlib.print_ms_rows(results["ways"], 18)
        print(f"output: port {results['output_mib_per_s']['port']} MiB/s")
        memory = results["agent_memory_kib"]
        print(f"the agent's memory: VmRSS {memory['VmRSS'] / 1024:.1f} MiB, peak {memory['VmHWM'] / 1024:.1f} MiB")
        print(f"load {results['load_before']} before, {results['load_after']} after")

    return benchlib.guarded_run_then_write(body, benchlib.vm_dir_cleanup(base), benchlib.report_failure, args.json,
                                           results)


if __name__ == "__main__":
    sys.exit(main())
