"""Distributed provisioning: two nodes on one machine, each a `crust node`
with its own node id, kubelet root, run and state directories (nothing in
common), each the controller of its own pool, as a node-deployed
external-provisioner drives it. Each makes, publishes, grows and deletes its
own volumes, refuses the other's with the CSI status the spec names, and
reports its own capacity, topology and metrics."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from crust.api import csi_pb2, csi_pb2_grpc
from crust.kubelet import Kubelet, PersistentVolume, Pod
from tests.harness.daemons import MIB, code_of, mount_cap
from tests.harness.node_run import NodeRun

TOPOLOGY_KEY = "topology.loop.csi.crust.dev/node"
CtlRPC = csi_pb2.ControllerServiceCapability.RPC


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DistributedNode:
    def __init__(self, base: Path, node_id: str):
        self.node_id = node_id
        root = base / node_id
        root.mkdir()
        self.driver_metrics, self.proxy_metrics = free_port(), free_port()
        config = root / "node.yaml"
        config.write_text(f"""
nodeId: {node_id}
kubeletRoot: {root / 'kubelet'}
runDir: {root / 'run'}
stateDir: {root / 'state'}
driver: {{distributed: true, capacity: 2Gi, metricsPort: {self.driver_metrics}}}
proxy: {{metricsPort: {self.proxy_metrics}}}
""")
        self.root = root
        self.run = NodeRun(root, config)
        self.run.wait_serving()
        self.kubelet = Kubelet(root / "kubelet", node_id, retry_seconds=2)
        self.kubelet.register()
        self.channel = grpc.insecure_channel(f"unix://{self.kubelet.endpoint}")
        self.ctl = csi_pb2_grpc.ControllerStub(self.channel)

    def topology(self, node_id: str | None = None) -> csi_pb2.Topology:
        return csi_pb2.Topology(segments={TOPOLOGY_KEY: node_id or self.node_id})

    def create(self, name: str, on: str | None = None, fs: str = "xfs") -> csi_pb2.Volume:
        """CreateVolume as a node-deployed provisioner sends it (strict topology)."""
        return self.ctl.CreateVolume(csi_pb2.CreateVolumeRequest(
            name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=320 * MIB),
            volume_capabilities=[mount_cap(fs)],
            accessibility_requirements=csi_pb2.TopologyRequirement(requisite=[self.topology(on)],
                                                                   preferred=[self.topology(on)])),
            timeout=60).volume

    def capacity(self, node_id: str) -> int:
        return self.ctl.GetCapacity(csi_pb2.GetCapacityRequest(
            volume_capabilities=[mount_cap("xfs")], accessible_topology=self.topology(node_id)),
            timeout=10).available_capacity

    def metrics(self, port: int) -> dict[tuple[str, tuple], float]:
        """{(sample name, sorted labels): value} scraped from 127.0.0.1:port."""
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def close(self) -> None:
        self.channel.close()
        self.run.stop()


@pytest.fixture
def two_nodes(root):
    nodes = []
    try:
        nodes.append(DistributedNode(root.path, "node-a"))
        nodes.append(DistributedNode(root.path, "node-b"))
        yield nodes
    finally:
        for n in nodes:
            n.close()


def test_two_nodes_each_serve_only_their_own_volumes(two_nodes):
    a, b = two_nodes
    assert not set(os.listdir(a.root)) & {str(b.root)}, "the nodes share no directory"
    for n in (a, b):
        assert sorted(p.name for p in (n.root / "state" / "driver" / "pools").iterdir()) == [n.node_id]
        info = n.kubelet.node("NodeGetInfo", csi_pb2.NodeGetInfoRequest())
        assert (info.node_id, dict(info.accessible_topology.segments)) == (n.node_id, {TOPOLOGY_KEY: n.node_id})
        caps = {c.rpc.type for c in n.ctl.ControllerGetCapabilities(
            csi_pb2.ControllerGetCapabilitiesRequest(), timeout=10).capabilities}
        assert CtlRPC.CREATE_DELETE_VOLUME in caps and CtlRPC.GET_CAPACITY in caps
        assert not caps & {CtlRPC.PUBLISH_UNPUBLISH_VOLUME, CtlRPC.EXPAND_VOLUME}, \
            "no attacher or resizer of another node may ever need this controller"

    # Capacity: each node reports its own pool and nothing of the other's.
    assert a.capacity("node-a") == 2 * 1024**3 and a.capacity("node-b") == 0
    assert b.capacity("node-b") == 2 * 1024**3 and b.capacity("node-a") == 0

    # Create: each only on itself; the other's topology cannot be satisfied here.
    va = a.create("pvc-a")
    assert dict(va.accessible_topology[0].segments) == {TOPOLOGY_KEY: "node-a"}
    assert code_of(a.create, "pvc-a-on-b", on="node-b") == grpc.StatusCode.RESOURCE_EXHAUSTED
    vb = b.create("pvc-b")
    assert a.capacity("node-a") == 2 * 1024**3 - 320 * MIB

    # Publish: a's volume on node a; node b does not know it.
    pv_a = PersistentVolume(name="pv-a", volume_handle=va.volume_id, attributes=dict(va.volume_context),
                            fs_type="xfs")
    pod = Pod(uid="uid-a", name="app")
    target = a.kubelet.start_pod(pv_a, pod)
    (target / "data").write_bytes(b"a" * 4096)
    with pytest.raises(grpc.RpcError) as other:
        b.kubelet.mount_device(pv_a, pod)
    assert other.value.code() == grpc.StatusCode.NOT_FOUND
    assert code_of(b.ctl.ControllerPublishVolume, csi_pb2.ControllerPublishVolumeRequest(
        volume_id=va.volume_id, node_id="node-b", volume_capability=mount_cap("xfs")), timeout=10) \
        == grpc.StatusCode.NOT_FOUND
    assert code_of(b.ctl.CreateSnapshot, csi_pb2.CreateSnapshotRequest(
        name="snap-of-a", source_volume_id=va.volume_id), timeout=10) == grpc.StatusCode.NOT_FOUND

    # Growth at the node (the external-resizer's node-only mode): kubelet's
    # NodeExpandVolume grows the backing file, the device and the file system.
    before = os.statvfs(target)
    grown = a.kubelet.expand(pv_a, pod, 640 * MIB)
    assert grown == 640 * MIB
    after = os.statvfs(target)
    assert after.f_blocks * after.f_frsize > before.f_blocks * before.f_frsize
    assert a.capacity("node-a") == 2 * 1024**3 - 640 * MIB
    listed = {v.volume.volume_id: v.volume.capacity_bytes for v in a.ctl.ListVolumes(
        csi_pb2.ListVolumesRequest(), timeout=10).entries}
    assert listed == {va.volume_id: 640 * MIB}

    # Metrics: the pool and the RPCs of each node.
    pools = {k: v for k, v in a.metrics(a.driver_metrics).items() if k[0].startswith("crust_driver_")}
    assert pools == {("crust_driver_pool_capacity_bytes", (("node", "node-a"),)): 2 * 1024**3,
                     ("crust_driver_pool_free_bytes", (("node", "node-a"),)): 2 * 1024**3 - 640 * MIB,
                     ("crust_driver_volumes", (("node", "node-a"),)): 1}
    proxy = a.metrics(a.proxy_metrics)
    stage = ("crust_rpc_duration_seconds_count", (("code", "OK"), ("component", "proxy-csi"),
                                                  ("method", "/csi.v1.Node/NodeStageVolume")))
    assert proxy.get(stage) == 1, sorted(k for k in proxy if k[0] == "crust_rpc_duration_seconds_count")

    # Delete: b deleting a's volume id touches nothing of a's (CSI: an
    # unknown volume is already deleted, OK); a deletes its own.
    a.kubelet.stop_pod(pv_a, pod)
    b.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=va.volume_id), timeout=10)
    backing = a.root / "state" / "driver" / "pools" / "node-a" / "volumes" / f"{va.volume_id}.img"
    assert backing.exists(), "node b's delete reached node a's volume"
    a.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=va.volume_id), timeout=30)
    assert not backing.exists()
    b.ctl.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vb.volume_id), timeout=30)
    assert a.capacity("node-a") == b.capacity("node-b") == 2 * 1024**3
