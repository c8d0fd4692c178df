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

The gate holds two descriptors per connection, and gRPC one more. So that no caller can take
the daemon's last descriptor, it relays at most per_uid_bound() connections
of one uid at a time (a connection over the bound is closed at once, with
one warning line while that uid stays at its bound), and an accept that
fails (no descriptor left, no memory) is retried after a pause that doubles
up to a second, with one line when it starts failing and one when it
accepts again, never a line or a busy loop per attempt.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
import struct
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterable

from crust.common.errors import PermissionDenied
from crust.sys import openfiles

log = logging.getLogger(__name__)

ABSTRACT_PREFIX = "crust-peer/"
_PEER_PREFIX = "unix-abstract:" + ABSTRACT_PREFIX

# Connections of one uid relayed at once, at most; fewer when the daemon's
# descriptors are few: one uid may take a quarter of them, at three a
# connection (the gate's two ends, and gRPC's end of the inner socket).
PER_UID_CONNECTIONS_MAX = 1024
# Descriptors the daemon keeps for everything but gated connections.
RESERVED_DESCRIPTORS = 64
# Pauses between failed accepts.
ACCEPT_PAUSE_FIRST = 0.01
ACCEPT_PAUSE_MAX = 1.0
# accept() errors that say a connection went away before it was taken:
# the next accept goes on at once.
_ACCEPT_RACES = {errno.EAGAIN, errno.EINTR, errno.ECONNABORTED, errno.EPROTO}


def per_uid_bound(nofile: int | None = None) -> int:
    """How many connections of one uid the gate relays at once, for a
    daemon whose soft RLIMIT_NOFILE is nofile."""
    nofile = openfiles.soft_limit() if nofile is None else nofile
    return max(16, min(PER_UID_CONNECTIONS_MAX, (nofile - RESERVED_DESCRIPTORS) // 12))


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

    def __init__(self, on_lost=None):
        self.transport: asyncio.Transport | None = None
        self.partner: _Relay | None = None
        self.pending: list[bytes] = []
        self.closed = False
        self.on_lost = on_lost

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
        if self.on_lost is not None:
            self.on_lost()
            self.on_lost = None

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


class _AcceptPause:
    """The pause after a failed accept: doubled at each failure in a row,
    reset by a success; one log line when failures start, one when they end."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self.failures = 0
        self.since = 0.0
        self.pause = ACCEPT_PAUSE_FIRST

    def failed(self, exc: OSError) -> float:
        if self.failures == 0:
            self.since = time.monotonic()
            log.warning("accept failed; retrying with pauses up to %g s", ACCEPT_PAUSE_MAX, extra={"fields": {
                "socket": self.socket_path, "error": os.strerror(exc.errno) if exc.errno else str(exc)}})
        else:
            self.pause = min(self.pause * 2, ACCEPT_PAUSE_MAX)
        self.failures += 1
        return self.pause

    def succeeded(self) -> None:
        if self.failures:
            log.warning("accepting again", extra={"fields": {
                "socket": self.socket_path, "failed_accepts": self.failures,
                "seconds": round(time.monotonic() - self.since, 2)}})
        self.failures = 0
        self.pause = ACCEPT_PAUSE_FIRST


class PeerGate:
    """The public socket: identify each connection, relay it to the inner one."""

    def __init__(self, public_path: str, inner_path: str, per_uid: int | None = None):
        self.public_path = public_path
        self.inner_path = inner_path
        self.per_uid = per_uid
        self.connections: dict[int, int] = {}  # uid -> connections relayed now
        self._at_bound_logged: set[int] = set()
        self._listening: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connecting: set[asyncio.Task] = set()

    async def start(self, listening: socket.socket) -> None:
        """Serve on an already bound, listening, non-blocking socket (bound
        by the caller under its umask, so it never exists with a looser mode)."""
        if self.per_uid is None:
            self.per_uid = per_uid_bound()
        self._listening = listening
        self._accepting = asyncio.get_running_loop().create_task(self._accept_forever(), name="peer-gate")

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        pause = _AcceptPause(self.public_path)
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listening)
            except OSError as exc:
                if exc.errno in _ACCEPT_RACES:
                    continue
                await asyncio.sleep(pause.failed(exc))
                continue
            pause.succeeded()
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            creds = credentials_of(sock)
        except OSError:
            sock.close()
            return
        held = self.connections.get(creds.uid, 0)
        if held >= self.per_uid:
            sock.close()
            if creds.uid not in self._at_bound_logged:
                self._at_bound_logged.add(creds.uid)
                log.warning("connections of one uid at their bound; closing further ones", extra={"fields": {
                    "socket": self.public_path, "uid": creds.uid, "bound": self.per_uid}})
            return
        self.connections[creds.uid] = held + 1
        task = asyncio.get_running_loop().create_task(self._relay(sock, creds))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    def _released(self, uid: int) -> None:
        left = self.connections.get(uid, 0) - 1
        if left > 0:
            self.connections[uid] = left
        else:
            self.connections.pop(uid, None)
        if left < self.per_uid:
            self._at_bound_logged.discard(uid)

    async def _relay(self, sock: socket.socket, creds: PeerCredentials) -> None:
        loop = asyncio.get_running_loop()
        outer = _Relay(on_lost=lambda: self._released(creds.uid))
        try:
            transport, _ = await loop.connect_accepted_socket(lambda: outer, sock)
        except OSError:
            sock.close()
            self._released(creds.uid)
            return
        except asyncio.CancelledError:
            sock.close()
            self._released(creds.uid)
            raise
        # Nothing is read until the inner connection exists.
        transport.pause_reading()
        try:
            inner_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                inner_sock.setblocking(False)
                inner_sock.bind(f"\0{ABSTRACT_PREFIX}{creds.uid}/{creds.gid}/{creds.pid}/{secrets.token_hex(8)}")
                await loop.sock_connect(inner_sock, self.inner_path)
                _, inner = await loop.create_unix_connection(_Relay, sock=inner_sock)
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
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        if self._listening is not None:
            self._listening.close()
        for task in list(self._connecting):
            task.cancel()
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
