import datetime

from google.protobuf import any_pb2 as _any_pb2
from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from . import containerd_types_pb2 as _containerd_types_pb2
from . import containerd_task_types_pb2 as _containerd_task_types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateTaskRequest(_message.Message):
    __slots__ = ("id", "bundle", "rootfs", "terminal", "stdin", "stdout", "stderr", "checkpoint", "parent_checkpoint", "options")
    ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    ROOTFS_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PARENT_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    bundle: str
    rootfs: _containers.RepeatedCompositeFieldContainer[_containerd_types_pb2.Mount]
    terminal: bool
    stdin: str
    stdout: str
    stderr: str
    checkpoint: str
    parent_checkpoint: str
    options: _any_pb2.Any
    def __init__(self, id: _Optional[str] = ..., bundle: _Optional[str] = ..., rootfs: _Optional[_Iterable[_Union[_containerd_types_pb2.Mount, _Mapping]]] = ..., terminal: bool = ..., stdin: _Optional[str] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., checkpoint: _Optional[str] = ..., parent_checkpoint: _Optional[str] = ..., options: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class CreateTaskResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("id", "exec_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("pid", "exit_status", "exited_at")
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    pid: int
    exit_status: int
    exited_at: _timestamp_pb2.Timestamp
    def __init__(self, pid: _Optional[int] = ..., exit_status: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ExecProcessRequest(_message.Message):
    __slots__ = ("id", "exec_id", "terminal", "stdin", "stdout", "stderr", "spec")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    terminal: bool
    stdin: str
    stdout: str
    stderr: str
    spec: _any_pb2.Any
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ..., terminal: bool = ..., stdin: _Optional[str] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., spec: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class ExecProcessResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResizePtyRequest(_message.Message):
    __slots__ = ("id", "exec_id", "width", "height")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    width: int
    height: int
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("id", "exec_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ("id", "bundle", "pid", "status", "stdin", "stdout", "stderr", "terminal", "exit_status", "exited_at", "exec_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    bundle: str
    pid: int
    status: _containerd_task_types_pb2.Status
    stdin: str
    stdout: str
    stderr: str
    terminal: bool
    exit_status: int
    exited_at: _timestamp_pb2.Timestamp
    exec_id: str
    def __init__(self, id: _Optional[str] = ..., bundle: _Optional[str] = ..., pid: _Optional[int] = ..., status: _Optional[_Union[_containerd_task_types_pb2.Status, str]] = ..., stdin: _Optional[str] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., terminal: bool = ..., exit_status: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., exec_id: _Optional[str] = ...) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("id", "exec_id", "signal", "all")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    signal: int
    all: bool
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ..., signal: _Optional[int] = ..., all: bool = ...) -> None: ...

class CloseIORequest(_message.Message):
    __slots__ = ("id", "exec_id", "stdin")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    stdin: bool
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ..., stdin: bool = ...) -> None: ...

class PidsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class PidsResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[_containerd_task_types_pb2.ProcessInfo]
    def __init__(self, processes: _Optional[_Iterable[_Union[_containerd_task_types_pb2.ProcessInfo, _Mapping]]] = ...) -> None: ...

class CheckpointTaskRequest(_message.Message):
    __slots__ = ("id", "path", "options")
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    path: str
    options: _any_pb2.Any
    def __init__(self, id: _Optional[str] = ..., path: _Optional[str] = ..., options: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class UpdateTaskRequest(_message.Message):
    __slots__ = ("id", "resources", "annotations")
    class AnnotationsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    RESOURCES_FIELD_NUMBER: _ClassVar[int]
    ANNOTATIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    resources: _any_pb2.Any
    annotations: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., resources: _Optional[_Union[_any_pb2.Any, _Mapping]] = ..., annotations: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("id", "exec_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class StartResponse(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class WaitRequest(_message.Message):
    __slots__ = ("id", "exec_id")
    ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    exec_id: str
    def __init__(self, id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class WaitResponse(_message.Message):
    __slots__ = ("exit_status", "exited_at")
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    exit_status: int
    exited_at: _timestamp_pb2.Timestamp
    def __init__(self, exit_status: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _any_pb2.Any
    def __init__(self, stats: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("shim_pid", "task_pid", "version")
    SHIM_PID_FIELD_NUMBER: _ClassVar[int]
    TASK_PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    shim_pid: int
    task_pid: int
    version: str
    def __init__(self, shim_pid: _Optional[int] = ..., task_pid: _Optional[int] = ..., version: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("id", "now")
    ID_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    id: str
    now: bool
    def __init__(self, id: _Optional[str] = ..., now: bool = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...
