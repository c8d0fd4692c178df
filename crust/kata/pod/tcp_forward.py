"""CRI PortForward for a pod in a microVM.

containerd answers PortForward itself: it enters the pod's network namespace
and dials localhost:<port> there. A runc pod's server listens in that
namespace; a microVM pod's listens in the guest, behind the tap
(crust.sys.podnet), so the dial would find nothing. The handler keeps one
listening socket inside the namespace per pod, a REDIRECT rule of the
namespace sends every TCP connection to 127.0.0.1 to it, and each accepted
connection is joined to a connection the handler makes to the same port at
the pod's address, from the host, as any client of the pod reaches it (over
the pod's network: bridge, veth, tap, guest). Bytes are copied both ways
until each side has closed its half. A port nothing in the guest listens
on: containerd's dial was accepted already, so it is reset rather than
refused (its forward fails either way).

A restarted handler makes its socket and rule again (adopt); the rule and
the socket go with the pod (stop), or with its namespace.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

from crust.sys import podnet

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
CHUNK = 65536


class PortForwarder:
    def __init__(self, sandbox_id: str, netns_path: str, pod_address: str):
        self.sandbox_id = sandbox_id
        self.netns_path = netns_path
        self.pod_address = pod_address
        self._server: asyncio.base_events.Server | None = None
        self._links: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        """The listening socket's port inside the namespace (0 before start)."""
        if self._server is None or not self._server.sockets:
            return 0
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        sock = await asyncio.to_thread(podnet.listen_inside, self.netns_path)
        try:
            self._server = await asyncio.start_server(self._accepted, sock=sock)
            await podnet.redirect_localhost(self.netns_path, self.port)
        except BaseException:
            await self.stop()
            sock.close()
            raise
        log.info("port forwarding ready", extra={"fields": {"sandbox": self.sandbox_id, "port": self.port,
                                                            "address": self.pod_address}})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self._links):
            link.cancel()
        try:
            await podnet.remove_redirect(self.netns_path)
        except podnet.PodNetworkError as exc:
            log.warning("port forwarding rule not removed", extra={"fields": {
                "sandbox": self.sandbox_id, "error": str(exc)}})

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._links.add(task)
        try:
            _, port = podnet.original_destination(writer.get_extra_info("socket"))
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(self.pod_address, port, family=socket.AF_INET), CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                # The dial containerd made was accepted already: a reset
                # (not a quiet end) makes its forward fail, as the refused
                # dial does under runc.
                log.info("port forward refused", extra={"fields": {"sandbox": self.sandbox_id, "port": port,
                                                                   "error": str(exc) or type(exc).__name__}})
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                           struct.pack("ii", 1, 0))
                return
            try:
                await asyncio.gather(_copy(reader, up_writer), _copy(up_reader, writer))
            finally:
                up_writer.close()
        except OSError as exc:
            log.info("port forward ended", extra={"fields": {"sandbox": self.sandbox_id, "error": str(exc)}})
        finally:
            writer.close()
            self._links.discard(task)


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    """source to sink until source ends, then sink's write half closed."""
    try:
        while data := await source.read(CHUNK):
            sink.write(data)
            await sink.drain()
        if sink.can_write_eof():
            sink.write_eof()
    except (ConnectionError, OSError):
        sink.close()
