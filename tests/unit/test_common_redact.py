"""Secrets kept out of logs (crust.common.redact), at any depth of a message."""

from __future__ import annotations

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor

from crust.api import csi_pb2
from crust.common.redact import MASK, redacted

SECRETS = {"password": "hunter2", "token": "s3cr3t"}


def _no_secret_left(obj) -> None:
    text = repr(obj)
    for value in SECRETS.values():
        assert value not in text


def test_redacted_strips_top_level_secrets_and_keeps_the_rest():
    stage = csi_pb2.NodeStageVolumeRequest(
        volume_id="vol-1", staging_target_path="/s", secrets=SECRETS, volume_context={"fsType": "ext4"},
        publish_context={"node": "a"})
    out = redacted(stage)
    _no_secret_left(out)
    assert out["secrets"] == {"password": MASK, "token": MASK}
    assert out["volume_id"] == "vol-1" and out["staging_target_path"] == "/s"
    assert out["volume_context"] == {"fsType": "ext4"} and out["publish_context"] == {"node": "a"}
    assert stage.secrets["password"] == "hunter2"  # the request itself is untouched

    create = csi_pb2.CreateVolumeRequest(
        name="pvc-1", secrets=SECRETS, parameters={"provisioning": "thin"},
        capacity_range=csi_pb2.CapacityRange(required_bytes=5))
    out = redacted(create)
    _no_secret_left(out)
    assert out["secrets"] == {"password": MASK, "token": MASK}
    assert out["name"] == "pvc-1" and out["parameters"] == {"provisioning": "thin"}
    assert out["capacity_range"] == {"required_bytes": "5"}

    snap = csi_pb2.CreateSnapshotRequest(source_volume_id="vol-1", name="s", secrets=SECRETS,
                                         parameters={"k": "v"})
    out = redacted(snap)
    _no_secret_left(out)
    assert out["secrets"] == {"password": MASK, "token": MASK}
    assert out["parameters"] == {"k": "v"} and out["source_volume_id"] == "vol-1"


def test_every_csi_secrets_field_is_marked():
    # redacted() relies on the option: every `secrets` field must carry it.
    found = 0
    for msg in csi_pb2.DESCRIPTOR.message_types_by_name.values():
        for field in msg.fields:
            if field.name == "secrets":
                assert field.GetOptions().Extensions[csi_pb2.csi_secret], msg.full_name
                found += 1
    assert found >= 15


@pytest.fixture(scope="module")
def wrapper_class():
    """A message nesting CSI requests at depth (singular, repeated, map) and
    holding secret fields of other types, built at run time."""
    pool = descriptor_pool.Default()
    fdp = descriptor_pb2.FileDescriptorProto(name="crust_test_redact.proto", package="crusttest",
                                             syntax="proto3", dependency=[csi_pb2.DESCRIPTOR.name])
    msg = fdp.message_type.add(name="Wrapper")
    entry = msg.nested_type.add(name="ByNameEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=FieldDescriptor.TYPE_STRING, label=FieldDescriptor.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=FieldDescriptor.TYPE_MESSAGE, label=FieldDescriptor.LABEL_OPTIONAL,
                    type_name=".csi.v1.CreateSnapshotRequest")
    msg.field.add(name="stage", number=1, type=FieldDescriptor.TYPE_MESSAGE, label=FieldDescriptor.LABEL_OPTIONAL,
                  type_name=".csi.v1.NodeStageVolumeRequest")
    msg.field.add(name="creates", number=2, type=FieldDescriptor.TYPE_MESSAGE,
                  label=FieldDescriptor.LABEL_REPEATED, type_name=".csi.v1.CreateVolumeRequest")
    msg.field.add(name="by_name", number=3, type=FieldDescriptor.TYPE_MESSAGE,
                  label=FieldDescriptor.LABEL_REPEATED, type_name=".crusttest.Wrapper.ByNameEntry")
    token = msg.field.add(name="token", number=4, type=FieldDescriptor.TYPE_STRING,
                          label=FieldDescriptor.LABEL_OPTIONAL)
    token.options.Extensions[csi_pb2.csi_secret] = True
    pin = msg.field.add(name="pin", number=5, type=FieldDescriptor.TYPE_INT64, label=FieldDescriptor.LABEL_OPTIONAL)
    pin.options.Extensions[csi_pb2.csi_secret] = True
    msg.field.add(name="note", number=6, type=FieldDescriptor.TYPE_STRING, label=FieldDescriptor.LABEL_OPTIONAL)
    msg.field.add(name="inner", number=7, type=FieldDescriptor.TYPE_MESSAGE, label=FieldDescriptor.LABEL_OPTIONAL,
                  type_name=".crusttest.Wrapper")
    try:
        desc = pool.FindMessageTypeByName("crusttest.Wrapper")
    except KeyError:
        pool.AddSerializedFile(fdp.SerializeToString())
        desc = pool.FindMessageTypeByName("crusttest.Wrapper")
    return message_factory.GetMessageClass(desc)


def test_redacted_strips_secrets_at_any_depth(wrapper_class):
    W = wrapper_class
    inner = W(
        stage=csi_pb2.NodeStageVolumeRequest(volume_id="vol-deep", secrets=SECRETS),
        creates=[csi_pb2.CreateVolumeRequest(name="a", secrets=SECRETS),
                 csi_pb2.CreateVolumeRequest(name="b", parameters={"p": "1"})],
        token="s3cr3t", pin=1234567, note="visible",
    )
    inner.by_name["x"].CopyFrom(csi_pb2.CreateSnapshotRequest(name="snap-x", secrets=SECRETS))
    outer = W(inner=inner, stage=csi_pb2.NodeStageVolumeRequest(volume_id="vol-top", secrets=SECRETS))
    out = redacted(outer)
    _no_secret_left(out)
    assert "1234567" not in repr(out)
    assert out["stage"] == {"volume_id": "vol-top", "secrets": {"password": MASK, "token": MASK}}
    deep = out["inner"]
    assert deep["stage"]["secrets"] == {"password": MASK, "token": MASK}
    assert deep["stage"]["volume_id"] == "vol-deep"
    assert deep["creates"][0] == {"name": "a", "secrets": {"password": MASK, "token": MASK}}
    assert deep["creates"][1] == {"name": "b", "parameters": {"p": "1"}}
    assert deep["by_name"]["x"] == {"name": "snap-x", "secrets": {"password": MASK, "token": MASK}}
    assert deep["token"] == MASK
    assert "pin" not in deep
    assert deep["note"] == "visible"
    assert outer.inner.token == "s3cr3t"  # original untouched
