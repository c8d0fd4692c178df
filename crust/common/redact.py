"""Strip secrets from protobuf messages before they are logged.

The CSI proto marks every secret field with the (csi.v1.csi_secret) option;
the registry's lease (a handler's bearer secret) is a secret too. This walks
a message and replaces the values of such fields, at any depth, so a secret
can never reach a log line.
"""

from __future__ import annotations

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from crust.api import csi_pb2, registry_pb2

MASK = "***stripped***"

# Every lease_id of the registry's messages, and the passphrase of an
# encrypted volume in a claim's answer.
_LEASE_FIELDS = frozenset(
    f.full_name for m in registry_pb2.DESCRIPTOR.message_types_by_name.values() for f in m.fields
    if f.name in ("lease_id", "volume_passphrase"))


# What a field is, by its full name: reading a descriptor's options costs
# more than the rest of the walk, and a daemon logs the same few messages.
_SECRET: dict[str, bool] = {}
_MAP_ENTRY: dict[str, bool] = {}


def _is_secret(field: FieldDescriptor) -> bool:
    secret = _SECRET.get(field.full_name)
    if secret is None:
        secret = _SECRET[field.full_name] = (field.full_name in _LEASE_FIELDS
                                             or bool(field.GetOptions().Extensions[csi_pb2.csi_secret]))
    return secret


def _is_map(field: FieldDescriptor) -> bool:
    """A map field (its message type is a map entry)."""
    is_map = _MAP_ENTRY.get(field.full_name)
    if is_map is None:
        is_map = _MAP_ENTRY[field.full_name] = field.message_type.GetOptions().map_entry
    return is_map


def _scrub(message: Message) -> None:
    for field, value in message.ListFields():
        if _is_secret(field):
            if field.message_type is not None and _is_map(field):
                for key in list(value.keys()):
                    value[key] = MASK
            elif field.type == FieldDescriptor.TYPE_STRING:
                setattr(message, field.name, MASK)
            else:
                message.ClearField(field.name)
            continue
        if field.type != FieldDescriptor.TYPE_MESSAGE:
            continue
        if _is_map(field):
            if field.message_type.fields_by_name["value"].type == FieldDescriptor.TYPE_MESSAGE:
                for item in value.values():
                    _scrub(item)
        elif field.is_repeated:
            for item in value:
                _scrub(item)
        else:
            _scrub(value)


def redacted(message: Message) -> dict:
    """A JSON-ready dict of the message with every secret replaced."""
    copy = type(message)()
    copy.CopyFrom(message)
    _scrub(copy)
    return json_format.MessageToDict(copy, preserving_proto_field_name=True)
