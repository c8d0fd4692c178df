from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class Options(_message.Message):
    __slots__ = ("type_url", "config_path")
    TYPE_URL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_PATH_FIELD_NUMBER: _ClassVar[int]
    type_url: str
    config_path: str
    def __init__(self, type_url: _Optional[str] = ..., config_path: _Optional[str] = ...) -> None: ...
