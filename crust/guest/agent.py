"""The agent's main: AgentService over ttrpc, on the VM's virtio-serial
port (the guest) or on a unix socket (the host's tests).

    python3 -m crust.guest --port /dev/virtio-ports/crust.agent
    python3 -m crust.guest --listen /run/agent.sock

A port is one byte stream with no connections of its own: the agent serves
it as one ttrpc connection; when the host's side goes away the read ends,
the answers still owed are dropped (their work goes on, see the protocol's
retry rules), and the agent opens the port again for the next host. The
processes and their output live in the AgentService, not the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.service import AgentService

log = logging.getLogger("crust.guest")

# A host that went away: how soon the port is tried again.
REOPEN_PAUSE = 0.05


def make_server(service: AgentService) -> ttrpc.Server:
    server = ttrpc.Server()
    server.register_service(agent_pb2.DESCRIPTOR.services_by_name["AgentService"], service)
    return server


async def _port_streams(path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Reader and writer over a character device opened read-write."""
    loop = asyncio.get_running_loop()
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    write_fd = os.dup(fd)
    reader = asyncio.StreamReader(limit=ttrpc.MESSAGE_LENGTH_MAX + ttrpc.HEADER_LENGTH)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(write_fd, "wb", buffering=0))
    return reader, asyncio.StreamWriter(transport, protocol, None, loop)


async def serve_port(server: ttrpc.Server, path: str, stopping: asyncio.Event) -> None:
    while not stopping.is_set():
        reader, writer = await _port_streams(path)
        serving = asyncio.ensure_future(server.serve_stream(reader, writer))
        stop = asyncio.ensure_future(stopping.wait())
        await asyncio.wait([serving, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not serving.done():
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            return
        log.info("the host closed the port; opening it again")
        await asyncio.sleep(REOPEN_PAUSE)


async def serve_socket(server: ttrpc.Server, path: str, stopping: asyncio.Event) -> None:
    # The path appears only once the socket listens: a client that sees
    # it never meets a refused connection.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(16)
    os.rename(staging, path)
    await server.serve_socket(listener)
    await stopping.wait()


async def run(port: str | None, listen: str | None) -> None:
    service = AgentService()
    server = make_server(service)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stopping.set)
    try:
        if port:
            await serve_port(server, port, stopping)
        else:
            await serve_socket(server, listen, stopping)
    finally:
        await server.close()
        await service.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m crust.guest", description="crust's guest agent")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", help="a virtio-serial port's device (the guest)")
    where.add_argument("--listen", help="a unix socket path to listen on (tests on the host)")
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="crust-agent: %(message)s")
    asyncio.run(run(args.port, args.listen))
    return 0
