"""Wire facts of specs/csi.proto as compiled into crust.api.csi_pb2: field
numbers, enum values, the alpha additions and complete services.
"""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from crust.api import csi_pb2

D = csi_pb2.DESCRIPTOR


def _field(message: str, name: str):
    desc = D.message_types_by_name[message.split(".")[0]]
    for part in message.split(".")[1:]:
        desc = desc.nested_types_by_name[part]
    return desc.fields_by_name[name]


def test_package():
    assert D.package == "csi.v1"
    assert D.services_by_name["Node"].full_name == "csi.v1.Node"
    assert D.services_by_name["Controller"].full_name == "csi.v1.Controller"


def test_alpha_enum_values():
    node = csi_pb2.NodeServiceCapability.RPC.Type
    assert node.Value("DEFER_FS_OPS") == 7
    assert node.Value("DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP") == 8
    assert node.Value("DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY") == 9
    assert node.Value("GET_ID") == 10
    ctrl = csi_pb2.ControllerServiceCapability.RPC.Type
    assert ctrl.Value("GET_NODE_INFO") == 16
    enum = D.message_types_by_name["NodeServiceCapability"].nested_types_by_name["RPC"].enum_types_by_name["Type"]
    for name in ("DEFER_FS_OPS", "DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP",
                 "DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY", "GET_ID"):
        assert enum.values_by_name[name].GetOptions().Extensions[csi_pb2.alpha_enum_value]


def test_upstream_enum_values():
    node = csi_pb2.NodeServiceCapability.RPC.Type
    assert [node.Value(n) for n in ("UNKNOWN", "STAGE_UNSTAGE_VOLUME", "GET_VOLUME_STATS", "EXPAND_VOLUME",
                                    "VOLUME_CONDITION", "SINGLE_NODE_MULTI_WRITER", "VOLUME_MOUNT_GROUP")] == \
        list(range(7))
    ctrl = csi_pb2.ControllerServiceCapability.RPC.Type
    upstream = ["UNKNOWN", "CREATE_DELETE_VOLUME", "PUBLISH_UNPUBLISH_VOLUME", "LIST_VOLUMES", "GET_CAPACITY",
                "CREATE_DELETE_SNAPSHOT", "LIST_SNAPSHOTS", "CLONE_VOLUME", "PUBLISH_READONLY", "EXPAND_VOLUME",
                "LIST_VOLUMES_PUBLISHED_NODES", "VOLUME_CONDITION", "GET_VOLUME", "SINGLE_NODE_MULTI_WRITER",
                "MODIFY_VOLUME", "GET_SNAPSHOT"]
    assert [ctrl.Value(n) for n in upstream] == list(range(16))
    mode = csi_pb2.VolumeCapability.AccessMode.Mode
    assert [mode.Value(n) for n in ("UNKNOWN", "SINGLE_NODE_WRITER", "SINGLE_NODE_READER_ONLY",
                                    "MULTI_NODE_READER_ONLY", "MULTI_NODE_SINGLE_WRITER", "MULTI_NODE_MULTI_WRITER",
                                    "SINGLE_NODE_SINGLE_WRITER", "SINGLE_NODE_MULTI_WRITER")] == list(range(8))


@pytest.mark.parametrize("message, name, number", [
    ("NodePublishVolumeRequest", "defer_fs_ops", 9),
    ("NodeUnpublishVolumeRequest", "defer_fs_ops", 3),
    ("NodeGetVolumeStatsRequest", "defer_fs_ops", 4),
    ("NodeExpandVolumeRequest", "defer_fs_ops", 7),
])
def test_defer_fs_ops_fields(message, name, number):
    field = _field(message, name)
    assert field.number == number
    assert field.type == FieldDescriptor.TYPE_BOOL
    assert field.GetOptions().Extensions[csi_pb2.alpha_field]


def test_alpha_fields_and_messages():
    group = _field("VolumeCapability.MountVolume", "volume_supplemental_group")
    policy = _field("VolumeCapability.MountVolume", "volume_supplemental_group_change_policy")
    assert (group.number, policy.number) == (4, 5)
    assert group.type == policy.type == FieldDescriptor.TYPE_STRING
    deferred = _field("NodePublishVolumeResponse", "deferred_mount")
    assert deferred.number == 1000
    assert deferred.message_type.full_name == "csi.v1.DeferredMount"
    assert deferred.GetOptions().Extensions[csi_pb2.alpha_field]
    assert _field("NodeExpandVolumeRequest", "secrets").number == 6


def test_alpha_rpcs_exist():
    node = D.services_by_name["Node"].methods_by_name["NodeGetID"]
    assert node.input_type.full_name == "csi.v1.NodeGetIDRequest"
    assert node.output_type.full_name == "csi.v1.NodeGetIDResponse"
    ctrl = D.services_by_name["Controller"].methods_by_name["ControllerGetNodeInfo"]
    assert ctrl.input_type.full_name == "csi.v1.ControllerGetNodeInfoRequest"
    assert ctrl.output_type.full_name == "csi.v1.ControllerGetNodeInfoResponse"
    # and the generated gRPC stubs carry them
    from crust.api import csi_pb2_grpc
    assert hasattr(csi_pb2_grpc.NodeServicer, "NodeGetID")
    assert hasattr(csi_pb2_grpc.ControllerServicer, "ControllerGetNodeInfo")


@pytest.mark.parametrize("message, numbers", [
    ("CreateVolumeRequest", {"name": 1, "capacity_range": 2, "volume_capabilities": 3, "parameters": 4,
                             "secrets": 5, "volume_content_source": 6, "accessibility_requirements": 7,
                             "mutable_parameters": 8}),
    ("NodeStageVolumeRequest", {"volume_id": 1, "publish_context": 2, "staging_target_path": 3,
                                "volume_capability": 4, "secrets": 5, "volume_context": 6}),
    ("NodePublishVolumeRequest", {"volume_id": 1, "publish_context": 2, "staging_target_path": 3,
                                  "target_path": 4, "volume_capability": 5, "readonly": 6, "secrets": 7,
                                  "volume_context": 8}),
    ("NodeUnpublishVolumeRequest", {"volume_id": 1, "target_path": 2}),
    ("NodeGetVolumeStatsRequest", {"volume_id": 1, "volume_path": 2, "staging_target_path": 3}),
    ("NodeExpandVolumeRequest", {"volume_id": 1, "volume_path": 2, "capacity_range": 3,
                                 "staging_target_path": 4, "volume_capability": 5, "secrets": 6}),
    ("CreateVolumeResponse", {"volume": 1}),
    ("Volume", {"capacity_bytes": 1, "volume_id": 2, "volume_context": 3, "content_source": 4,
                "accessible_topology": 5}),
    ("CapacityRange", {"required_bytes": 1, "limit_bytes": 2}),
    ("VolumeCapability", {"block": 1, "mount": 2, "access_mode": 3}),
    ("VolumeCapability.MountVolume", {"fs_type": 1, "mount_flags": 2, "volume_mount_group": 3}),
    ("CreateSnapshotRequest", {"source_volume_id": 1, "name": 2, "secrets": 3, "parameters": 4}),
    ("DeleteVolumeRequest", {"volume_id": 1, "secrets": 2}),
    ("ListVolumesRequest", {"max_entries": 1, "starting_token": 2}),
    ("NodeGetInfoResponse", {"node_id": 1, "max_volumes_per_node": 2, "accessible_topology": 3}),
])
def test_upstream_field_numbers(message, numbers):
    got = {name: _field(message, name).number for name in numbers}
    assert got == numbers


def test_upstream_services_are_complete():
    methods = {s.name: sorted(m.name for m in s.methods) for s in D.services_by_name.values()}
    assert methods["Identity"] == ["GetPluginCapabilities", "GetPluginInfo", "Probe"]
    assert methods["Node"] == sorted(["NodeStageVolume", "NodeUnstageVolume", "NodePublishVolume",
                                      "NodeUnpublishVolume", "NodeGetVolumeStats", "NodeExpandVolume",
                                      "NodeGetCapabilities", "NodeGetInfo", "NodeGetID"])
    assert {"CreateVolume", "DeleteVolume", "ControllerPublishVolume", "ControllerUnpublishVolume",
            "ValidateVolumeCapabilities", "ListVolumes", "GetCapacity", "ControllerGetCapabilities",
            "CreateSnapshot", "DeleteSnapshot", "ListSnapshots", "GetSnapshot", "ControllerExpandVolume",
            "ControllerGetVolume", "ControllerModifyVolume", "ControllerGetNodeInfo"} == set(methods["Controller"])
