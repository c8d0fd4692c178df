"""The RPCs of tests/integration/test_hostile_input.py and the nearly valid
requests of its live set-up: what each socket serves, and the templates
(requests naming the set-up's volumes, snapshot, group snapshot, lease,
sandbox and registration) that hostile_requests.mutated changes one or two
fields of, with each RPC's hypothesis strategy and explicit attacks.
"""

from __future__ import annotations

import os
from typing import Callable

from hypothesis import strategies as st

from crust.api import csi_pb2, handler_pb2, registry_pb2, runtime_pb2
from tests.harness import hostile_requests
from tests.harness.daemons import MIB, block_cap, mount_cap

TOPOLOGY_KEY = "topology.loop.csi.crust.dev/node"


# -- what each socket serves ------------------------------------------------------------------

CSI = [csi_pb2.DESCRIPTOR.services_by_name[n] for n in
       ("Identity", "Controller", "GroupController", "Node", "SnapshotMetadata")]
SERVICES = {
    "driver": CSI,
    "shim": CSI,
    "proxy": CSI,
    "runtime": [runtime_pb2.DESCRIPTOR.services_by_name["Runtime"],
                registry_pb2.DESCRIPTOR.services_by_name["Registry"]],
    "handler": [handler_pb2.DESCRIPTOR.services_by_name["Handler"],
                handler_pb2.DESCRIPTOR.services_by_name["SandboxControl"]],
}
TARGETS = [(endpoint, service.full_name, method.name)
           for endpoint, services in SERVICES.items() for service in services for method in service.methods]


def method_of(service_name: str, method_name: str):
    for services in SERVICES.values():
        for service in services:
            if service.full_name == service_name:
                return service, service.methods_by_name[method_name]
    raise KeyError(service_name)


class Templates:
    """The requests of the live set-up, mixed into tests.harness.hostile_stack.Stack:
    they name what the Stack put in place (its vols, snapshot_id, group_id,
    lease_id, sandbox_id, place)."""

    # -- templates of nearly valid requests ---------------------------------------------------------

    def templates(self) -> dict[str, list[Callable[[], object]]]:
        v = self.vols
        H, D, B, S, X = v["host"], v["deferred"], v["block"], v["spare"], v["direct"]
        cap = lambda: mount_cap("ext4")  # noqa: E731
        rng = lambda n: csi_pb2.CapacityRange(required_bytes=n)  # noqa: E731
        return {
            "CreateVolume": [lambda: csi_pb2.CreateVolumeRequest(
                name="hostile-new", capacity_range=rng(32 * MIB), volume_capabilities=[cap()],
                parameters={"fsType": "ext4"}, accessibility_requirements=csi_pb2.TopologyRequirement(
                    requisite=[csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-a"})])),
                lambda: csi_pb2.CreateVolumeRequest(
                    name="hostile-clone", capacity_range=rng(32 * MIB), volume_capabilities=[cap()],
                    volume_content_source=csi_pb2.VolumeContentSource(
                        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=self.snapshot_id)))],
            "DeleteVolume": [lambda: csi_pb2.DeleteVolumeRequest(volume_id=S.volume_id)],
            "ControllerPublishVolume": [lambda: csi_pb2.ControllerPublishVolumeRequest(
                volume_id=H.volume_id, node_id="node-a", volume_capability=cap())],
            "ControllerUnpublishVolume": [lambda: csi_pb2.ControllerUnpublishVolumeRequest(
                volume_id=H.volume_id, node_id="node-a")],
            "ValidateVolumeCapabilities": [lambda: csi_pb2.ValidateVolumeCapabilitiesRequest(
                volume_id=H.volume_id, volume_capabilities=[cap()])],
            "ListVolumes": [lambda: csi_pb2.ListVolumesRequest(max_entries=2, starting_token="1")],
            "GetCapacity": [lambda: csi_pb2.GetCapacityRequest(
                volume_capabilities=[cap()], accessible_topology=csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-a"}))],
            "CreateSnapshot": [lambda: csi_pb2.CreateSnapshotRequest(source_volume_id=H.volume_id,
                                                                     name="hostile-snap-2")],
            "DeleteSnapshot": [lambda: csi_pb2.DeleteSnapshotRequest(snapshot_id=self.snapshot_id)],
            "ListSnapshots": [lambda: csi_pb2.ListSnapshotsRequest(source_volume_id=H.volume_id, max_entries=1)],
            "GetSnapshot": [lambda: csi_pb2.GetSnapshotRequest(snapshot_id=self.snapshot_id)],
            "ControllerExpandVolume": [lambda: csi_pb2.ControllerExpandVolumeRequest(
                volume_id=S.volume_id, capacity_range=rng(64 * MIB), volume_capability=cap())],
            "ControllerGetVolume": [lambda: csi_pb2.ControllerGetVolumeRequest(volume_id=H.volume_id)],
            "ControllerModifyVolume": [lambda: csi_pb2.ControllerModifyVolumeRequest(
                volume_id=S.volume_id, mutable_parameters={"provisioning": "thin"})],
            "ControllerGetNodeInfo": [lambda: csi_pb2.ControllerGetNodeInfoRequest(node_id="node-a")],
            "CreateVolumeGroupSnapshot": [lambda: csi_pb2.CreateVolumeGroupSnapshotRequest(
                name="hostile-group-2", source_volume_ids=[H.volume_id])],
            "DeleteVolumeGroupSnapshot": [lambda: csi_pb2.DeleteVolumeGroupSnapshotRequest(
                group_snapshot_id=self.group_id, snapshot_ids=self.group_members)],
            "GetVolumeGroupSnapshot": [lambda: csi_pb2.GetVolumeGroupSnapshotRequest(
                group_snapshot_id=self.group_id, snapshot_ids=self.group_members)],
            "GetMetadataAllocated": [lambda: csi_pb2.GetMetadataAllocatedRequest(
                snapshot_id=self.snapshot_id, max_results=10)],
            "GetMetadataDelta": [lambda: csi_pb2.GetMetadataDeltaRequest(
                base_snapshot_id=self.snapshot_id, target_snapshot_id=self.snapshot_id, max_results=10)],
            "NodeStageVolume": [lambda: csi_pb2.NodeStageVolumeRequest(
                volume_id=S.volume_id, staging_target_path=str(S.staging), volume_capability=cap()),
                lambda: csi_pb2.NodeStageVolumeRequest(
                    volume_id=B.volume_id, staging_target_path=str(B.staging), volume_capability=block_cap())],
            "NodeUnstageVolume": [lambda: csi_pb2.NodeUnstageVolumeRequest(
                volume_id=S.volume_id, staging_target_path=str(S.staging))],
            "NodePublishVolume": [lambda: csi_pb2.NodePublishVolumeRequest(
                volume_id=H.volume_id, staging_target_path=str(H.staging),
                target_path=str(self.target("p2", "pv-host")), volume_capability=cap()),
                lambda: csi_pb2.NodePublishVolumeRequest(
                    volume_id=D.volume_id, staging_target_path=str(D.staging), target_path=str(D.target),
                    volume_capability=cap(), defer_fs_ops=True),
                lambda: csi_pb2.NodePublishVolumeRequest(
                    volume_id=B.volume_id, staging_target_path=str(B.staging),
                    target_path=str(self.target("p2", "pv-block")), volume_capability=block_cap()),
                lambda: csi_pb2.NodePublishVolumeRequest(
                    volume_id=X.volume_id, staging_target_path=str(X.staging),
                    target_path=str(self.target("p2", "pv-direct")), volume_capability=cap())],
            "NodeUnpublishVolume": [lambda: csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=H.volume_id, target_path=str(self.target("p2", "pv-host"))),
                lambda: csi_pb2.NodeUnpublishVolumeRequest(
                    volume_id=X.volume_id, target_path=str(self.target("p2", "pv-direct")))],
            "NodeGetVolumeStats": [lambda x=x: csi_pb2.NodeGetVolumeStatsRequest(
                volume_id=x.volume_id, volume_path=str(x.target), staging_target_path=str(x.staging))
                for x in (H, D, B, X)],
            "NodeExpandVolume": [lambda x=x: csi_pb2.NodeExpandVolumeRequest(
                volume_id=x.volume_id, volume_path=str(x.target), staging_target_path=str(x.staging),
                capacity_range=rng(32 * MIB), volume_capability=x.cap()) for x in (H, D, X)],
            "RuntimeStageVolume": [self.runtime_stage],
            "RuntimeUnstageVolume": [lambda: runtime_pb2.RuntimeUnstageVolumeRequest(
                volume_target_path=self.runtime_target)],
            "RuntimeGetVolumeStats": [lambda: runtime_pb2.RuntimeGetVolumeStatsRequest(
                volume_target_path=str(D.target))],
            "RuntimeExpandVolume": [lambda: runtime_pb2.RuntimeExpandVolumeRequest(
                volume_target_path=str(D.target), capacity_range=rng(32 * MIB))],
            "RegisterHandler": [lambda: registry_pb2.RegisterHandlerRequest(
                name="hostile-h", endpoint=f"unix://{self.path / 'hostile-h.sock'}", filesystems=["ext4"])],
            "Heartbeat": [lambda: registry_pb2.HeartbeatRequest(name="hostile-h", lease_id=self.lease_id)],
            "UnregisterHandler": [lambda: registry_pb2.UnregisterHandlerRequest(name="hostile-h",
                                                                                lease_id=self.lease_id)],
            "ClaimVolume": [lambda: registry_pb2.ClaimVolumeRequest(
                target_path=self.runtime_target, handler="hostile-h", sandbox_id="hs1", sandbox_pid=os.getpid(),
                lease_id=self.lease_id),
                # The set-up's sandbox's volume, in its handler's name, without its lease.
                lambda: registry_pb2.ClaimVolumeRequest(
                    target_path=str(D.target), handler="mountns", sandbox_id="hs1", lease_id=self.lease_id)],
            "ReleaseVolume": [lambda: registry_pb2.ReleaseVolumeRequest(
                target_path=self.runtime_target, handler="hostile-h", sandbox_id="hs1", lease_id=self.lease_id),
                lambda: registry_pb2.ReleaseVolumeRequest(
                    target_path=str(D.target), handler="mountns", sandbox_id=self.sandbox_id,
                    lease_id=self.lease_id)],
            "ListClaims": [lambda: registry_pb2.ListClaimsRequest(handler="mountns")],
            "GetVolumeStats": [lambda: handler_pb2.GetVolumeStatsRequest(target_path=str(D.target),
                                                                         sandbox_id=self.sandbox_id)],
            "ExpandVolume": [lambda: handler_pb2.ExpandVolumeRequest(
                target_path=str(D.target), sandbox_id=self.sandbox_id, capacity_range=rng(32 * MIB))],
            "GetSandbox": [lambda: handler_pb2.GetSandboxRequest(sandbox_id=self.sandbox_id)],
            "RunSandbox": [lambda: handler_pb2.RunSandboxRequest(bundle=str(self.path / "bundles" / "plain"),
                                                                 sandbox_id="hostile-run")],
            "DeleteSandbox": [lambda: handler_pb2.DeleteSandboxRequest(sandbox_id="hostile-run")],
        }

    def strategy(self, service_name: str, method_name: str) -> st.SearchStrategy:
        key = f"{service_name}/{method_name}"
        if key not in self.strategies:
            _, method = method_of(service_name, method_name)
            desc = method.input_type
            generic = hostile_requests.message(desc, self.place)
            nearly = [hostile_requests.mutated(t, desc, self.place) for t in self.templates().get(method_name, [])
                      if t().DESCRIPTOR is desc]
            # Two thirds nearly valid: hostile values where a real request would reach the kernel.
            self.strategies[key] = st.one_of(generic, st.one_of(*nearly), st.one_of(*nearly)) if nearly else generic
        return self.strategies[key]

    def explicit(self, service_name: str, method_name: str) -> list:
        _, method = method_of(service_name, method_name)
        return hostile_requests.explicit_cases([t() for t in self.templates().get(method_name, [])],
                                               method.input_type, self.place)
