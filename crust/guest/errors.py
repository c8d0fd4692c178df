"""The agent's errors: a gRPC status code (crust.common.ttrpc's) and a
message that names the request's field (specs/agent.proto, "Errors")."""

from __future__ import annotations

import re

from crust.common import ttrpc
from crust.common.ttrpc import TtrpcError


class AgentError(TtrpcError):
    """A call's failure as the host receives it."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)


ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_id(field: str, value: str, empty_ok: bool = False) -> str:
    """An id as the protocol allows it, or INVALID_ARGUMENT naming the field."""
    if value == "" and empty_ok:
        return value
    if not ID_PATTERN.fullmatch(value):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {value!r} is not 1..128 characters of "
                                                "[A-Za-z0-9_.-] starting with a letter or digit")
    return value
