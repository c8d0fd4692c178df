"""Prometheus metrics of a crust daemon, served over HTTP on a port of its own.

Every daemon exports `crust_rpc_duration_seconds{component,method,code}`
(crust.common.grpcserver), a histogram: its `_count` series is the number of
calls by method and status code, its buckets their latency. Daemons add their
own series (the driver's pools, the proxy's volumes and handlers).
"""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)

# Loopback unless the operator says otherwise: metrics name volumes and
# paths, and a node port is reachable by every pod with host networking.
DEFAULT_ADDRESS = "127.0.0.1"


def serve(port: int, address: str = DEFAULT_ADDRESS) -> None:
    """Serve /metrics on address:port; port 0 means off."""
    if not port:
        return
    start_http_server(port, addr=address)
    log.info("serving metrics", extra={"fields": {"address": address, "port": port}})
