"""What the ttrpc tests (tests/integration/test_ttrpc_*.py) share: the task
service's name and a socket path of the test's own."""

from __future__ import annotations

import pytest


TASK = "containerd.task.v2.Task"


@pytest.fixture
def sock(tmp_path):
    return str(tmp_path / "t.sock")
