"""Socket endpoints (crust.common.endpoint): the forms accepted and the
removal of a stale socket, never of anything else.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from crust.common import endpoint


@pytest.mark.parametrize("value, path", [
    ("unix:///run/csi/csi.sock", "/run/csi/csi.sock"),
    ("unix:/run/csi/csi.sock", "/run/csi/csi.sock"),
    ("/run/csi/csi.sock", "/run/csi/csi.sock"),
    ("unix:///run/csi/../x.sock", "/run/x.sock"),
    ("unix:///run//csi/./csi.sock", "/run/csi/csi.sock"),
])
def test_socket_path_forms(value, path):
    assert endpoint.socket_path(value) == path
    assert endpoint.grpc_target(value) == "unix://" + path


@pytest.mark.parametrize("value, words", [
    ("tcp://127.0.0.1:10000", "only unix"),
    ("csi.sock", "only unix"),
    ("", "only unix"),
    ("unix://relative/csi.sock", "absolute"),
    ("unix:relative.sock", "absolute"),
    ("unix://", "absolute"),
])
def test_socket_path_errors(value, words):
    with pytest.raises(ValueError) as info:
        endpoint.socket_path(value)
    assert words in str(info.value)
    assert repr(value) in str(info.value)


def test_clear_stale_socket(tmp_path):
    path = str(tmp_path / "s.sock")
    endpoint.clear_stale_socket(path)  # nothing there: fine
    # A socket nobody listens on is removed.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    endpoint.clear_stale_socket(path)
    assert not os.path.lexists(path)
    # A live one is refused and kept.
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        live.bind(path)
        live.listen(1)
        with pytest.raises(RuntimeError, match="another server"):
            endpoint.clear_stale_socket(path)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
    finally:
        live.close()
    os.unlink(path)
    # Something that is not a socket is never removed.
    Path(path).write_text("precious")
    with pytest.raises(RuntimeError, match="not a socket"):
        endpoint.clear_stale_socket(path)
    assert Path(path).read_text() == "precious"
