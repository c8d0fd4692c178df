"""Bursts of large CSI requests at a daemon's socket, and what its memory
does meanwhile: the load bench/csi/large_requests.py measures and
tests/integration/test_large_requests.py holds to a bound."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def large_request(size: int) -> bytes:
    """A CreateVolumeRequest of exactly size bytes: field 999 (unknown), length-delimited."""
    from google.protobuf.internal.encoder import _VarintBytes

    tag = _VarintBytes((999 << 3) | 2)
    body = size - len(tag) - len(_VarintBytes(size))
    return tag + _VarintBytes(body) + b"x" * body


def burst(socket: Path, pid: int, data: bytes, rounds: int, concurrency: int) -> dict:
    import grpc

    channel = grpc.insecure_channel(f"unix://{socket}", options=[("grpc.max_send_message_length", -1)])
    call = channel.unary_unary("/csi.v1.Controller/CreateVolume")

    def one(_):
        try:
            call(data, timeout=60)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name

    before = rss_mib(pid)
    after_round, codes = [], {}
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(rounds):
            for code in pool.map(one, range(concurrency)):
                codes[code] = codes.get(code, 0) + 1
            after_round.append(rss_mib(pid))
    time.sleep(2)
    channel.close()
    return {"rss_before_mib": before, "rss_max_mib": max(after_round), "rss_last_round_mib": after_round[-1],
            "rss_settled_mib": rss_mib(pid), "rss_after_each_round_mib": after_round, "codes": codes}
