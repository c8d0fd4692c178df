"""Who is calling: the kernel's word, not the caller's.

gRPC's Python server does not tell a servicer the credentials of the peer
on a unix socket (its local credentials do not read SO_PEERCRED either), and
it cannot adopt a connection accepted by someone else. So a socket that must
know its callers is served in two parts:

- the gate listens on the public socket path, reads each new connection's
  SO_PEERCRED (pid, uid, gid as the kernel recorded them at connect()), and
  relays its bytes to the gRPC server over a second connection whose own
  address is an abstract unix name that carries those credentials;
- the gRPC server listens on an inner socket only root can connect to (mode
  0600 in the public socket's directory), so every connection it serves comes
  from the gate, and the address gRPC reports as the call's peer
  (`context.peer()`, "unix-abstract:crust-peer/UID/GID/PID/NONCE") is the
  identity the gate read. A connection without such an address (a root
  process that found the inner socket) is not identified and is refused.

PeerPolicy.check turns the peer into an allow/deny, the first thing the
interceptor does for every call on such a socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import struct
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterable

from crust.common.errors import PermissionDenied

log = logging.getLogger(__name__)

ABSTRACT_PREFIX = "crust-peer/"
_PEER_PREFIX = "unix-abstract:" + ABSTRACT_PREFIX


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"uid {self.uid} (gid {self.gid}, pid {self.pid})"


def credentials_of(sock: socket.socket) -> PeerCredentials:
    """SO_PEERCRED of a connected unix socket."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def parse_peer(peer: str) -> PeerCredentials | None:
    """The credentials the gate put in a relayed connection's address."""
    if not peer.startswith(_PEER_PREFIX):
        return None
    try:
        uid, gid, pid, _nonce = peer[len(_PEER_PREFIX):].split("/")
        return PeerCredentials(pid=int(pid), uid=int(uid), gid=int(gid))
    except ValueError:
        return None


# The caller of the call being served, on a gated socket (None elsewhere).
caller: ContextVar[PeerCredentials | None] = ContextVar("caller", default=None)


class PeerPolicy:
    """The uids and gids (a peer's gid as SO_PEERCRED reports it: its
    effective group, not its supplementary ones) allowed to call."""

    def __init__(self, uids: Iterable[int] = (0,), gids: Iterable[int] = ()):
        self.uids = frozenset(uids)
        self.gids = frozenset(gids)
        # A connection's peer string is the same for each of its calls: its
        # verdict is kept (bounded: a client connecting again and again
        # makes a new string each time).
        self._verdicts: dict[str, PeerCredentials | None] = {}

    def describe(self) -> str:
        uids = ", ".join(map(str, sorted(self.uids))) or "none"
        gids = ", ".join(map(str, sorted(self.gids))) or "none"
        return f"allowed uids: {uids}; gids: {gids}"

    def allows(self, creds: PeerCredentials) -> bool:
        return creds.uid in self.uids or creds.gid in self.gids

    def check(self, peer: str) -> PeerCredentials:
        """The caller's credentials, or PermissionDenied naming its uid."""
        creds = self._verdicts.get(peer, False)
        if creds is False:
            creds = parse_peer(peer)
            if creds is not None and not self.allows(creds):
                creds = None
            if len(self._verdicts) >= 4096:
                self._verdicts.clear()
            self._verdicts[peer] = creds
        if creds is None:
            found = parse_peer(peer)
            if found is None:
                raise PermissionDenied("the caller is not identified (it did not come through the socket's "
                                       "gate); only callers the kernel names are served")
            raise PermissionDenied(f"caller {found} is not allowed on this socket ({self.describe()})")
        return creds


def inner_socket_path(public_path: str) -> str:
    """Where the gRPC server listens behind the gate: beside the public
    socket, in the same directory, hidden."""
    head, tail = os.path.split(public_path)
    return os.path.join(head, f".{tail}.inner")


class _Relay(asyncio.Protocol):
    """One side of a relayed connection: what it receives goes to its
    partner; when its partner's buffer fills, it stops reading."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.partner: _Relay | None = None
        self.pending: list[bytes] = []
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        partner = self.partner
        if partner is None or partner.transport is None:
            self.pending.append(data)  # the other side is still connecting
            return
        partner.transport.write(data)

    def eof_received(self):
        if self.partner is not None and self.partner.transport is not None and not self.partner.closed:
            self.partner.transport.close()
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.partner is not None and self.partner.transport is not None and not self.partner.closed:
            self.partner.transport.close()

    def pause_writing(self) -> None:
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.resume_reading()

    def join(self, partner: "_Relay") -> None:
        self.partner, partner.partner = partner, self
        for side in (self, partner):
            for chunk in side.pending:
                side.partner.transport.write(chunk)
            side.pending.clear()


class PeerGate:
    """The public socket: identify each connection, relay it to the inner one."""

    def __init__(self, public_path: str, inner_path: str):
        self.public_path = public_path
        self.inner_path = inner_path
        self.server: asyncio.AbstractServer | None = None
        self._connecting: set[asyncio.Task] = set()

    async def start(self, listening: socket.socket) -> None:
        """Serve on an already bound and listening socket (bound by the
        caller under its umask, so it never exists with a looser mode)."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_unix_server(self._accepted, sock=listening)

    def _accepted(self) -> _Relay:
        relay = _Relay()
        loop = asyncio.get_running_loop()
        original = relay.connection_made

        def made(transport) -> None:
            original(transport)
            # Nothing is read until the inner connection exists.
            transport.pause_reading()
            task = loop.create_task(self._connect_inner(relay))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

        relay.connection_made = made
        return relay

    async def _connect_inner(self, outer: _Relay) -> None:
        transport = outer.transport
        try:
            creds = credentials_of(transport.get_extra_info("socket"))
            inner_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                inner_sock.setblocking(False)
                inner_sock.bind(f"\0{ABSTRACT_PREFIX}{creds.uid}/{creds.gid}/{creds.pid}/{secrets.token_hex(8)}")
                await asyncio.get_running_loop().sock_connect(inner_sock, self.inner_path)
                _, inner = await asyncio.get_running_loop().create_unix_connection(_Relay, sock=inner_sock)
            except BaseException:
                inner_sock.close()
                raise
        except (OSError, asyncio.CancelledError) as exc:
            log.warning("could not relay a connection", extra={"fields": {"socket": self.public_path,
                                                                          "error": str(exc)}})
            transport.close()
            return
        if outer.closed:
            inner.transport.close()
            return
        outer.join(inner)
        transport.resume_reading()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._connecting):
            task.cancel()
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
