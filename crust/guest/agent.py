"""The agent's main: AgentService over ttrpc, on the VM's virtio-serial
port (the guest) or on a unix socket (the host's tests).

    python3 -m crust.guest --port-name crust.agent
    python3 -m crust.guest --listen /run/agent.sock

A port is one byte stream with no connections of its own: the agent serves
it as one ttrpc connection; when the host's side goes away the read ends,
the answers still owed are dropped (their work goes on, see the protocol's
retry rules), and the next host that connects is served afresh. The
processes and their output live in the AgentService, not the connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import sys
import time

from crust.api import agent_pb2
from crust.common import ttrpc, ttrpc_server
from crust.guest.containers import CONTAINERS_DIR, HOLDS_DIR
from crust.guest.lifecycle import WARM_SPEC
from crust.guest.oci import (
    ENTER_PROGRAM,
    GUEST_EXEC_DIR,
    GUEST_RUNTIME,
    GUEST_RUNTIME_ROOT,
    OciRuntime,
)
from crust.guest.places import CATATONIT, RUN_DIR
from crust.guest.port_writer import PortWriter
from crust.guest.service import AgentService

log = logging.getLogger("crust.guest")

SYS_PORTS = "/sys/class/virtio-ports"
# How long the agent waits at boot for its port to appear (the module was
# loaded just before).
PORT_APPEARS = 30.0


def make_server(service: AgentService) -> ttrpc_server.Server:
    server = ttrpc_server.Server(refuse_calls_over=ttrpc.CONNECTION_CALLS_MAX)
    server.register_service(agent_pb2.DESCRIPTOR.services_by_name["AgentService"], service)
    service.server = server
    return server


def find_port(name: str, sys_class: str = SYS_PORTS) -> str | None:
    """The device of the virtio-serial port QEMU named name, or None."""
    try:
        entries = sorted(os.listdir(sys_class))
    except FileNotFoundError:
        return None
    for entry in entries:
        try:
            with open(f"{sys_class}/{entry}/name") as f:
                if f.read().strip() == name:
                    return f"/dev/{entry}"
        except OSError:
            continue
    return None


async def wait_for_port(name: str, timeout: float = PORT_APPEARS) -> str:
    deadline = time.monotonic() + timeout
    while (path := find_port(name)) is None or not os.path.exists(path):
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"no virtio-serial port named {name!r} within {timeout:g} s")
        await asyncio.sleep(0.01)
    return path


async def _streams_over(fd: int) -> tuple[asyncio.StreamReader, PortWriter]:
    """Reader and writer over duplicates of fd: they close their copies,
    the port stays open."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=ttrpc.MESSAGE_LENGTH_MAX + ttrpc.HEADER_LENGTH)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(fd), "rb", 0))
    return reader, PortWriter(os.dup(fd), loop)


async def _next_change(changes: select.epoll) -> None:
    """Until the port's connection changes (edge-triggered: one event per
    change), then every pending event taken."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(changes.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(changes.fileno())
    changes.poll(0)


async def serve_port(server: ttrpc_server.Server, path: str, stopping: asyncio.Event) -> None:
    """Serve the port as one connection after another. The port is opened
    once, for the agent's life: the guest's kernel drops what the host
    sends while no one in the guest has it open. A host that goes away
    reads as the end of the stream (and POLLHUP, level-triggered, for as
    long as it is away); it coming back is an EPOLLOUT edge."""
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    changes = select.epoll()
    changes.register(fd, select.EPOLLOUT | select.EPOLLET)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        while not stopping.is_set():
            reader, writer = await _streams_over(fd)
            serving = asyncio.ensure_future(server.serve_stream(reader, writer))
            await asyncio.wait([serving, stop], return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            # Replies owed to the host that left are dropped, never sent to
            # the next one (a transport that could flush is closed already).
            if writer.transport.get_write_buffer_size():
                writer.transport.abort()
            if stopping.is_set():
                return
            change = asyncio.ensure_future(_next_change(changes))
            await asyncio.wait([change, stop], return_when=asyncio.FIRST_COMPLETED)
            change.cancel()
    finally:
        stop.cancel()
        changes.close()
        os.close(fd)


async def serve_socket(server: ttrpc_server.Server, path: str, stopping: asyncio.Event) -> None:
    # The path appears only once the socket listens: a client that sees
    # it never meets a refused connection.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = f"{path}.{os.getpid()}"
    listener.bind(staging)
    listener.listen(16)
    os.rename(staging, path)
    await server.serve_socket(listener)
    await stopping.wait()


async def run(port: str | None, listen: str | None, port_name: str | None = None,
              runtime: OciRuntime | None = None, containers_dir: str = CONTAINERS_DIR,
              holds_dir: str = HOLDS_DIR, run_dir: str = RUN_DIR, pod_init: str = CATATONIT,
              warm_spec: str = WARM_SPEC) -> None:
    service = AgentService(runtime=runtime, containers_dir=containers_dir, holds_dir=holds_dir, run_dir=run_dir,
                           pod_init=pod_init, warm_spec=warm_spec)
    service.in_guest = listen is None
    server = make_server(service)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stopping.set)
    try:
        if port_name:
            port = await wait_for_port(port_name)
            log.info("serving on %s (%s)", port, port_name)
        if port:
            await serve_port(server, port, stopping)
        else:
            await serve_socket(server, listen, stopping)
    finally:
        await server.close()
        await service.close()


# The options: (default, what it is). Parsed by hand: argparse and the
# gettext it imports are a measurable share of the agent's start in the
# guest, which the host waits for.
WHERE = {"--port": "a virtio-serial port's device (the guest)",
         "--port-name": "a virtio-serial port's name, its device found in sysfs (the guest)",
         "--listen": "a unix socket path to listen on (tests on the host)"}
OPTIONS = {
    "--oci-runtime": (GUEST_RUNTIME, "the OCI runtime execs run through"),
    "--oci-root": (GUEST_RUNTIME_ROOT, "the OCI runtime's state directory"),
    "--exec-dir": (GUEST_EXEC_DIR, "where execs' process files are written"),
    "--enter-program": (ENTER_PROGRAM, ("the program an exec enters its container with (crun's exec when it is "
                                        "missing)")),
    "--containers-dir": (CONTAINERS_DIR, "where the agent keeps a container's bundle and the fifos of its hooks"),
    "--holds-dir": (HOLDS_DIR, "where a container's mount namespace is held"),
    "--run-dir": (RUN_DIR, "where the pod's shares, tmpfs and a container's subPath binds are mounted"),
    "--pod-init": (CATATONIT, "the init of the pod's shared PID namespace"),
    "--warm-spec": (WARM_SPEC, "the OCI spec of Warm's throwaway container"),
}
USAGE = "usage: python3 -m crust.guest (--port DEVICE | --port-name NAME | --listen PATH) [--OPTION VALUE ...]"


class UsageError(Exception):
    pass


def parse_args(argv: list[str]) -> dict[str, str] | None:
    """Each option's value by its name (--name value or --name=value), the
    defaults filled in; None for --help. UsageError names what is wrong."""
    given: dict[str, str] = {}
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word in ("-h", "--help"):
            return None
        name, eq, value = word.partition("=")
        if name not in WHERE and name not in OPTIONS:
            raise UsageError(f"unrecognized argument: {word}")
        if not eq:
            if not rest:
                raise UsageError(f"{name}: expected one argument")
            value = rest.pop(0)
        if name in given:
            raise UsageError(f"{name}: given twice")
        given[name] = value
    where = [name for name in WHERE if name in given]
    if len(where) != 1:
        raise UsageError(f"one of {', '.join(WHERE)} is required" if not where else
                         f"{where[0]}: not allowed with {where[1]}")
    return {**{name: default for name, (default, _) in OPTIONS.items()}, **given}


def help_text() -> str:
    lines = [USAGE, "", "crust's guest agent", ""]
    lines += [f"  {name} {name[2:].upper().replace('-', '_')}\n        {what}" for name, what in WHERE.items()]
    lines += [f"  {name} {name[2:].upper().replace('-', '_')}\n        {what} (default: {default})"
              for name, (default, what) in OPTIONS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{USAGE}\npython3 -m crust.guest: error: {exc}", file=sys.stderr)
        return 2
    if args is None:
        print(help_text())
        return 0
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="crust-agent: %(message)s")
    asyncio.run(run(args.get("--port"), args.get("--listen"), args.get("--port-name"),
                    OciRuntime(args["--oci-runtime"], args["--oci-root"], args["--exec-dir"],
                               args["--enter-program"]),
                    args["--containers-dir"], args["--holds-dir"], args["--run-dir"], args["--pod-init"],
                    args["--warm-spec"]))
    return 0
