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

class RunSandboxRequest(_message.Message):
    __slots__ = ("bundle", "sandbox_id")
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    bundle: str
    sandbox_id: str
    def __init__(self, bundle: _Optional[str] = ..., sandbox_id: _Optional[str] = ...) -> None: ...

class SandboxVolume(_message.Message):
    __slots__ = ("target_path", "device", "fs_type", "mount_point", "destinations", "subpaths")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    MOUNT_POINT_FIELD_NUMBER: _ClassVar[int]
    DESTINATIONS_FIELD_NUMBER: _ClassVar[int]
    SUBPATHS_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    device: str
    fs_type: str
    mount_point: str
    destinations: _containers.RepeatedScalarFieldContainer[str]
    subpaths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target_path: _Optional[str] = ..., device: _Optional[str] = ..., fs_type: _Optional[str] = ..., mount_point: _Optional[str] = ..., destinations: _Optional[_Iterable[str]] = ..., subpaths: _Optional[_Iterable[str]] = ...) -> None: ...

class SandboxInfo(_message.Message):
    __slots__ = ("sandbox_id", "state", "pid", "process_pid", "exited", "exit_code", "volumes", "bundle")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_PID_FIELD_NUMBER: _ClassVar[int]
    EXITED_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    VOLUMES_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    state: GetSandboxResponse.State
    pid: int
    process_pid: int
    exited: bool
    exit_code: int
    volumes: _containers.RepeatedCompositeFieldContainer[SandboxVolume]
    bundle: str
    def __init__(self, sandbox_id: _Optional[str] = ..., state: _Optional[_Union[GetSandboxResponse.State, str]] = ..., pid: _Optional[int] = ..., process_pid: _Optional[int] = ..., exited: bool = ..., exit_code: _Optional[int] = ..., volumes: _Optional[_Iterable[_Union[SandboxVolume, _Mapping]]] = ..., bundle: _Optional[str] = ...) -> None: ...

class RunSandboxResponse(_message.Message):
    __slots__ = ("sandbox",)
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    sandbox: SandboxInfo
    def __init__(self, sandbox: _Optional[_Union[SandboxInfo, _Mapping]] = ...) -> None: ...

class DeleteSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DeleteSandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxInfo]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[SandboxInfo, _Mapping]]] = ...) -> None: ...

class ContainerMount(_message.Message):
    __slots__ = ("destination", "type", "source", "options")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    destination: str
    type: str
    source: str
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, destination: _Optional[str] = ..., type: _Optional[str] = ..., source: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ...) -> None: ...

class PrepareContainerRequest(_message.Message):
    __slots__ = ("container_id", "sandbox_id", "bundle", "mounts", "runtime_pid")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_PID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    sandbox_id: str
    bundle: str
    mounts: _containers.RepeatedCompositeFieldContainer[ContainerMount]
    runtime_pid: int
    def __init__(self, container_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., bundle: _Optional[str] = ..., mounts: _Optional[_Iterable[_Union[ContainerMount, _Mapping]]] = ..., runtime_pid: _Optional[int] = ...) -> None: ...

class DeferredContainerMount(_message.Message):
    __slots__ = ("destination", "target_path", "device", "fs_type", "options", "readonly")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    destination: str
    target_path: str
    device: str
    fs_type: str
    options: _containers.RepeatedScalarFieldContainer[str]
    readonly: bool
    def __init__(self, destination: _Optional[str] = ..., target_path: _Optional[str] = ..., device: _Optional[str] = ..., fs_type: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ..., readonly: bool = ...) -> None: ...

class PrepareContainerResponse(_message.Message):
    __slots__ = ("mounts",)
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    mounts: _containers.RepeatedCompositeFieldContainer[DeferredContainerMount]
    def __init__(self, mounts: _Optional[_Iterable[_Union[DeferredContainerMount, _Mapping]]] = ...) -> None: ...

class ContainerCreatedRequest(_message.Message):
    __slots__ = ("container_id", "pid")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    pid: int
    def __init__(self, container_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ContainerCreatedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseContainerRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class ReleaseContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListContainersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerInfo(_message.Message):
    __slots__ = ("container_id", "sandbox_id", "state", "pid", "alive", "mounts")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    MOUNTS_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    sandbox_id: str
    state: str
    pid: int
    alive: bool
    mounts: _containers.RepeatedCompositeFieldContainer[DeferredContainerMount]
    def __init__(self, container_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., state: _Optional[str] = ..., pid: _Optional[int] = ..., alive: bool = ..., mounts: _Optional[_Iterable[_Union[DeferredContainerMount, _Mapping]]] = ...) -> None: ...

class ListContainersResponse(_message.Message):
    __slots__ = ("containers",)
    CONTAINERS_FIELD_NUMBER: _ClassVar[int]
    containers: _containers.RepeatedCompositeFieldContainer[ContainerInfo]
    def __init__(self, containers: _Optional[_Iterable[_Union[ContainerInfo, _Mapping]]] = ...) -> None: ...
