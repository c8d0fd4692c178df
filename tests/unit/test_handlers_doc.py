"""docs/handlers.md's skeleton of a sandbox is the real interface: the code
block runs as it is, its sandbox class implements every abstract method of
crust.runtime_handler.sandbox.Sandbox with that method's parameters and
nothing the interface lacks, and the handler it builds makes one."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from crust.runtime_handler.handler import RuntimeHandler
from crust.runtime_handler.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[2]


def skeleton() -> str:
    doc = (REPO / "docs" / "handlers.md").read_text()
    section = doc[doc.index("## With the library"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


async def test_the_skeleton_in_handlers_md_is_a_working_sandbox_and_handler(tmp_path):
    namespace: dict = {}
    exec(compile(skeleton(), "docs/handlers.md", "exec"), namespace)  # noqa: S102 - our own doc
    cls, handler = namespace["MyVmSandbox"], namespace["handler"]
    assert isinstance(handler, RuntimeHandler)
    try:
        sandbox = handler.make_sandbox("sb-1", tmp_path, None, None)   # as the handler calls it
        assert isinstance(sandbox, Sandbox) and sandbox.id == "sb-1"
        assert not cls.__abstractmethods__
        for name, member in vars(cls).items():
            if name.startswith("_"):
                continue
            assert hasattr(Sandbox, name), f"the skeleton's {name} is no method of Sandbox"
            theirs = getattr(Sandbox, name)
            if isinstance(member, property):
                assert isinstance(theirs, property), name
                continue
            assert inspect.iscoroutinefunction(member) == inspect.iscoroutinefunction(theirs), name
            assert list(inspect.signature(member).parameters) == list(inspect.signature(theirs).parameters), name
        # Every method a sandbox must write is in the skeleton.
        assert set(Sandbox.__abstractmethods__) <= set(vars(cls))
    finally:
        await handler.registration.channel.close()
