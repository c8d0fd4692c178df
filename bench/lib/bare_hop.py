#!/usr/bin/env python3
"""The least a gRPC hop written in Python costs: a floor to measure crust's hops against.

A grpc.aio server on a unix socket that forwards every unary call it gets,
as raw bytes, to a backend over one grpc.aio channel, with the caller's
remaining deadline, and hands back the backend's answer or its status code
and message. Nothing else: no interceptor, log line, metric, peer check,
limit, metadata, kept answer or deferral, none of what `crust shim` and
`crust proxy` do. A forwarded call is one server call and one client call
of grpcio's asyncio stack, which is what every hop of the node chain is at
the least (crust's daemons are grpc.aio servers, docs/architecture.md).

With `--stack sync` the same hop is made of grpcio's other stack: a
grpc.server with a thread pool, whose handler makes a blocking call on a
grpc.Channel. It answers whether a hop costs less there (it does not:
docs/performance.md).

bench/csi/conformance_ratio.py runs it in front of `crust driver` (targets
`bare-hop` and `bare-hops`: one or two of these between csi-sanity and the
driver), and bench/csi/hop_cost.py as its `bare` variant, side by side with the
real chain. Not part of crust; never deployed.

    .venv/bin/python bench/lib/bare_hop.py --listen unix:///tmp/x/hop.sock --backend unix:///tmp/x/csi.sock

It stops on SIGTERM or SIGINT and removes its socket.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
from concurrent import futures

import grpc


class ForwardEveryUnaryCall(grpc.GenericRpcHandler):
    """A raw-bytes handler per method, made at the method's first call."""

    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = self.handlers.get(details.method)
        if handler is None:
            backend = self.channel.unary_unary(details.method)  # no (de)serializers: bytes in, bytes out

            async def forward(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
                try:
                    return await backend(request, timeout=context.time_remaining())
                except grpc.aio.AioRpcError as exc:
                    await context.abort(exc.code(), exc.details() or "")

            handler = self.handlers[details.method] = grpc.unary_unary_rpc_method_handler(forward)
        return handler


NO_DEADLINE = 1e9  # seconds


class ForwardEveryUnaryCallBlocking(grpc.GenericRpcHandler):
    """The same on grpcio's threaded stack: a blocking call per forwarded call."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = self.handlers.get(details.method)
        if handler is None:
            backend = self.channel.unary_unary(details.method)

            def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
                remaining = context.time_remaining()  # this stack says "no deadline" as a huge one
                try:
                    return backend(request, timeout=remaining if remaining < NO_DEADLINE else None)
                except grpc.RpcError as exc:
                    context.abort(exc.code(), exc.details() or "")

            handler = self.handlers[details.method] = grpc.unary_unary_rpc_method_handler(forward)
        return handler


def serve_blocking(listen: str, backend: str) -> None:
    channel = grpc.insecure_channel("unix://" + backend)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((ForwardEveryUnaryCallBlocking(channel),))
    server.add_insecure_port("unix://" + listen)
    server.start()
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        stopping.wait()
    finally:
        server.stop(0.2).wait()
        channel.close()
        try:
            os.unlink(listen)
        except FileNotFoundError:
            pass


def unix_path(endpoint: str, option: str) -> str:
    path = endpoint.removeprefix("unix://")
    if not path.startswith("/"):
        sys.exit(f"bare_hop.py: {option} must be unix:///ABSOLUTE/PATH, not {endpoint!r}")
    return path


async def serve(listen: str, backend: str) -> None:
    channel = grpc.aio.insecure_channel("unix://" + backend)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((ForwardEveryUnaryCall(channel),))
    server.add_insecure_port("unix://" + listen)
    await server.start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
    finally:
        await server.stop(0.2)
        await channel.close()
        try:
            os.unlink(listen)
        except FileNotFoundError:
            pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bare_hop.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", required=True, metavar="unix:///PATH", help="the socket this hop serves")
    p.add_argument("--backend", required=True, metavar="unix:///PATH", help="the socket it forwards every call to")
    p.add_argument("--stack", choices=["aio", "sync"], default="aio",
                   help="grpcio's asyncio stack (default, as crust's daemons) or its threaded one")
    args = p.parse_args(argv)
    listen, backend = unix_path(args.listen, "--listen"), unix_path(args.backend, "--backend")
    if args.stack == "sync":
        serve_blocking(listen, backend)
    else:
        asyncio.run(serve(listen, backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
