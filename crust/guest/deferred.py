"""Modules the agent's imports load but do not use, loaded only when
something asks them for an attribute.

protobuf's descriptor_pool and builder import its pure-Python message
implementation (python_message, and with it text_format, datetime,
pickle and the well-known types) whatever implementation runs; with the
upb extension, which the guest's interpreter uses, nothing of it is
called. Each import is paid in the guest's boot, on a CPU under
emulation, before the host can reach the agent.
"""

from __future__ import annotations

import importlib
import sys
import types

UNUSED_WITH_UPB = ("google.protobuf.internal.python_message",)


class Deferred(types.ModuleType):
    """Stands in sys.modules for a module until an attribute of it is asked
    for; then the module is imported and answers."""

    def __getattr__(self, attr: str):
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)


def defer_unused() -> list[str]:
    """The modules of UNUSED_WITH_UPB not loaded yet, deferred when the upb
    extension runs protobuf (the pure-Python implementation needs them).
    Returns the names deferred."""
    from google.protobuf.internal import api_implementation

    if api_implementation.Type() != "upb":
        return []
    deferred = []
    for name in UNUSED_WITH_UPB:
        if name not in sys.modules:
            sys.modules[name] = Deferred(name)
            deferred.append(name)
    return deferred
