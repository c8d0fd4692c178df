"""ttrpc with a real containerd: our client forwards events into
containerd's own ttrpc socket (its event service), and the publisher waits
for a containerd that is not there yet."""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from google.protobuf import empty_pb2

from crust.api import containerd_events_pb2 as events
from crust.common import ttrpc
from crust.containerd_shim.events import Publisher, envelope, forward
from crust.common.ttrpc import TtrpcError
from crust.common.ttrpc_client import Client
from crust.common.ttrpc_server import Server


# -- containerd's own ttrpc socket ------------------------------------------------------------


@pytest.fixture
def containerd():
    from crust.kubelet.containerd import Containerd

    directory = Path(tempfile.mkdtemp(prefix="crust-ttrpc-"))
    instance = Containerd(directory / "containerd", sandbox_image="localhost/none:0")
    try:
        instance.start()
        yield instance
    finally:
        instance.close()
        shutil.rmtree(directory, ignore_errors=True)


async def test_containerd_accepts_forwarded_events(containerd):
    """Our client, containerd's server: events Forward over ttrpc, seen by a
    subscriber (`ctr events`) exactly as sent; a bad topic is refused with
    containerd's own status."""
    watcher = subprocess.Popen(["ctr", "--address", str(containerd.socket), "events"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(0.5)  # subscribed
        client = await Client.connect(str(containerd.socket) + ".ttrpc")
        try:
            await forward(client, "crust-ttrpc", events.TaskExit(container_id="c-1", id="c-1", pid=4242, exit_status=3))
            bad = envelope("crust-ttrpc", events.TaskOOM(container_id="c-2"))
            bad.topic = "no-leading-slash"
            from crust.api import containerd_events_ttrpc_pb2 as events_ttrpc

            with pytest.raises(TtrpcError) as caught:
                await client.call("containerd.services.events.ttrpc.v1.Events", "Forward",
                                  events_ttrpc.ForwardRequest(envelope=bad), empty_pb2.Empty, timeout=5)
            assert caught.value.code == ttrpc.INVALID_ARGUMENT
            with pytest.raises(TtrpcError) as caught:
                await client.call("containerd.services.events.ttrpc.v1.Events", "Nope", empty_pb2.Empty(),
                                  empty_pb2.Empty, timeout=5)
            assert caught.value.code == ttrpc.UNIMPLEMENTED
        finally:
            await client.close()
        # The publisher (the shim's queue) delivers through the same path.
        publisher = Publisher(f"unix://{containerd.socket}.ttrpc", "crust-ttrpc")
        publisher.publish(events.TaskStart(container_id="c-9", pid=99))
        assert await publisher.drain(10)
        await publisher.close()
        deadline = time.monotonic() + 10
        seen = ""
        # The pipe's descriptor itself, waited on with select: a text
        # stream's read() of a non-blocking pipe with nothing in it raises
        # (the decoder is handed None) instead of returning.
        fd = watcher.stdout.fileno()
        while time.monotonic() < deadline and ("/tasks/start" not in seen or "/tasks/exit" not in seen):
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break  # ctr ended
                seen += chunk.decode(errors="replace")
    finally:
        watcher.kill()
        watcher.wait()
    exit_line = next(line for line in seen.splitlines() if "/tasks/exit" in line)
    assert "crust-ttrpc" in exit_line and '"container_id":"c-1"' in exit_line.replace(" ", "")
    assert '"exit_status":3' in exit_line.replace(" ", "") and '"pid":4242' in exit_line.replace(" ", "")
    assert "c-9" in next(line for line in seen.splitlines() if "/tasks/start" in line)


async def test_publisher_waits_for_containerd(tmp_path):
    """Events published while containerd's socket is away are sent, in
    order, once it answers (here: our own server standing in for the
    socket; containerd's own side is the test above)."""
    path = str(tmp_path / "events.sock")
    received = []

    class Events:
        async def Forward(self, request, call):
            received.append(request.envelope.topic)
            return empty_pb2.Empty()

    from crust.api import containerd_events_ttrpc_pb2 as events_ttrpc

    publisher = Publisher(f"unix://{path}", "ns")
    publisher.publish(events.TaskStart(container_id="a"))
    publisher.publish(events.TaskExit(container_id="a", id="a"))
    await asyncio.sleep(0.5)
    server = Server()
    server.register_service(events_ttrpc.DESCRIPTOR.services_by_name["Events"], Events())
    await server.serve_path(path)
    try:
        assert await publisher.drain(10)
        assert received == ["/tasks/start", "/tasks/exit"]
    finally:
        await publisher.close()
        await server.close()
