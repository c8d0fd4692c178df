"""Channels to a neighbour daemon (crust.common.channel) on real unix
sockets: a daemon slow to answer a new connection is waited for, a daemon
that is down is reported at once."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from crust.common.channel import local_channel

# How long the relay holds the server's first bytes (its SETTINGS frame):
# what a daemon on a busy node may take to answer a new connection.
HANDSHAKE_DELAY = 0.6


class SlowHandshakeRelay:
    """A unix socket in front of a server that passes every byte both ways,
    the server's first ones only after HANDSHAKE_DELAY."""

    def __init__(self, path: Path, server_path: Path):
        self.server_path = server_path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(str(self.server_path))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, HANDSHAKE_DELAY), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay: float) -> None:
        try:
            first = True
            while data := source.recv(65536):
                if first and delay:
                    time.sleep(delay)
                first = False
                sink.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


@pytest.fixture
def health_server(tmp_path):
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    path = tmp_path / "server.sock"
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        yield path
    finally:
        server.stop(0)


def test_a_daemon_slow_to_answer_a_new_connection_is_waited_for(tmp_path, health_server):
    relay = SlowHandshakeRelay(tmp_path / "relay.sock", health_server)
    try:
        with local_channel(f"unix://{tmp_path / 'relay.sock'}") as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        relay.close()


def test_a_daemon_that_is_down_is_reported_at_once(tmp_path):
    started = time.monotonic()
    with local_channel(f"unix://{tmp_path / 'nobody.sock'}") as channel, pytest.raises(grpc.RpcError) as failed:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    # Far below the call's 10 s: no connection to wait for.
    assert time.monotonic() - started < 5
