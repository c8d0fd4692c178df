"""What containerd hands the shim's `start` and `-info`, and what they answer.

`start` is on the path of every container start, so its input is decoded
here without the protobuf library (its import would be most of a start's
time); `-info` runs once per runtime and containerd, and uses the stubs.

containerd's `start` input, on standard input:
- 1.6 to 2.2: the runtime's options alone, a serialized google.protobuf.Any
  (specs/containerd_runtimeoptions.proto); the rest comes from the flags and
  $TTRPC_ADDRESS.
- 2.3 and later: BootstrapParams (specs/containerd_bootstrap.proto), the
  options one of its `extensions`, beside the socket directory, containerd's
  addresses and the log level. An Any parses as BootstrapParams too (its
  type_url in field 1, its value in field 2), so the input is taken as
  BootstrapParams only when those two fields equal the `-id` and
  `-namespace` flags, as containerd's own shims decide. `start` then answers
  with a BootstrapResult instead of the bare address.

`-info` (containerd 2.2 and later, before creating a task of a runtime that
is not runc's): the runtime's options (maybe none) on standard input, a
RuntimeInfo on standard output (specs/containerd_introspection.proto).
"""

from __future__ import annotations

import sys

OPTIONS_TYPE = "runtimeoptions.v1.Options"
SHIM_NAME = "io.containerd.crust.v2"
# BootstrapParams.log_level at or below this asks for debug logs (DEBUG -4, TRACE -8).
LOG_LEVEL_DEBUG = -4


class StartInput:
    """What `start` takes from its standard input. (No dataclass: its
    import would cost `start` more than all of this module.)"""

    def __init__(self, options: bytes = b"", bootstrap: bool = False, socket_dir: str = "",
                 ttrpc_address: str = "", grpc_address: str = "", debug: bool = False):
        self.options = options              # the serialized Any of the runtime options; b"" for none
        self.bootstrap = bootstrap          # containerd 2.3's BootstrapParams (answered with a BootstrapResult)
        self.socket_dir = socket_dir
        self.ttrpc_address = ttrpc_address
        self.grpc_address = grpc_address
        self.debug = debug


def read_start_input(data: bytes, task_id: str, namespace: str) -> StartInput:
    """The runtime options and settings in `start`'s input, whichever form
    containerd used; anything else is the 1.6 form (an Any, maybe broken,
    which crust.containerd_shim.options.configured_endpoint then
    reports and ignores)."""
    try:
        fields = message_fields(data)
    except ValueError:
        return StartInput(options=data)
    strings = {number: value for number, wire, value in fields if wire == 2}
    if not data or strings.get(1) != task_id.encode() or strings.get(2) != namespace.encode():
        return StartInput(options=data)
    found = StartInput(bootstrap=True, socket_dir=_text(strings.get(9)), ttrpc_address=_text(strings.get(5)),
                       grpc_address=_text(strings.get(6)))
    for number, wire, value in fields:
        if number == 3 and wire == 0:
            found.debug = _signed(value) <= LOG_LEVEL_DEBUG
        elif number == 8 and wire == 2 and not found.options:
            any_bytes = message_strings(value).get(1, b"")   # Extension.value
            if message_strings(any_bytes).get(1, b"").decode(errors="replace").endswith(OPTIONS_TYPE):
                found.options = any_bytes
    return found


def bootstrap_result(address: str) -> bytes:
    """BootstrapResult{version: 2, address, protocol: "ttrpc"}, serialized."""
    return b"\x08\x02" + _string_field(2, address) + _string_field(3, "ttrpc")


def runtime_info(options: bytes) -> bytes:
    """The serialized RuntimeInfo `-info` prints: the shim's name and
    version, and back the options when they are crust's. No OCI features
    (no user namespaces, no idmapped or recursive read-only mounts for a
    VM's containers) and no mount types of containerd's to hand over."""
    from google.protobuf import any_pb2

    from crust import __version__
    from crust.api import containerd_introspection_pb2 as introspection

    info = introspection.RuntimeInfo(name=SHIM_NAME, version=introspection.RuntimeVersion(version=__version__))
    if options:
        given = any_pb2.Any()
        try:
            given.ParseFromString(options)
        except Exception as exc:  # the answer does not depend on them
            print(f"crust shim -info: runtime options not understood: {exc}", file=sys.stderr)
        else:
            if given.type_url.endswith(OPTIONS_TYPE):
                info.options.CopyFrom(given)
    return info.SerializeToString()


# -- protobuf's wire format ------------------------------------------------------------------


def message_fields(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """The fields of one protobuf message in its wire format, in order:
    (number, wire type, value): an int for a varint, the bytes otherwise.
    ValueError for bytes that are no message."""
    fields: list[tuple[int, int, int | bytes]] = []
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire_type == 0:
            value, at = _varint(data, at)
            fields.append((number, 0, value))
            continue
        if wire_type == 1:
            size = 8
        elif wire_type == 5:
            size = 4
        elif wire_type == 2:
            size, at = _varint(data, at)
        else:
            raise ValueError(f"field {number}: wire type {wire_type} is not supported")
        if at + size > len(data):
            raise ValueError(f"field {number} runs past the message's end")
        fields.append((number, wire_type, data[at:at + size]))
        at += size
    return fields


def message_strings(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields (strings, bytes, messages) of one
    message by number; for a field given twice the last, as protobuf's
    parser keeps for a string. Fields of the other wire types are skipped."""
    return {number: value for number, wire, value in message_fields(data) if wire == 2}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("a varint runs past the message's end")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _signed(value: int) -> int:
    """An int32 enum on the wire: a negative one is sign-extended to 64 bits."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value else ""


def _string_field(number: int, text: str) -> bytes:
    data = text.encode()
    size = len(data)
    length = bytearray()
    while True:
        if size < 0x80:
            length.append(size)
            break
        length.append((size & 0x7F) | 0x80)
        size >>= 7
    return bytes([number << 3 | 2]) + bytes(length) + data
