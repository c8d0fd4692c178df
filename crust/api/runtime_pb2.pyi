from . import csi_pb2 as _csi_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RuntimeStageVolumeRequest(_message.Message):
    __slots__ = ("volume_type", "volume_target_path", "volume_backing_path", "fs_type", "mount_flags", "volume_supplemental_group", "volume_supplemental_group_change_policy", "readonly", "volume_id", "capacity_bytes", "device_major", "device_minor", "volume_context")
    class VolumeType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UNKNOWN: _ClassVar[RuntimeStageVolumeRequest.VolumeType]
        BLOCK: _ClassVar[RuntimeStageVolumeRequest.VolumeType]
        NETWORK: _ClassVar[RuntimeStageVolumeRequest.VolumeType]
    UNKNOWN: RuntimeStageVolumeRequest.VolumeType
    BLOCK: RuntimeStageVolumeRequest.VolumeType
    NETWORK: RuntimeStageVolumeRequest.VolumeType
    class FsGroupChangePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        POLICY_UNKNOWN: _ClassVar[RuntimeStageVolumeRequest.FsGroupChangePolicy]
        ALWAYS: _ClassVar[RuntimeStageVolumeRequest.FsGroupChangePolicy]
        ON_ROOT_MISMATCH: _ClassVar[RuntimeStageVolumeRequest.FsGroupChangePolicy]
    POLICY_UNKNOWN: RuntimeStageVolumeRequest.FsGroupChangePolicy
    ALWAYS: RuntimeStageVolumeRequest.FsGroupChangePolicy
    ON_ROOT_MISMATCH: RuntimeStageVolumeRequest.FsGroupChangePolicy
    class VolumeContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VOLUME_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOLUME_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    VOLUME_BACKING_PATH_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    MOUNT_FLAGS_FIELD_NUMBER: _ClassVar[int]
    VOLUME_SUPPLEMENTAL_GROUP_FIELD_NUMBER: _ClassVar[int]
    VOLUME_SUPPLEMENTAL_GROUP_CHANGE_POLICY_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MAJOR_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MINOR_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    volume_type: RuntimeStageVolumeRequest.VolumeType
    volume_target_path: str
    volume_backing_path: str
    fs_type: str
    mount_flags: _containers.RepeatedScalarFieldContainer[str]
    volume_supplemental_group: str
    volume_supplemental_group_change_policy: RuntimeStageVolumeRequest.FsGroupChangePolicy
    readonly: bool
    volume_id: str
    capacity_bytes: int
    device_major: int
    device_minor: int
    volume_context: _containers.ScalarMap[str, str]
    def __init__(self, volume_type: _Optional[_Union[RuntimeStageVolumeRequest.VolumeType, str]] = ..., volume_target_path: _Optional[str] = ..., volume_backing_path: _Optional[str] = ..., fs_type: _Optional[str] = ..., mount_flags: _Optional[_Iterable[str]] = ..., volume_supplemental_group: _Optional[str] = ..., volume_supplemental_group_change_policy: _Optional[_Union[RuntimeStageVolumeRequest.FsGroupChangePolicy, str]] = ..., readonly: bool = ..., volume_id: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., device_major: _Optional[int] = ..., device_minor: _Optional[int] = ..., volume_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RuntimeStageVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RuntimeUnstageVolumeRequest(_message.Message):
    __slots__ = ("volume_target_path",)
    VOLUME_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    volume_target_path: str
    def __init__(self, volume_target_path: _Optional[str] = ...) -> None: ...

class RuntimeUnstageVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RuntimeGetVolumeStatsRequest(_message.Message):
    __slots__ = ("volume_target_path",)
    VOLUME_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    volume_target_path: str
    def __init__(self, volume_target_path: _Optional[str] = ...) -> None: ...

class RuntimeGetVolumeStatsResponse(_message.Message):
    __slots__ = ("usage", "volume_condition")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    VOLUME_CONDITION_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[_csi_pb2.VolumeUsage]
    volume_condition: _csi_pb2.VolumeCondition
    def __init__(self, usage: _Optional[_Iterable[_Union[_csi_pb2.VolumeUsage, _Mapping]]] = ..., volume_condition: _Optional[_Union[_csi_pb2.VolumeCondition, _Mapping]] = ...) -> None: ...

class RuntimeExpandVolumeRequest(_message.Message):
    __slots__ = ("volume_target_path", "capacity_range")
    VOLUME_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_RANGE_FIELD_NUMBER: _ClassVar[int]
    volume_target_path: str
    capacity_range: _csi_pb2.CapacityRange
    def __init__(self, volume_target_path: _Optional[str] = ..., capacity_range: _Optional[_Union[_csi_pb2.CapacityRange, _Mapping]] = ...) -> None: ...

class RuntimeExpandVolumeResponse(_message.Message):
    __slots__ = ("capacity_bytes",)
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    def __init__(self, capacity_bytes: _Optional[int] = ...) -> None: ...

class RuntimeFreezeVolumeRequest(_message.Message):
    __slots__ = ("volume_id", "timeout_seconds", "policy")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    timeout_seconds: int
    policy: str
    def __init__(self, volume_id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ..., policy: _Optional[str] = ...) -> None: ...

class FrozenTarget(_message.Message):
    __slots__ = ("volume_target_path", "sandbox_id", "handler", "depth", "was_frozen", "frozen", "error")
    VOLUME_TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WAS_FROZEN_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    volume_target_path: str
    sandbox_id: str
    handler: str
    depth: int
    was_frozen: bool
    frozen: bool
    error: str
    def __init__(self, volume_target_path: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., handler: _Optional[str] = ..., depth: _Optional[int] = ..., was_frozen: bool = ..., frozen: bool = ..., error: _Optional[str] = ...) -> None: ...

class RuntimeFreezeVolumeResponse(_message.Message):
    __slots__ = ("frozen",)
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    frozen: _containers.RepeatedCompositeFieldContainer[FrozenTarget]
    def __init__(self, frozen: _Optional[_Iterable[_Union[FrozenTarget, _Mapping]]] = ...) -> None: ...

class RuntimeThawVolumeRequest(_message.Message):
    __slots__ = ("volume_id", "volume_target_paths")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    VOLUME_TARGET_PATHS_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    volume_target_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, volume_id: _Optional[str] = ..., volume_target_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class RuntimeThawVolumeResponse(_message.Message):
    __slots__ = ("thawed",)
    THAWED_FIELD_NUMBER: _ClassVar[int]
    thawed: _containers.RepeatedCompositeFieldContainer[FrozenTarget]
    def __init__(self, thawed: _Optional[_Iterable[_Union[FrozenTarget, _Mapping]]] = ...) -> None: ...
