"""What several of the unit tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from crust.common.errors import CrustError

REPO = Path(__file__).resolve().parents[2]
MIB = 1024**2
GIB = 1024**3


def raises_exactly(exc_type: type[CrustError], fn, *args, **kw) -> CrustError:
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    # The exact class, not a subclass or sibling: the class is the gRPC code.
    assert type(info.value) is exc_type
    return info.value
