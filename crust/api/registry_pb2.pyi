from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterHandlerRequest(_message.Message):
    __slots__ = ("name", "endpoint", "filesystems", "features", "lease_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FILESYSTEMS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    endpoint: str
    filesystems: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedScalarFieldContainer[str]
    lease_id: str
    def __init__(self, name: _Optional[str] = ..., endpoint: _Optional[str] = ..., filesystems: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[str]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class RegisterHandlerResponse(_message.Message):
    __slots__ = ("lease_id", "lease_seconds")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_seconds: int
    def __init__(self, lease_id: _Optional[str] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("name", "lease_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    lease_id: str
    def __init__(self, name: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: int
    def __init__(self, lease_seconds: _Optional[int] = ...) -> None: ...

class UnregisterHandlerRequest(_message.Message):
    __slots__ = ("name", "lease_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    lease_id: str
    def __init__(self, name: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class UnregisterHandlerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClaimVolumeRequest(_message.Message):
    __slots__ = ("target_path", "handler", "sandbox_id", "sandbox_pid", "lease_id")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    handler: str
    sandbox_id: str
    sandbox_pid: int
    lease_id: str
    def __init__(self, target_path: _Optional[str] = ..., handler: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., sandbox_pid: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ClaimVolumeResponse(_message.Message):
    __slots__ = ("mount_info_json", "volume_passphrase")
    MOUNT_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    VOLUME_PASSPHRASE_FIELD_NUMBER: _ClassVar[int]
    mount_info_json: str
    volume_passphrase: bytes
    def __init__(self, mount_info_json: _Optional[str] = ..., volume_passphrase: _Optional[bytes] = ...) -> None: ...

class ReleaseVolumeRequest(_message.Message):
    __slots__ = ("target_path", "handler", "sandbox_id", "abnormal_reason", "lease_id")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ABNORMAL_REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    handler: str
    sandbox_id: str
    abnormal_reason: str
    lease_id: str
    def __init__(self, target_path: _Optional[str] = ..., handler: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., abnormal_reason: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseVolumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListClaimsRequest(_message.Message):
    __slots__ = ("handler",)
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    handler: str
    def __init__(self, handler: _Optional[str] = ...) -> None: ...

class Claim(_message.Message):
    __slots__ = ("target_path", "handler", "sandbox_id", "volume_id", "claimed_at", "sandbox_pid")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_AT_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_PID_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    handler: str
    sandbox_id: str
    volume_id: str
    claimed_at: int
    sandbox_pid: int
    def __init__(self, target_path: _Optional[str] = ..., handler: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., volume_id: _Optional[str] = ..., claimed_at: _Optional[int] = ..., sandbox_pid: _Optional[int] = ...) -> None: ...

class ListClaimsResponse(_message.Message):
    __slots__ = ("claims",)
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    claims: _containers.RepeatedCompositeFieldContainer[Claim]
    def __init__(self, claims: _Optional[_Iterable[_Union[Claim, _Mapping]]] = ...) -> None: ...

class ListHandlersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Handler(_message.Message):
    __slots__ = ("name", "endpoint", "filesystems", "features", "lease_age_seconds", "lease_expired", "registered_by_uid", "registered_by_pid")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FILESYSTEMS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BY_UID_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BY_PID_FIELD_NUMBER: _ClassVar[int]
    name: str
    endpoint: str
    filesystems: _containers.RepeatedScalarFieldContainer[str]
    features: _containers.RepeatedScalarFieldContainer[str]
    lease_age_seconds: float
    lease_expired: bool
    registered_by_uid: int
    registered_by_pid: int
    def __init__(self, name: _Optional[str] = ..., endpoint: _Optional[str] = ..., filesystems: _Optional[_Iterable[str]] = ..., features: _Optional[_Iterable[str]] = ..., lease_age_seconds: _Optional[float] = ..., lease_expired: bool = ..., registered_by_uid: _Optional[int] = ..., registered_by_pid: _Optional[int] = ...) -> None: ...

class ListHandlersResponse(_message.Message):
    __slots__ = ("handlers",)
    HANDLERS_FIELD_NUMBER: _ClassVar[int]
    handlers: _containers.RepeatedCompositeFieldContainer[Handler]
    def __init__(self, handlers: _Optional[_Iterable[_Union[Handler, _Mapping]]] = ...) -> None: ...

class ListVolumesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeferredVolume(_message.Message):
    __slots__ = ("target_path", "volume_id", "device", "fs_type", "state", "claim", "kata_mirror_error")
    TARGET_PATH_FIELD_NUMBER: _ClassVar[int]
    VOLUME_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FS_TYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    KATA_MIRROR_ERROR_FIELD_NUMBER: _ClassVar[int]
    target_path: str
    volume_id: str
    device: str
    fs_type: str
    state: str
    claim: Claim
    kata_mirror_error: str
    def __init__(self, target_path: _Optional[str] = ..., volume_id: _Optional[str] = ..., device: _Optional[str] = ..., fs_type: _Optional[str] = ..., state: _Optional[str] = ..., claim: _Optional[_Union[Claim, _Mapping]] = ..., kata_mirror_error: _Optional[str] = ...) -> None: ...

class ListVolumesResponse(_message.Message):
    __slots__ = ("volumes",)
    VOLUMES_FIELD_NUMBER: _ClassVar[int]
    volumes: _containers.RepeatedCompositeFieldContainer[DeferredVolume]
    def __init__(self, volumes: _Optional[_Iterable[_Union[DeferredVolume, _Mapping]]] = ...) -> None: ...

class GetNodeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KubeletRegistration(_message.Message):
    __slots__ = ("socket", "driver_name", "endpoint", "state", "error", "info_age_seconds", "verdict_age_seconds", "socket_recreated")
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    DRIVER_NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    INFO_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOCKET_RECREATED_FIELD_NUMBER: _ClassVar[int]
    socket: str
    driver_name: str
    endpoint: str
    state: str
    error: str
    info_age_seconds: float
    verdict_age_seconds: float
    socket_recreated: int
    def __init__(self, socket: _Optional[str] = ..., driver_name: _Optional[str] = ..., endpoint: _Optional[str] = ..., state: _Optional[str] = ..., error: _Optional[str] = ..., info_age_seconds: _Optional[float] = ..., verdict_age_seconds: _Optional[float] = ..., socket_recreated: _Optional[int] = ...) -> None: ...

class ComponentHealth(_message.Message):
    __slots__ = ("name", "endpoint", "status", "detail")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    name: str
    endpoint: str
    status: str
    detail: str
    def __init__(self, name: _Optional[str] = ..., endpoint: _Optional[str] = ..., status: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class GetNodeStatusResponse(_message.Message):
    __slots__ = ("kubelet_registration", "components")
    KUBELET_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    kubelet_registration: KubeletRegistration
    components: _containers.RepeatedCompositeFieldContainer[ComponentHealth]
    def __init__(self, kubelet_registration: _Optional[_Union[KubeletRegistration, _Mapping]] = ..., components: _Optional[_Iterable[_Union[ComponentHealth, _Mapping]]] = ...) -> None: ...
