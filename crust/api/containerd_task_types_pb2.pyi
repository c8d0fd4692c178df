from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNKNOWN: _ClassVar[Status]
    CREATED: _ClassVar[Status]
    RUNNING: _ClassVar[Status]
    STOPPED: _ClassVar[Status]
    PAUSED: _ClassVar[Status]
    PAUSING: _ClassVar[Status]

class ExitReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NONE: _ClassVar[ExitReason]
    OOMKILLED: _ClassVar[ExitReason]
    SIGNALED: _ClassVar[ExitReason]
UNKNOWN: Status
CREATED: Status
RUNNING: Status
STOPPED: Status
PAUSED: Status
PAUSING: Status
NONE: ExitReason
OOMKILLED: ExitReason
SIGNALED: ExitReason

class ProcessInfo(_message.Message):
    __slots__ = ("pid", "info")
    PID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    pid: int
    info: _any_pb2.Any
    def __init__(self, pid: _Optional[int] = ..., info: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...
