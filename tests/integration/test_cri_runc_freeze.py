"""A crust-runc pod's deferred volume frozen and thawed through the proxy's
Runtime API: the handler reaches the file system through the container's
root (it is mounted in the container's mount namespace only), and the
pod's writes stop while it is frozen and go on after the thaw. Kubelet's
CRI side replayed against a private containerd (tests/cri_harness.py)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from crust.api import runtime_pb2, runtime_pb2_grpc
from tests.harness.cri import cri_node
from tests.harness.daemons import wait_until

# A record per loop, each synced; its number printed every 20.
WRITER = ("i=0; while :; do i=$((i+1)); echo $i > /data/n && sync /data/n; "
          "[ $((i % 20)) -eq 0 ] && echo REC $i; done")


def written(log_path: str) -> int:
    found = re.findall(r"REC (\d+)", Path(log_path).read_text(errors="replace"))
    return int(found[-1]) if found else 0


def test_a_crust_runc_containers_volume_freezes_and_thaws_through_its_root(root):
    with cri_node(root) as node:
        pv = node.pv("pv-frz", "ext4", size=128 * 1024**2)
        pod = node.pod("frz", pv, WRITER)
        node.kubelet.start_pod(pv, pod)
        node.runtime.run_pod(pod)
        container = node.container(pod)
        wait_until(lambda: written(container.log_path) >= 40, timeout=60, what="the pod's first records")
        with node.proxy.runtime_channel() as channel:
            rt = runtime_pb2_grpc.RuntimeStub(channel)
            frozen = rt.RuntimeFreezeVolume(runtime_pb2.RuntimeFreezeVolumeRequest(
                volume_id=pv.volume_handle, timeout_seconds=60), timeout=30).frozen
            assert [(f.handler, f.frozen, f.depth) for f in frozen] == [("mountns", True, 1)]
            time.sleep(1.0)   # what was in flight settles
            held = written(container.log_path)
            time.sleep(2.0)
            assert written(container.log_path) <= held + 20, "the pod wrote on while its volume was frozen"
            thawed = rt.RuntimeThawVolume(runtime_pb2.RuntimeThawVolumeRequest(volume_id=pv.volume_handle),
                                          timeout=30).thawed
            assert [(t.depth, t.was_frozen) for t in thawed] == [(0, True)]
            wait_until(lambda: written(container.log_path) >= held + 60, timeout=30, what="the writes to go on")
        node.runtime.kill_pod(pod)
        node.runtime.remove_pod(pod)
        node.kubelet.stop_pod(pv, pod)
