"""Bounds every request to a crust daemon must keep, checked before any
servicer sees it (by the interceptor in crust.common.grpcserver).

The servicers check what each field means; this checks what any field of
any message may be, so that no value a servicer did not expect can reach a
file system call, a log line or a record and end in INTERNAL:

- an enum holds one of its declared values (proto3 keeps unknown numbers,
  and naming one, e.g. in an error message, raises);
- a string is at most MAX_STRING bytes (PATH_MAX: the longest field crust
  takes is a path) and holds no NUL (no kernel interface takes one);
  secrets are opaque and forwarded as they are, so their values may, and
  may be as long as the map's whole budget (certificates, kubeconfigs);
- a repeated field has at most MAX_REPEATED entries;
- a map has at most MAX_MAP_ENTRIES entries and MAX_MAP_BYTES of keys and
  values together;
- a process's args and env (ProcessSpec) are what the kernel takes for an
  execve: any number of strings of at most MAX_ARG_STRING bytes each, at
  most MAX_ARG_TOTAL in all. A pod in a namespace with many Services gets
  hundreds of service-link variables, and a `sh -c` script is one long
  argument: runc takes them, so crust does.

The CSI spec suggests tighter limits (128-byte strings, 4 KiB maps) and lets
a plugin enforce them; the shim and the proxy wrap drivers that do not keep
to them (long volume ids exist), so these bounds are looser, and the driver
checks its own ids more tightly (crust.common.csi_input).

Each violation is INVALID_ARGUMENT naming the field by its path in the
request, e.g. volume_capabilities[0].access_mode.mode.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from crust.common.errors import InvalidArgument

MAX_STRING = 4096
MAX_REPEATED = 256
MAX_MAP_ENTRIES = 256
MAX_MAP_BYTES = 64 * 1024
# Linux's MAX_ARG_STRLEN (32 pages, the terminating NUL included) and the
# ARG_MAX that a default 8 MiB stack gives (a quarter of it).
MAX_ARG_STRING = 32 * 4096 - 1
MAX_ARG_TOTAL = 2 * 1024 * 1024
_PROCESS_MESSAGES = {"ProcessSpec"}
_PROCESS_FIELDS = {"args", "env"}

# Fields whose values are opaque to crust and only forwarded.
_OPAQUE_MAPS = {"secrets"}


def check(message: Message, prefix: str = "") -> None:
    """Raise InvalidArgument for the first field out of bounds."""
    process = message.DESCRIPTOR.name in _PROCESS_MESSAGES
    if process:
        _check_process(message, prefix)
    for field, value in message.ListFields():
        name = prefix + field.name
        if process and field.name in _PROCESS_FIELDS:
            continue   # checked by _check_process
        if _is_map(field):
            _check_map(field, value, name)
        elif _is_repeated(field):
            if len(value) > MAX_REPEATED:
                raise InvalidArgument(f"{name} has {len(value)} entries; at most {MAX_REPEATED} are allowed")
            for i, item in enumerate(value):
                _check_value(field, item, f"{name}[{i}]")
        else:
            _check_value(field, value, name)


def _check_process(message: Message, prefix: str) -> None:
    total = 0
    for field_name in sorted(_PROCESS_FIELDS):
        for i, item in enumerate(getattr(message, field_name)):
            _check_string(item, f"{prefix}{field_name}[{i}]", allow_nul=False, limit=MAX_ARG_STRING)
            total += len(item.encode("utf-8", "surrogatepass")) + 1
    if total > MAX_ARG_TOTAL:
        raise InvalidArgument(f"{prefix}args and {prefix}env hold {total} bytes; at most {MAX_ARG_TOTAL} are "
                              "allowed (the kernel's ARG_MAX)")


def _is_repeated(field: FieldDescriptor) -> bool:
    # protobuf 6.32 deprecates `label` for the `is_repeated` property.
    repeated = getattr(field, "is_repeated", None)
    return repeated if isinstance(repeated, bool) else field.label == FieldDescriptor.LABEL_REPEATED


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.has_options
            and field.message_type.GetOptions().map_entry)


def _check_map(field: FieldDescriptor, value, name: str) -> None:
    if len(value) > MAX_MAP_ENTRIES:
        raise InvalidArgument(f"{name} has {len(value)} entries; at most {MAX_MAP_ENTRIES} are allowed")
    value_field = field.message_type.fields_by_name["value"]
    total = 0
    for key, item in value.items():
        if isinstance(key, str):
            _check_string(key, f"{name} key", allow_nul=False)
            total += len(key.encode("utf-8", "surrogatepass"))
        if value_field.type == FieldDescriptor.TYPE_MESSAGE:
            check(item, f"{name}[{key!r}].")
        elif isinstance(item, str):
            _check_string(item, f"{name}[{key!r}]", allow_nul=field.name in _OPAQUE_MAPS,
                          limit=MAX_MAP_BYTES if field.name in _OPAQUE_MAPS else MAX_STRING)
            total += len(item.encode("utf-8", "surrogatepass"))
        else:
            _check_value(value_field, item, f"{name}[{key!r}]")
    if total > MAX_MAP_BYTES:
        raise InvalidArgument(f"{name} holds {total} bytes of keys and values; at most {MAX_MAP_BYTES} are allowed")


def _check_value(field: FieldDescriptor, value, name: str) -> None:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        check(value, name + ".")
    elif field.type == FieldDescriptor.TYPE_ENUM:
        if value not in field.enum_type.values_by_number:
            raise InvalidArgument(f"{name} is {value}, not a value of {field.enum_type.name} "
                                  f"(known: {', '.join(v.name for v in field.enum_type.values)})")
    elif field.type == FieldDescriptor.TYPE_STRING:
        _check_string(value, name, allow_nul=False)
    elif field.type == FieldDescriptor.TYPE_BYTES and len(value) > MAX_STRING:
        raise InvalidArgument(f"{name} is {len(value)} bytes; at most {MAX_STRING} are allowed")


def _check_string(value: str, name: str, *, allow_nul: bool, limit: int = MAX_STRING) -> None:
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise InvalidArgument(f"{name} is {size} bytes; at most {limit} are allowed")
    if not allow_nul and "\x00" in value:
        raise InvalidArgument(f"{name} contains a NUL character")
