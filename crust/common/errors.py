"""The one error model of crust.

Logic raises these domain errors; exactly one place (the gRPC interceptor in
crust.common.grpcserver) turns them into gRPC status codes. Anything else that
escapes a servicer becomes INTERNAL with its traceback logged.
"""

from __future__ import annotations

import grpc


class CrustError(Exception):
    """Base of every error that maps to a definite gRPC status code."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(CrustError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(CrustError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(CrustError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(CrustError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(CrustError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(CrustError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(CrustError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Aborted(CrustError):
    code = grpc.StatusCode.ABORTED


class Unavailable(CrustError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(CrustError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(CrustError):
    code = grpc.StatusCode.INTERNAL


class DeadlineExceeded(CrustError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Forwarded(CrustError):
    """An error answered by another gRPC server, passed on unchanged."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code

    @classmethod
    def from_rpc_error(cls, exc: grpc.RpcError) -> "Forwarded":
        return cls(exc.code(), exc.details() or "")
