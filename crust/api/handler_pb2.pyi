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

class FreezeVolumeRequest(_message.Message):
    __slots__ = ("target_path", "sandbox_id", "timeout_seconds")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    sandbox_id: str
    timeout_seconds: int
    def __init__(self, target_path: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class FreezeVolumeResponse(_message.Message):
    __slots__ = ("depth",)
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    depth: int
    def __init__(self, depth: _Optional[int] = ...) -> None: ...

class ThawVolumeRequest(_message.Message):
    __slots__ = ("target_path", "sandbox_id")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    sandbox_id: str
    def __init__(self, target_path: _Optional[str] = ..., sandbox_id: _Optional[str] = ...) -> None: ...

class ThawVolumeResponse(_message.Message):
    __slots__ = ("depth", "was_frozen")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WAS_FROZEN_FIELD_NUMBER: _ClassVar[int]
    depth: int
    was_frozen: bool
    def __init__(self, depth: _Optional[int] = ..., was_frozen: bool = ...) -> None: ...

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

class PrepareBundleRequest(_message.Message):
    __slots__ = ("container_id", "bundle", "runtime_pid", "state_dir", "log_path", "log_format")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_PID_FIELD_NUMBER: _ClassVar[int]
    STATE_DIR_FIELD_NUMBER: _ClassVar[int]
    LOG_PATH_FIELD_NUMBER: _ClassVar[int]
    LOG_FORMAT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    bundle: str
    runtime_pid: int
    state_dir: str
    log_path: str
    log_format: str
    def __init__(self, container_id: _Optional[str] = ..., bundle: _Optional[str] = ..., runtime_pid: _Optional[int] = ..., state_dir: _Optional[str] = ..., log_path: _Optional[str] = ..., log_format: _Optional[str] = ...) -> None: ...

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

class CreatePodRequest(_message.Message):
    __slots__ = ("sandbox_id", "bundle")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    bundle: str
    def __init__(self, sandbox_id: _Optional[str] = ..., bundle: _Optional[str] = ...) -> None: ...

class CreatePodResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class CreateContainerRequest(_message.Message):
    __slots__ = ("sandbox_id", "container_id", "bundle", "stdin")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    container_id: str
    bundle: str
    stdin: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., container_id: _Optional[str] = ..., bundle: _Optional[str] = ..., stdin: bool = ...) -> None: ...

class CreateContainerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProcessSpec(_message.Message):
    __slots__ = ("args", "env", "cwd", "uid", "gid", "additional_gids", "terminal", "stdin")
    ARGS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    ADDITIONAL_GIDS_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    args: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.RepeatedScalarFieldContainer[str]
    cwd: str
    uid: int
    gid: int
    additional_gids: _containers.RepeatedScalarFieldContainer[int]
    terminal: bool
    stdin: bool
    def __init__(self, args: _Optional[_Iterable[str]] = ..., env: _Optional[_Iterable[str]] = ..., cwd: _Optional[str] = ..., uid: _Optional[int] = ..., gid: _Optional[int] = ..., additional_gids: _Optional[_Iterable[int]] = ..., terminal: bool = ..., stdin: bool = ...) -> None: ...

class StartProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "process")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    process: ProcessSpec
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., process: _Optional[_Union[ProcessSpec, _Mapping]] = ...) -> None: ...

class StartProcessResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class ReadOutputRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "stdout_offset", "stderr_offset")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    STDOUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STDERR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    stdout_offset: int
    stderr_offset: int
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., stdout_offset: _Optional[int] = ..., stderr_offset: _Optional[int] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("stream", "offset", "data")
    class Stream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STREAM_UNKNOWN: _ClassVar[OutputChunk.Stream]
        STDOUT: _ClassVar[OutputChunk.Stream]
        STDERR: _ClassVar[OutputChunk.Stream]
    STREAM_UNKNOWN: OutputChunk.Stream
    STDOUT: OutputChunk.Stream
    STDERR: OutputChunk.Stream
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    stream: OutputChunk.Stream
    offset: int
    data: bytes
    def __init__(self, stream: _Optional[_Union[OutputChunk.Stream, str]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "wait")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    wait: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., wait: bool = ...) -> None: ...

class ProcessState(_message.Message):
    __slots__ = ("status", "pid", "exit_code", "exited_at_ns", "reason", "oom_killed")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNKNOWN: _ClassVar[ProcessState.Status]
        CREATED: _ClassVar[ProcessState.Status]
        RUNNING: _ClassVar[ProcessState.Status]
        STOPPED: _ClassVar[ProcessState.Status]
    STATUS_UNKNOWN: ProcessState.Status
    CREATED: ProcessState.Status
    RUNNING: ProcessState.Status
    STOPPED: ProcessState.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    status: ProcessState.Status
    pid: int
    exit_code: int
    exited_at_ns: int
    reason: str
    oom_killed: bool
    def __init__(self, status: _Optional[_Union[ProcessState.Status, str]] = ..., pid: _Optional[int] = ..., exit_code: _Optional[int] = ..., exited_at_ns: _Optional[int] = ..., reason: _Optional[str] = ..., oom_killed: bool = ...) -> None: ...

class SignalProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "signal", "all")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    signal: int
    all: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., signal: _Optional[int] = ..., all: bool = ...) -> None: ...

class SignalProcessResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class DeleteProcessResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: ProcessState
    def __init__(self, state: _Optional[_Union[ProcessState, _Mapping]] = ...) -> None: ...

class DeleteContainerRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class DeleteContainerResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: ProcessState
    def __init__(self, state: _Optional[_Union[ProcessState, _Mapping]] = ...) -> None: ...

class DeletePodRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DeletePodResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPodsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PodInfo(_message.Message):
    __slots__ = ("sandbox_id", "pid", "alive", "container_ids", "target_paths")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PATHS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    pid: int
    alive: bool
    container_ids: _containers.RepeatedScalarFieldContainer[str]
    target_paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sandbox_id: _Optional[str] = ..., pid: _Optional[int] = ..., alive: bool = ..., container_ids: _Optional[_Iterable[str]] = ..., target_paths: _Optional[_Iterable[str]] = ...) -> None: ...

class ListPodsResponse(_message.Message):
    __slots__ = ("pods",)
    PODS_FIELD_NUMBER: _ClassVar[int]
    pods: _containers.RepeatedCompositeFieldContainer[PodInfo]
    def __init__(self, pods: _Optional[_Iterable[_Union[PodInfo, _Mapping]]] = ...) -> None: ...

class WriteInputRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "offset", "data", "close")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    offset: int
    data: bytes
    close: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., close: bool = ...) -> None: ...

class WriteInputResponse(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class ResizeTerminalRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "width", "height")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    width: int
    height: int
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class ResizeTerminalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContainerStatsRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class ContainerStatsResponse(_message.Message):
    __slots__ = ("cpu", "memory", "memory_current", "memory_max", "memory_events", "pids_current", "pids_max", "timestamp_ns")
    class CpuEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemoryEventsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CURRENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MAX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PIDS_CURRENT_FIELD_NUMBER: _ClassVar[int]
    PIDS_MAX_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    cpu: _containers.ScalarMap[str, int]
    memory: _containers.ScalarMap[str, int]
    memory_current: int
    memory_max: int
    memory_events: _containers.ScalarMap[str, int]
    pids_current: int
    pids_max: int
    timestamp_ns: int
    def __init__(self, cpu: _Optional[_Mapping[str, int]] = ..., memory: _Optional[_Mapping[str, int]] = ..., memory_current: _Optional[int] = ..., memory_max: _Optional[int] = ..., memory_events: _Optional[_Mapping[str, int]] = ..., pids_current: _Optional[int] = ..., pids_max: _Optional[int] = ..., timestamp_ns: _Optional[int] = ...) -> None: ...
