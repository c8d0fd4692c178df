from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOG_LEVEL_INFO: _ClassVar[LogLevel]
    LOG_LEVEL_TRACE: _ClassVar[LogLevel]
    LOG_LEVEL_DEBUG: _ClassVar[LogLevel]
    LOG_LEVEL_WARN: _ClassVar[LogLevel]
    LOG_LEVEL_ERROR: _ClassVar[LogLevel]
    LOG_LEVEL_FATAL: _ClassVar[LogLevel]
    LOG_LEVEL_PANIC: _ClassVar[LogLevel]

class Capability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPABILITY_UNSPECIFIED: _ClassVar[Capability]
LOG_LEVEL_INFO: LogLevel
LOG_LEVEL_TRACE: LogLevel
LOG_LEVEL_DEBUG: LogLevel
LOG_LEVEL_WARN: LogLevel
LOG_LEVEL_ERROR: LogLevel
LOG_LEVEL_FATAL: LogLevel
LOG_LEVEL_PANIC: LogLevel
CAPABILITY_UNSPECIFIED: Capability

class BootstrapParams(_message.Message):
    __slots__ = ("instance_id", "namespace", "log_level", "containerd_version", "containerd_ttrpc_address", "containerd_grpc_address", "containerd_binary", "extensions", "socket_dir")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_TTRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_BINARY_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    SOCKET_DIR_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    namespace: str
    log_level: LogLevel
    containerd_version: str
    containerd_ttrpc_address: str
    containerd_grpc_address: str
    containerd_binary: str
    extensions: _containers.RepeatedCompositeFieldContainer[Extension]
    socket_dir: str
    def __init__(self, instance_id: _Optional[str] = ..., namespace: _Optional[str] = ..., log_level: _Optional[_Union[LogLevel, str]] = ..., containerd_version: _Optional[str] = ..., containerd_ttrpc_address: _Optional[str] = ..., containerd_grpc_address: _Optional[str] = ..., containerd_binary: _Optional[str] = ..., extensions: _Optional[_Iterable[_Union[Extension, _Mapping]]] = ..., socket_dir: _Optional[str] = ...) -> None: ...

class Extension(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: _any_pb2.Any
    def __init__(self, value: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class BootstrapResult(_message.Message):
    __slots__ = ("version", "address", "protocol", "capabilities", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    address: str
    protocol: str
    capabilities: _containers.RepeatedScalarFieldContainer[Capability]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, version: _Optional[int] = ..., address: _Optional[str] = ..., protocol: _Optional[str] = ..., capabilities: _Optional[_Iterable[_Union[Capability, str]]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...
