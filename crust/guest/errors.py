"""The agent's errors: a gRPC status code and a message that names the
request's field (specs/agent.proto, "Errors")."""

from __future__ import annotations

import enum
import re

from crust.common.ttrpc import TtrpcError


class Code(enum.IntEnum):
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15


class AgentError(TtrpcError):
    """A call's failure as the host receives it."""

    def __init__(self, code: Code, message: str):
        super().__init__(int(code), message)


ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_id(field: str, value: str, empty_ok: bool = False) -> str:
    """An id as the protocol allows it, or INVALID_ARGUMENT naming the field."""
    if value == "" and empty_ok:
        return value
    if not ID_PATTERN.fullmatch(value):
        raise AgentError(Code.INVALID_ARGUMENT, f"{field}: {value!r} is not 1..128 characters of "
                                                "[A-Za-z0-9_.-] starting with a letter or digit")
    return value
