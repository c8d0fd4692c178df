"""The QMP client (crust.kata.vmm.qmp) against a monitor of our own on a unix
socket: what it does when QEMU's end goes away."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from crust.kata.vmm.qmp import QmpClient, QmpGone


async def test_a_monitor_that_goes_away_takes_the_clients_socket_with_it(tmp_path):
    """QEMU killed: the client fails what waits and closes its socket at
    once (a handler that saw a thousand VMs killed holds none of their
    sockets)."""
    hang_up = asyncio.Event()

    async def monitor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json.dumps({"QMP": {"version": {}, "capabilities": []}}).encode() + b"\n")
        request = json.loads(await reader.readline())
        writer.write(json.dumps({"return": {}, "id": request["id"]}).encode() + b"\n")
        await hang_up.wait()
        writer.close()

    path = tmp_path / "qmp.sock"
    server = await asyncio.start_unix_server(monitor, path=str(path))
    client = QmpClient(str(path))
    try:
        await client.connect(timeout=5)
        fd = client._writer.get_extra_info("socket").fileno()
        target = os.readlink(f"/proc/self/fd/{fd}")
        waiting = asyncio.ensure_future(client.wait_event("SHUTDOWN", since=client.mark(), timeout=5))
        await asyncio.sleep(0.05)
        hang_up.set()
        with pytest.raises(QmpGone):
            await waiting
        for _ in range(100):
            if not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}") != target:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError(f"the client still holds its socket {target} after the monitor went")
        with pytest.raises(QmpGone):
            await client.execute("query-status", timeout=1)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
