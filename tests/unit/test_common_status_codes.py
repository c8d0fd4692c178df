"""One table between crust's errors and the status codes
(crust.common.errors), read by its three users: the agent's answers as the
handler's errors (crust.kata.agent.client.handler_error), the handler's
errors as the ttrpc status the shim passes on to containerd
(crust.kata.pod.ttrpc_endpoint.ttrpc_error), and
crust's errors as gRPC's codes (each class's `code`, which the gRPC
interceptor answers with). Each maps every code as it did before the table
was shared."""

from __future__ import annotations

import grpc
import pytest

from crust.common import errors, ttrpc
from crust.common.errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Forwarded,
    Internal,
    InvalidArgument,
    NoSpace,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    Unimplemented,
)
from crust.kata.agent.client import handler_error
from crust.kata.pod.ttrpc_endpoint import ttrpc_error

# What each error answers over gRPC (the interceptor sends exc.code).
CLASS_CODES = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT, NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS, PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION, OutOfRange: grpc.StatusCode.OUT_OF_RANGE,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED, NoSpace: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Aborted: grpc.StatusCode.ABORTED, Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unimplemented: grpc.StatusCode.UNIMPLEMENTED, Internal: grpc.StatusCode.INTERNAL,
    DataLoss: grpc.StatusCode.DATA_LOSS, DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
}

# The handler's error for each code of an agent's answer: the ten codes the
# agent's protocol gives a meaning pass on, anything else is INTERNAL.
AGENT_ERRORS = {
    ttrpc.OK: Internal, ttrpc.CANCELLED: Internal, ttrpc.UNKNOWN: Internal,
    ttrpc.INVALID_ARGUMENT: InvalidArgument, ttrpc.DEADLINE_EXCEEDED: DeadlineExceeded,
    ttrpc.NOT_FOUND: NotFound, ttrpc.ALREADY_EXISTS: AlreadyExists, ttrpc.PERMISSION_DENIED: Internal,
    ttrpc.RESOURCE_EXHAUSTED: ResourceExhausted, ttrpc.FAILED_PRECONDITION: FailedPrecondition,
    ttrpc.ABORTED: Internal, ttrpc.OUT_OF_RANGE: OutOfRange, ttrpc.UNIMPLEMENTED: Unimplemented,
    ttrpc.INTERNAL: Internal, ttrpc.UNAVAILABLE: Unavailable, ttrpc.DATA_LOSS: DataLoss,
    16: Internal, 99: Internal, -1: Internal,
}


@pytest.mark.parametrize("cls", list(CLASS_CODES), ids=lambda c: c.__name__)
def test_each_error_answers_its_code(cls):
    assert cls.code is CLASS_CODES[cls]
    if cls is not NoSpace:
        assert errors.error_class(cls.code) is cls
        assert errors.error_class(errors.status_number(cls.code)) is cls


def test_a_forwarded_error_keeps_the_code_it_was_answered_with():
    assert Forwarded(grpc.StatusCode.PERMISSION_DENIED, "no").code is grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("number", sorted(AGENT_ERRORS))
def test_each_agent_code_is_the_handlers_error_it_was(number):
    error = handler_error(ttrpc.TtrpcError(number, "words"), "container c")
    assert type(error) is AGENT_ERRORS[number]
    assert error.message == "container c: the guest's agent: words"


@pytest.mark.parametrize("cls", list(CLASS_CODES), ids=lambda c: c.__name__)
def test_each_handler_error_reaches_the_shim_as_the_same_number(cls):
    made = cls("/var", OSError(28, "no space")) if cls is NoSpace else cls("the handler's words")
    error = ttrpc_error(made)
    assert error.code == CLASS_CODES[cls].value[0]
    assert error.message == made.message
    assert errors.status_code(error.code) is CLASS_CODES[cls]


def test_a_forwarded_code_reaches_the_shim_and_an_unknown_number_is_unknown():
    assert ttrpc_error(Forwarded(grpc.StatusCode.ABORTED, "x")).code == ttrpc.ABORTED
    assert errors.status_code(99) is grpc.StatusCode.UNKNOWN
    assert errors.error_class(grpc.StatusCode.OK) is Internal


def test_ttrpcs_numbers_are_grpcs():
    """The guest has no grpc module: crust.common.ttrpc names the numbers
    itself, and they are gRPC's."""
    for code in grpc.StatusCode:
        if code.name in ttrpc.__dict__:
            assert getattr(ttrpc, code.name) == code.value[0] == errors.status_number(code), code.name
    assert sum(code.name in ttrpc.__dict__ for code in grpc.StatusCode) == 16
