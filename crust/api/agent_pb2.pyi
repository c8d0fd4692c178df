from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GuestDetailsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GuestDetailsResponse(_message.Message):
    __slots__ = ("capabilities", "agent_name", "agent_version", "image_id", "kernel_release", "uptime_ms", "limits", "cpus", "memory_bytes")
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ID_FIELD_NUMBER: _ClassVar[int]
    KERNEL_RELEASE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    agent_name: str
    agent_version: str
    image_id: str
    kernel_release: str
    uptime_ms: int
    limits: Limits
    cpus: int
    memory_bytes: int
    def __init__(self, capabilities: _Optional[_Iterable[str]] = ..., agent_name: _Optional[str] = ..., agent_version: _Optional[str] = ..., image_id: _Optional[str] = ..., kernel_release: _Optional[str] = ..., uptime_ms: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., cpus: _Optional[int] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_message_bytes", "max_read_bytes", "stream_buffer_bytes", "stdin_buffer_bytes", "max_in_flight", "output_grace_ms", "exited_execs_kept")
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDIN_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    EXITED_EXECS_KEPT_FIELD_NUMBER: _ClassVar[int]
    max_message_bytes: int
    max_read_bytes: int
    stream_buffer_bytes: int
    stdin_buffer_bytes: int
    max_in_flight: int
    output_grace_ms: int
    exited_execs_kept: int
    def __init__(self, max_message_bytes: _Optional[int] = ..., max_read_bytes: _Optional[int] = ..., stream_buffer_bytes: _Optional[int] = ..., stdin_buffer_bytes: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., output_grace_ms: _Optional[int] = ..., exited_execs_kept: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("seconds", "nanos", "seed")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NANOS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    seconds: int
    nanos: int
    seed: bytes
    def __init__(self, seconds: _Optional[int] = ..., nanos: _Optional[int] = ..., seed: _Optional[bytes] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("clock_step_nanos",)
    CLOCK_STEP_NANOS_FIELD_NUMBER: _ClassVar[int]
    clock_step_nanos: int
    def __init__(self, clock_step_nanos: _Optional[int] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PowerOffRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PowerOffResponse(_message.Message):
    __slots__ = ("unmounted", "failed")
    UNMOUNTED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    unmounted: int
    failed: int
    def __init__(self, unmounted: _Optional[int] = ..., failed: _Optional[int] = ...) -> None: ...

class Disk(_message.Message):
    __slots__ = ("serial", "scsi")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    SCSI_FIELD_NUMBER: _ClassVar[int]
    serial: str
    scsi: ScsiAddress
    def __init__(self, serial: _Optional[str] = ..., scsi: _Optional[_Union[ScsiAddress, _Mapping]] = ...) -> None: ...

class ScsiAddress(_message.Message):
    __slots__ = ("channel", "target", "lun")
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LUN_FIELD_NUMBER: _ClassVar[int]
    channel: int
    target: int
    lun: int
    def __init__(self, channel: _Optional[int] = ..., target: _Optional[int] = ..., lun: _Optional[int] = ...) -> None: ...

class FsGroup(_message.Message):
    __slots__ = ("gid", "policy")
    class ChangePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CHANGE_POLICY_UNSPECIFIED: _ClassVar[FsGroup.ChangePolicy]
        ALWAYS: _ClassVar[FsGroup.ChangePolicy]
        ON_ROOT_MISMATCH: _ClassVar[FsGroup.ChangePolicy]
    CHANGE_POLICY_UNSPECIFIED: FsGroup.ChangePolicy
    ALWAYS: FsGroup.ChangePolicy
    ON_ROOT_MISMATCH: FsGroup.ChangePolicy
    GID_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    gid: int
    policy: FsGroup.ChangePolicy
    def __init__(self, gid: _Optional[int] = ..., policy: _Optional[_Union[FsGroup.ChangePolicy, str]] = ...) -> None: ...

class Storage(_message.Message):
    __slots__ = ("volume_id", "disk", "encrypted", "fs_type", "options", "readonly", "fs_group", "mount_point")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    FS_GROUP_FIELD_NUMBER: _ClassVar[int]
    MOUNT_POINT_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    disk: Disk
    encrypted: str
    fs_type: str
    options: _containers.RepeatedScalarFieldContainer[str]
    readonly: bool
    fs_group: FsGroup
    mount_point: str
    def __init__(self, volume_id: _Optional[str] = ..., disk: _Optional[_Union[Disk, _Mapping]] = ..., encrypted: _Optional[str] = ..., fs_type: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ..., readonly: bool = ..., fs_group: _Optional[_Union[FsGroup, _Mapping]] = ..., mount_point: _Optional[str] = ...) -> None: ...

class SharePath(_message.Message):
    __slots__ = ("tag", "path", "submounts")
    TAG_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SUBMOUNTS_FIELD_NUMBER: _ClassVar[int]
    tag: str
    path: str
    submounts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tag: _Optional[str] = ..., path: _Optional[str] = ..., submounts: _Optional[_Iterable[str]] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("volume_id", "share", "pod_tmpfs", "mirror", "subpath", "strict")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    POD_TMPFS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_FIELD_NUMBER: _ClassVar[int]
    SUBPATH_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    share: SharePath
    pod_tmpfs: str
    mirror: str
    subpath: str
    strict: bool
    def __init__(self, volume_id: _Optional[str] = ..., share: _Optional[_Union[SharePath, _Mapping]] = ..., pod_tmpfs: _Optional[str] = ..., mirror: _Optional[str] = ..., subpath: _Optional[str] = ..., strict: bool = ...) -> None: ...

class Bind(_message.Message):
    __slots__ = ("mount_index", "source", "readonly")
    MOUNT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    mount_index: int
    source: Source
    readonly: bool
    def __init__(self, mount_index: _Optional[int] = ..., source: _Optional[_Union[Source, _Mapping]] = ..., readonly: bool = ...) -> None: ...

class CreateContainerRequest(_message.Message):
    __slots__ = ("container_id", "oci_spec", "rootfs", "storages", "binds", "pod_pid_namespace", "stdin")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    OCI_SPEC_FIELD_NUMBER: _ClassVar[int]
    ROOTFS_FIELD_NUMBER: _ClassVar[int]
    STORAGES_FIELD_NUMBER: _ClassVar[int]
    BINDS_FIELD_NUMBER: _ClassVar[int]
    POD_PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    oci_spec: bytes
    rootfs: Source
    storages: _containers.RepeatedCompositeFieldContainer[Storage]
    binds: _containers.RepeatedCompositeFieldContainer[Bind]
    pod_pid_namespace: bool
    stdin: bool
    def __init__(self, container_id: _Optional[str] = ..., oci_spec: _Optional[bytes] = ..., rootfs: _Optional[_Union[Source, _Mapping]] = ..., storages: _Optional[_Iterable[_Union[Storage, _Mapping]]] = ..., binds: _Optional[_Iterable[_Union[Bind, _Mapping]]] = ..., pod_pid_namespace: bool = ..., stdin: bool = ...) -> None: ...

class CreateContainerResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class StartContainerRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class StartContainerResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class RemoveContainerRequest(_message.Message):
    __slots__ = ("container_id", "timeout_ms")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    timeout_ms: int
    def __init__(self, container_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class RemoveContainerResponse(_message.Message):
    __slots__ = ("unread_bytes",)
    UNREAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    unread_bytes: int
    def __init__(self, unread_bytes: _Optional[int] = ...) -> None: ...

class StatsContainerRequest(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class StatsContainerResponse(_message.Message):
    __slots__ = ("cpu_stat", "memory_stat", "memory_current", "memory_max", "memory_events", "pids_current", "pids_max", "timestamp_ns")
    class CpuStatEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class MemoryStatEntry(_message.Message):
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
    CPU_STAT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STAT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_CURRENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MAX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PIDS_CURRENT_FIELD_NUMBER: _ClassVar[int]
    PIDS_MAX_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    cpu_stat: _containers.ScalarMap[str, int]
    memory_stat: _containers.ScalarMap[str, int]
    memory_current: int
    memory_max: int
    memory_events: _containers.ScalarMap[str, int]
    pids_current: int
    pids_max: int
    timestamp_ns: int
    def __init__(self, cpu_stat: _Optional[_Mapping[str, int]] = ..., memory_stat: _Optional[_Mapping[str, int]] = ..., memory_current: _Optional[int] = ..., memory_max: _Optional[int] = ..., memory_events: _Optional[_Mapping[str, int]] = ..., pids_current: _Optional[int] = ..., pids_max: _Optional[int] = ..., timestamp_ns: _Optional[int] = ...) -> None: ...

class ExecProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "process", "stdin")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    process: bytes
    stdin: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., process: _Optional[bytes] = ..., stdin: bool = ...) -> None: ...

class ExecProcessResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class WaitProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "wait_if_created")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_IF_CREATED_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    wait_if_created: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., wait_if_created: bool = ...) -> None: ...

class WaitProcessResponse(_message.Message):
    __slots__ = ("exit_code", "signal", "oom_killed", "exited_at_ns", "output_complete", "stdout_length", "stderr_length")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_NS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STDERR_LENGTH_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    oom_killed: bool
    exited_at_ns: int
    output_complete: bool
    stdout_length: int
    stderr_length: int
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., oom_killed: bool = ..., exited_at_ns: _Optional[int] = ..., output_complete: bool = ..., stdout_length: _Optional[int] = ..., stderr_length: _Optional[int] = ...) -> None: ...

class ReadStreamRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "offset", "max_bytes", "accept_loss")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LOSS_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    offset: int
    max_bytes: int
    accept_loss: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ..., accept_loss: bool = ...) -> None: ...

class ReadStreamResponse(_message.Message):
    __slots__ = ("offset", "data", "eof")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    eof: bool
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., eof: bool = ...) -> None: ...

class WriteStreamRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "offset", "data")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    offset: int
    data: bytes
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteStreamResponse(_message.Message):
    __slots__ = ("length", "reader_gone")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    READER_GONE_FIELD_NUMBER: _ClassVar[int]
    length: int
    reader_gone: bool
    def __init__(self, length: _Optional[int] = ..., reader_gone: bool = ...) -> None: ...

class CloseStdinRequest(_message.Message):
    __slots__ = ("container_id", "exec_id")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class CloseStdinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TtyWinResizeRequest(_message.Message):
    __slots__ = ("container_id", "exec_id", "rows", "columns")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    rows: int
    columns: int
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., rows: _Optional[int] = ..., columns: _Optional[int] = ...) -> None: ...

class TtyWinResizeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

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
    __slots__ = ("signalled",)
    SIGNALLED_FIELD_NUMBER: _ClassVar[int]
    signalled: int
    def __init__(self, signalled: _Optional[int] = ...) -> None: ...

class RemoveProcessRequest(_message.Message):
    __slots__ = ("container_id", "exec_id")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class RemoveProcessResponse(_message.Message):
    __slots__ = ("unread_bytes",)
    UNREAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    unread_bytes: int
    def __init__(self, unread_bytes: _Optional[int] = ...) -> None: ...

class ListProcessesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamState(_message.Message):
    __slots__ = ("length", "held_from", "ended")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    HELD_FROM_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    length: int
    held_from: int
    ended: bool
    def __init__(self, length: _Optional[int] = ..., held_from: _Optional[int] = ..., ended: bool = ...) -> None: ...

class ProcessInfo(_message.Message):
    __slots__ = ("container_id", "exec_id", "pid", "state", "stdout", "stderr", "exit", "stdin", "terminal")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[ProcessInfo.State]
        CREATED: _ClassVar[ProcessInfo.State]
        RUNNING: _ClassVar[ProcessInfo.State]
        EXITED: _ClassVar[ProcessInfo.State]
    STATE_UNSPECIFIED: ProcessInfo.State
    CREATED: ProcessInfo.State
    RUNNING: ProcessInfo.State
    EXITED: ProcessInfo.State
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    EXIT_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    pid: int
    state: ProcessInfo.State
    stdout: StreamState
    stderr: StreamState
    exit: WaitProcessResponse
    stdin: bool
    terminal: bool
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[ProcessInfo.State, str]] = ..., stdout: _Optional[_Union[StreamState, _Mapping]] = ..., stderr: _Optional[_Union[StreamState, _Mapping]] = ..., exit: _Optional[_Union[WaitProcessResponse, _Mapping]] = ..., stdin: bool = ..., terminal: bool = ...) -> None: ...

class ListProcessesResponse(_message.Message):
    __slots__ = ("processes", "volume_ids", "encrypted", "share_tags", "pod_tmpfs", "mirrors")
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    VOLUME_IDS_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    SHARE_TAGS_FIELD_NUMBER: _ClassVar[int]
    POD_TMPFS_FIELD_NUMBER: _ClassVar[int]
    MIRRORS_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessInfo]
    volume_ids: _containers.RepeatedScalarFieldContainer[str]
    encrypted: _containers.RepeatedScalarFieldContainer[str]
    share_tags: _containers.RepeatedScalarFieldContainer[str]
    pod_tmpfs: _containers.RepeatedScalarFieldContainer[str]
    mirrors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessInfo, _Mapping]]] = ..., volume_ids: _Optional[_Iterable[str]] = ..., encrypted: _Optional[_Iterable[str]] = ..., share_tags: _Optional[_Iterable[str]] = ..., pod_tmpfs: _Optional[_Iterable[str]] = ..., mirrors: _Optional[_Iterable[str]] = ...) -> None: ...

class MountVolumeRequest(_message.Message):
    __slots__ = ("storage",)
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    storage: Storage
    def __init__(self, storage: _Optional[_Union[Storage, _Mapping]] = ...) -> None: ...

class MountVolumeResponse(_message.Message):
    __slots__ = ("device", "mount_point", "fs_group_walked")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MOUNT_POINT_FIELD_NUMBER: _ClassVar[int]
    FS_GROUP_WALKED_FIELD_NUMBER: _ClassVar[int]
    device: str
    mount_point: str
    fs_group_walked: bool
    def __init__(self, device: _Optional[str] = ..., mount_point: _Optional[str] = ..., fs_group_walked: bool = ...) -> None: ...

class VolumeStatsRequest(_message.Message):
    __slots__ = ("volume_id",)
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    def __init__(self, volume_id: _Optional[str] = ...) -> None: ...

class VolumeCondition(_message.Message):
    __slots__ = ("abnormal", "message")
    ABNORMAL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    abnormal: bool
    message: str
    def __init__(self, abnormal: bool = ..., message: _Optional[str] = ...) -> None: ...

class VolumeStatsResponse(_message.Message):
    __slots__ = ("total_bytes", "free_bytes", "available_bytes", "used_bytes", "inodes_total", "inodes_free", "inodes_used", "readonly", "fs_errors", "condition", "fs_type", "device", "device_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INODES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INODES_FREE_FIELD_NUMBER: _ClassVar[int]
    INODES_USED_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    FS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    CONDITION_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    free_bytes: int
    available_bytes: int
    used_bytes: int
    inodes_total: int
    inodes_free: int
    inodes_used: int
    readonly: bool
    fs_errors: int
    condition: VolumeCondition
    fs_type: str
    device: str
    device_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., available_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., inodes_total: _Optional[int] = ..., inodes_free: _Optional[int] = ..., inodes_used: _Optional[int] = ..., readonly: bool = ..., fs_errors: _Optional[int] = ..., condition: _Optional[_Union[VolumeCondition, _Mapping]] = ..., fs_type: _Optional[str] = ..., device: _Optional[str] = ..., device_bytes: _Optional[int] = ...) -> None: ...

class GrowVolumeRequest(_message.Message):
    __slots__ = ("volume_id",)
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    def __init__(self, volume_id: _Optional[str] = ...) -> None: ...

class GrowVolumeResponse(_message.Message):
    __slots__ = ("total_bytes", "device_bytes")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    device_bytes: int
    def __init__(self, total_bytes: _Optional[int] = ..., device_bytes: _Optional[int] = ...) -> None: ...

class FreezeVolumeRequest(_message.Message):
    __slots__ = ("volume_id", "timeout_seconds")
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    timeout_seconds: int
    def __init__(self, volume_id: _Optional[str] = ..., timeout_seconds: _Optional[int] = ...) -> None: ...

class FreezeVolumeResponse(_message.Message):
    __slots__ = ("depth",)
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    depth: int
    def __init__(self, depth: _Optional[int] = ...) -> None: ...

class ThawVolumeRequest(_message.Message):
    __slots__ = ("volume_id",)
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    def __init__(self, volume_id: _Optional[str] = ...) -> None: ...

class ThawVolumeResponse(_message.Message):
    __slots__ = ("depth", "was_frozen")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    WAS_FROZEN_FIELD_NUMBER: _ClassVar[int]
    depth: int
    was_frozen: bool
    def __init__(self, depth: _Optional[int] = ..., was_frozen: bool = ...) -> None: ...

class UnmountVolumeRequest(_message.Message):
    __slots__ = ("volume_id",)
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    volume_id: str
    def __init__(self, volume_id: _Optional[str] = ...) -> None: ...

class UnmountVolumeResponse(_message.Message):
    __slots__ = ("unmounted", "known")
    UNMOUNTED_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    unmounted: bool
    known: bool
    def __init__(self, unmounted: bool = ..., known: bool = ...) -> None: ...

class WaitDiskRemovedRequest(_message.Message):
    __slots__ = ("disk",)
    DISK_FIELD_NUMBER: _ClassVar[int]
    disk: Disk
    def __init__(self, disk: _Optional[_Union[Disk, _Mapping]] = ...) -> None: ...

class WaitDiskRemovedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenEncryptedRequest(_message.Message):
    __slots__ = ("name", "disk", "passphrase", "format_if_blank", "fs_type", "integrity")
    class Integrity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INTEGRITY_UNSPECIFIED: _ClassVar[OpenEncryptedRequest.Integrity]
        NONE: _ClassVar[OpenEncryptedRequest.Integrity]
        HMAC_SHA256: _ClassVar[OpenEncryptedRequest.Integrity]
    INTEGRITY_UNSPECIFIED: OpenEncryptedRequest.Integrity
    NONE: OpenEncryptedRequest.Integrity
    HMAC_SHA256: OpenEncryptedRequest.Integrity
    NAME_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    PASSPHRASE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_IF_BLANK_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    disk: Disk
    passphrase: bytes
    format_if_blank: bool
    fs_type: str
    integrity: OpenEncryptedRequest.Integrity
    def __init__(self, name: _Optional[str] = ..., disk: _Optional[_Union[Disk, _Mapping]] = ..., passphrase: _Optional[bytes] = ..., format_if_blank: bool = ..., fs_type: _Optional[str] = ..., integrity: _Optional[_Union[OpenEncryptedRequest.Integrity, str]] = ...) -> None: ...

class OpenEncryptedResponse(_message.Message):
    __slots__ = ("formatted", "device", "cipher")
    FORMATTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CIPHER_FIELD_NUMBER: _ClassVar[int]
    formatted: bool
    device: str
    cipher: str
    def __init__(self, formatted: bool = ..., device: _Optional[str] = ..., cipher: _Optional[str] = ...) -> None: ...

class ResizeEncryptedRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ResizeEncryptedResponse(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class CloseEncryptedRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CloseEncryptedResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MountShareRequest(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: str
    def __init__(self, tag: _Optional[str] = ...) -> None: ...

class MountShareResponse(_message.Message):
    __slots__ = ("mount_point",)
    MOUNT_POINT_FIELD_NUMBER: _ClassVar[int]
    mount_point: str
    def __init__(self, mount_point: _Optional[str] = ...) -> None: ...

class MountPodTmpfsRequest(_message.Message):
    __slots__ = ("name", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class MountPodTmpfsResponse(_message.Message):
    __slots__ = ("mount_point", "size_bytes")
    MOUNT_POINT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    mount_point: str
    size_bytes: int
    def __init__(self, mount_point: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class StartMirrorRequest(_message.Message):
    __slots__ = ("name", "source", "interval_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    source: SharePath
    interval_ms: int
    def __init__(self, name: _Optional[str] = ..., source: _Optional[_Union[SharePath, _Mapping]] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class StartMirrorResponse(_message.Message):
    __slots__ = ("mount_point",)
    MOUNT_POINT_FIELD_NUMBER: _ClassVar[int]
    mount_point: str
    def __init__(self, mount_point: _Optional[str] = ...) -> None: ...

class StopMirrorRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class StopMirrorResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BindGuestPathRequest(_message.Message):
    __slots__ = ("source", "target", "readonly")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    READONLY_FIELD_NUMBER: _ClassVar[int]
    source: Source
    target: str
    readonly: bool
    def __init__(self, source: _Optional[_Union[Source, _Mapping]] = ..., target: _Optional[str] = ..., readonly: bool = ...) -> None: ...

class BindGuestPathResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnbindGuestPathRequest(_message.Message):
    __slots__ = ("target",)
    TARGET_FIELD_NUMBER: _ClassVar[int]
    target: str
    def __init__(self, target: _Optional[str] = ...) -> None: ...

class UnbindGuestPathResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IPAddress(_message.Message):
    __slots__ = ("address", "prefix_length")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    address: str
    prefix_length: int
    def __init__(self, address: _Optional[str] = ..., prefix_length: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("destination", "gateway")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    destination: str
    gateway: str
    def __init__(self, destination: _Optional[str] = ..., gateway: _Optional[str] = ...) -> None: ...

class ConfigureInterfaceRequest(_message.Message):
    __slots__ = ("mac", "name", "mtu", "addresses", "routes")
    MAC_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    mac: str
    name: str
    mtu: int
    addresses: _containers.RepeatedCompositeFieldContainer[IPAddress]
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    def __init__(self, mac: _Optional[str] = ..., name: _Optional[str] = ..., mtu: _Optional[int] = ..., addresses: _Optional[_Iterable[_Union[IPAddress, _Mapping]]] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ...) -> None: ...

class ConfigureInterfaceResponse(_message.Message):
    __slots__ = ("found_as",)
    FOUND_AS_FIELD_NUMBER: _ClassVar[int]
    found_as: str
    def __init__(self, found_as: _Optional[str] = ...) -> None: ...

class ConfigureGuestRequest(_message.Message):
    __slots__ = ("hostname", "sysctls")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    SYSCTLS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    sysctls: _containers.RepeatedCompositeFieldContainer[Sysctl]
    def __init__(self, hostname: _Optional[str] = ..., sysctls: _Optional[_Iterable[_Union[Sysctl, _Mapping]]] = ...) -> None: ...

class Sysctl(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class ConfigureGuestResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
