from . import csi_pb2 as _csi_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetVolumeStatsRequest(_message.Message):
    __slots__ = ("target_path", "sandbox_id")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    sandbox_id: str
    def __init__(self, target_path: _Optional[str] = ..., sandbox_id: _Optional[str] = ...) -> None: ...

class GetVolumeStatsResponse(_message.Message):
    __slots__ = ("usage", "volume_condition")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CONDITION_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[_csi_pb2.VolumeUsage]
    volume_condition: _csi_pb2.VolumeCondition
    def __init__(self, usage: _Optional[_Iterable[_Union[_csi_pb2.VolumeUsage, _Mapping]]] = ..., volume_condition: _Optional[_Union[_csi_pb2.VolumeCondition, _Mapping]] = ...) -> None: ...

class ExpandVolumeRequest(_message.Message):
    __slots__ = ("target_path", "sandbox_id", "capacity_range")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_RANGE_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    sandbox_id: str
    capacity_range: _csi_pb2.CapacityRange
    def __init__(self, target_path: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., capacity_range: _Optional[_Union[_csi_pb2.CapacityRange, _Mapping]] = ...) -> None: ...

class ExpandVolumeResponse(_message.Message):
    __slots__ = ("capacity_bytes",)
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    def __init__(self, capacity_bytes: _Optional[int] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class GetSandboxResponse(_message.Message):
    __slots__ = ("state",)
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[GetSandboxResponse.State]
        STARTING: _ClassVar[GetSandboxResponse.State]
        RUNNING: _ClassVar[GetSandboxResponse.State]
        STOPPED: _ClassVar[GetSandboxResponse.State]
        GONE: _ClassVar[GetSandboxResponse.State]
    UNKNOWN: GetSandboxResponse.State
    STARTING: GetSandboxResponse.State
    RUNNING: GetSandboxResponse.State
    STOPPED: GetSandboxResponse.State
    GONE: GetSandboxResponse.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: GetSandboxResponse.State
    def __init__(self, state: _Optional[_Union[GetSandboxResponse.State, str]] = ...) -> None: ...
