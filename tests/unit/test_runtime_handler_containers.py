"""The pod's sandbox process read from a container's namespaces
(crust.runtime_handler.containers).
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("namespaces, expected", [
    # containerd's CRI plugin: the pod's network, ipc and uts, by its sandbox process.
    ([{"type": "pid"}, {"type": "ipc", "path": "/proc/4242/ns/ipc"}, {"type": "uts", "path": "/proc/4242/ns/uts"},
      {"type": "mount"}, {"type": "network", "path": "/proc/4242/ns/net"}], 4242),
    ([{"type": "ipc", "path": "/proc/4242/ns/ipc"}], 4242),
    # Two processes named: neither is certainly the pod's.
    ([{"type": "ipc", "path": "/proc/4242/ns/ipc"}, {"type": "uts", "path": "/proc/4343/ns/uts"}], 0),
    # The node's init, pinned namespaces (CRI-O), the host's namespaces, other paths.
    ([{"type": "ipc", "path": "/proc/1/ns/ipc"}], 0),
    ([{"type": "ipc", "path": "/var/run/ipcns/0d8f"}, {"type": "network", "path": "/var/run/netns/cni-1"}], 0),
    ([{"type": "pid"}, {"type": "mount"}], 0),
    ([{"type": "ipc", "path": "/proc/self/ns/ipc"}, {"type": "ipc", "path": "/proc/042/ns/ipc"}], 0),
    ([{"type": "ipc", "path": "/proc/4242/ns/mnt"}, {"type": "ipc", "path": "/proc/4242/ns/ipc/"}], 0),
    # What a hostile or broken spec may hold instead.
    ("namespaces", 0), ([7, None, {"path": 5}, {"type": "ipc", "path": ["/proc/4242/ns/ipc"]}], 0),
])
def test_the_pods_sandbox_process_is_read_from_the_namespaces_a_container_joins(namespaces, expected):
    from crust.runtime_handler.containers import pod_process
    assert pod_process({"linux": {"namespaces": namespaces}}) == expected
    assert pod_process({}) == pod_process({"linux": "x"}) == 0
