"""The one error model of crust.

Logic raises these domain errors; exactly one place (the gRPC interceptor in
crust.common.grpcserver) turns them into gRPC status codes. Anything else that
escapes a servicer becomes INTERNAL with its traceback logged.

Each class's `code` is the one table between crust's errors and the status
codes; error_class reads it backwards (a code another server answered, as
crust's error), and status_number/status_code turn gRPC's codes into the
numbers ttrpc carries and back (the guest's agent and containerd's shims
speak ttrpc).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

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


# A write refused for want of room: no space left, or the quota spent.
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


class NoSpace(ResourceExhausted):
    """A write crust needed failed for want of space (ENOSPC) or quota
    (EDQUOT) where it writes: the message names that directory, and the
    call, once its own steps are undone, can be retried when there is room."""

    def __init__(self, directory: str | os.PathLike | int, exc: OSError):
        self.directory = directory_name(directory)
        why = "no space left" if exc.errno == errno.ENOSPC else "the disk quota is spent"
        super().__init__(f"{why} on the file system of {self.directory}; retry once there is room")


def directory_name(directory: str | os.PathLike | int) -> str:
    """A directory given as a path or an open descriptor, as a path."""
    if isinstance(directory, int):
        try:
            return os.readlink(f"/proc/self/fd/{directory}")
        except OSError:
            return f"descriptor {directory}"
    return os.fspath(directory)


@contextlib.contextmanager
def space_in(directory: str | os.PathLike | int) -> Iterator[None]:
    """Writes in directory: ENOSPC and EDQUOT become NoSpace naming it."""
    try:
        yield
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise NoSpace(directory, exc) from None
        raise


class Aborted(CrustError):
    code = grpc.StatusCode.ABORTED


class Unavailable(CrustError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(CrustError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(CrustError):
    code = grpc.StatusCode.INTERNAL


class DataLoss(CrustError):
    """Bytes that were written cannot be delivered whole (a process's output
    whose VM went while it was being read)."""

    code = grpc.StatusCode.DATA_LOSS


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


# The classes whose `code` a status code is answered with (NoSpace and
# Forwarded share a code with another or have none of their own).
_CLASSES = (InvalidArgument, NotFound, AlreadyExists, PermissionDenied, FailedPrecondition, OutOfRange,
            ResourceExhausted, Aborted, Unavailable, Unimplemented, Internal, DataLoss, DeadlineExceeded)
_BY_CODE: dict[grpc.StatusCode, type[CrustError]] = {cls.code: cls for cls in _CLASSES}
_BY_NUMBER: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def status_number(code: object) -> int:
    """gRPC's code as the number ttrpc carries; UNKNOWN's for what is no code."""
    return code.value[0] if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN.value[0]


def status_code(number: int) -> grpc.StatusCode:
    """ttrpc's number as gRPC's code; UNKNOWN for a number gRPC has no code for."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


def error_class(code: grpc.StatusCode | int) -> type[CrustError]:
    """crust's error for a status code (gRPC's or ttrpc's number); Internal
    for a code no error of crust carries (OK, CANCELLED, UNKNOWN, ...)."""
    if not isinstance(code, grpc.StatusCode):
        code = status_code(code)
    return _BY_CODE.get(code, Internal)
