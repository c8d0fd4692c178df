"""Bounded reads of small regular files (crust.common.saferead), and what
they refuse.
"""

from __future__ import annotations

import os
import socket

import pytest
from pydantic import BaseModel

from tests.unit.helpers import MIB


class _Small(BaseModel):
    name: str
    size: int


def test_read_bounded_reads_a_small_regular_file(tmp_path):
    from crust.common import saferead
    (tmp_path / "f").write_bytes(b'{"name": "a", "size": 1}')
    assert saferead.read_bounded(tmp_path / "f") == b'{"name": "a", "size": 1}'
    assert saferead.read_model(_Small, tmp_path / "f") == _Small(name="a", size=1)
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert saferead.read_model(_Small, "f", dir_fd=dir_fd).size == 1
    finally:
        os.close(dir_fd)
    with pytest.raises(FileNotFoundError):
        saferead.read_bounded(tmp_path / "missing")


def test_read_bounded_refuses_what_is_not_a_small_regular_file(tmp_path):
    from crust.common import saferead
    (tmp_path / "target").write_text("secret")
    os.symlink(tmp_path / "target", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would hang here
    (tmp_path / "dir").mkdir()
    with open(tmp_path / "big", "wb") as f:
        f.truncate(8 * MIB)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for name, words in (("link", "symlink"), ("fifo", "FIFO"), ("dir", "directory"), ("big", "8388608 bytes"),
                            ("sock", "not a regular file")):
            with pytest.raises(saferead.Refused) as info:
                saferead.read_bounded(tmp_path / name)
            assert words in str(info.value) and str(tmp_path / name) in str(info.value)
        with pytest.raises(saferead.Refused, match="symlink"):
            saferead.read_bounded(tmp_path / "link", 10)
        with pytest.raises(saferead.Refused, match="character device"):
            saferead.read_bounded("/dev/null")
        assert saferead.read_bounded(tmp_path / "target", 6) == b"secret"
        with pytest.raises(saferead.Refused, match="more than the 5"):
            saferead.read_bounded(tmp_path / "target", 5)
    finally:
        sock.close()


@pytest.mark.parametrize("data, words", [
    (b"", "is empty"), (b"  \n", "is empty"), (b"not json", "is not a _Small"),
    (b'{"name": "a", "si', "is not a _Small"), (b'{"name": 1, "size": "x"}', "name"),
    (b"[1, 2]", "is not a _Small"), (b"\xff\xfe", "is not a _Small"),
])
def test_read_model_refuses_what_does_not_parse(tmp_path, data, words):
    from crust.common import saferead
    (tmp_path / "f").write_bytes(data)
    with pytest.raises(saferead.Refused) as info:
        saferead.read_model(_Small, tmp_path / "f")
    assert words in str(info.value)
    assert isinstance(info.value, ValueError)
