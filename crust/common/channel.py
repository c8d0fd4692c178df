"""Client channels to a neighbour daemon on this node's unix sockets.

gRPC's defaults are made for remote servers: a channel that failed to
connect backs off for up to two minutes, and channels to the same address
share one connection (subchannel) process-wide, backoff included. Next door,
a daemon that restarts is back within a second, and a fresh channel made for
the restarted daemon must not inherit the backoff of the one that watched it
die. So these channels keep their own connection and retry within a second.

gRPC names the time a connection attempt is given to finish its handshake
(the server's first HTTP/2 SETTINGS frame) `grpc.min_reconnect_backoff_ms`;
it is left at gRPC's 20 s: a daemon on a loaded node may take more than a
fraction of a second to answer a new connection, and a shorter bound fails
the call UNAVAILABLE although the daemon is up. A daemon that is down
refuses the connection at once, so the retry pace is the backoff's alone.
"""

from __future__ import annotations

import grpc

from crust.common.endpoint import grpc_target

LOCAL_CHANNEL_OPTIONS = (
    # A private connection: a new channel starts afresh.
    ("grpc.use_local_subchannel_pool", 1),
    # Reconnect after 100 ms, backing off to at most 1 s.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def local_aio_channel(endpoint: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(grpc_target(endpoint), options=LOCAL_CHANNEL_OPTIONS)


def local_channel(endpoint: str, max_receive_bytes: int = 0) -> grpc.Channel:
    """max_receive_bytes: the largest answer taken (gRPC's default, 4 MiB, when 0)."""
    options = LOCAL_CHANNEL_OPTIONS
    if max_receive_bytes:
        options += (("grpc.max_receive_message_length", max_receive_bytes),)
    return grpc.insecure_channel(grpc_target(endpoint), options=options)
