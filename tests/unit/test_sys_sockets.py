"""Whether a unix socket has a listener (crust.sys.sockets)."""

from __future__ import annotations

import socket

from crust.sys.sockets import socket_alive


def test_socket_alive(tmp_path):
    path = str(tmp_path / "s.sock")
    assert not socket_alive(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        assert socket_alive(path)
    finally:
        listener.close()
    assert not socket_alive(path)
