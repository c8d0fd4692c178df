"""specs/agent.proto is the agent protocol's one text: the tables of
docs/agent-protocol.md are made from it (tools/gen_agent_doc.py) and fail
here when stale; the capability names both sides use
(crust.common.agent_capabilities) are the proto's; and every call of the
proto is served by the guest's agent, or named by a capability the agent
does not list."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys

from crust.api import agent_pb2
from crust.common import agent_capabilities, ttrpc, ttrpc_client
from crust.guest.agent import make_server, serve_socket
from crust.guest.service import AgentService
from crust.kata.agent.client import AgentClient
from tests.unit.helpers import REPO

TOOL = REPO / "tools" / "gen_agent_doc.py"
SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AgentService"]


def _load_tool():
    spec = importlib.util.spec_from_file_location("gen_agent_doc", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_tool()
PROTO = (REPO / "specs" / "agent.proto").read_text()


def _check(tool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=60)


def test_the_page_is_up_to_date():
    result = _check(TOOL)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "up to date" in result.stdout


def test_a_stale_page_fails_the_check(tmp_path):
    """On a copy of the layout: an rpc's comment edited, a table edited by
    hand, a marker gone: each fails the check; the tool writes the page
    whole again."""
    for d in ("tools", "specs", "docs"):
        shutil.copytree(REPO / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    tool, proto, page = tmp_path / "tools" / "gen_agent_doc.py", tmp_path / "specs" / "agent.proto", \
        tmp_path / "docs" / "agent-protocol.md"
    assert _check(tool).returncode == 0   # the copy is faithful
    original_proto, original_page = proto.read_text(), page.read_text()

    proto.write_text(original_proto.replace("// Undo BindGuestPath.", "// Undo a BindGuestPath.", 1))
    result = _check(tool)
    assert result.returncode == 1 and "stale" in result.stdout
    assert subprocess.run([sys.executable, str(tool)], capture_output=True, timeout=60).returncode == 0
    assert _check(tool).returncode == 0 and "Undo a BindGuestPath." in page.read_text()
    proto.write_text(original_proto)
    page.write_text(original_page)

    page.write_text(original_page.replace("| `StopMirror` | `mirror.atomic-writer` |", "| `StopMirror` | none |"))
    assert _check(tool).returncode == 1
    page.write_text(original_page.replace(gen.end_marker("calls"), ""))
    result = _check(tool)
    assert result.returncode != 0 and "markers" in result.stderr


def test_the_tables_hold_every_call_and_capability():
    """What the tool reads of the proto is what protoc reads: every rpc in
    the service's order, with its messages."""
    read = [(name, request, response) for name, request, response, _ in gen.rpcs(PROTO)]
    assert read == [(m.name, m.input_type.name, m.output_type.name) for m in SERVICE.methods]
    page = (REPO / "docs" / "agent-protocol.md").read_text()
    for method in SERVICE.methods:
        assert f"| `{method.name}` |" in page
    for name in gen.capabilities(PROTO):
        assert f"| `{name}` |" in page
    assert gen.named_by(PROTO)["OpenEncrypted"] == ["luks2"]
    assert gen.summary("Unmount a volume (never lazily). FAILED_PRECONDITION: busy.") == \
        "Unmount a volume (never lazily)."


def test_the_capability_names_are_the_protos():
    assert set(gen.capabilities(PROTO)) == {*agent_capabilities.NAMES, agent_capabilities.FS_PREFIX + "<type>"}
    assert len(set(agent_capabilities.NAMES)) == len(agent_capabilities.NAMES)
    assert agent_capabilities.fs("xfs") == "fs.xfs"


def unserved_and_unnamed(calls: list[str], named: dict[str, list[str]], served, listed: set[str]) -> list[str]:
    """The calls the agent neither serves nor declares absent (no capability
    naming them is missing from what it lists)."""
    return [call for call in calls
            if not served(call) and not any(c not in listed for c in named.get(call, ()))]


def test_every_call_is_served_or_named_by_an_absent_capability(tmp_path):
    """The agent on a unix socket: what it lists (GetGuestDetails over the
    wire), what it serves (its service's method of each call's name, as the
    ttrpc server registers them), and a call it does not serve
    (GetOOMEvent, which left the protocol) answered UNIMPLEMENTED."""

    async def scenario():
        service = AgentService()
        server = make_server(service)
        stopping = asyncio.Event()
        path = str(tmp_path / "agent.sock")
        serving = asyncio.create_task(serve_socket(server, path, stopping))
        while not os.path.exists(path):
            await asyncio.sleep(0.01)
        client, details = await AgentClient.open(path, timeout=10)
        try:
            raw = await ttrpc_client.Client.connect(path)
            try:
                await raw.call(SERVICE.full_name, "GetOOMEvent", agent_pb2.GuestDetailsRequest(),
                               agent_pb2.GuestDetailsResponse, timeout=10)
            except ttrpc.TtrpcError as exc:
                gone = exc.code
            else:
                gone = None
            await raw.close()
        finally:
            await client.close()
            stopping.set()
            await serving
            await server.close()
            await service.close()
        return service, set(details.capabilities), gone

    service, listed, gone = asyncio.run(scenario())
    calls = [m.name for m in SERVICE.methods]

    def served(call: str) -> bool:
        return callable(getattr(service, call, None))

    assert unserved_and_unnamed(calls, gen.named_by(PROTO), served, listed) == []
    assert gone == ttrpc.UNIMPLEMENTED
    assert "GetOOMEvent" not in calls
    # The check sees a call that is neither.
    named = {"GetOOMEvent": [], "Warm": ["warm"]}
    assert unserved_and_unnamed(["GetOOMEvent", "Warm"], named, lambda call: False, {"warm"}) == \
        ["GetOOMEvent", "Warm"]
    assert unserved_and_unnamed(["GetOOMEvent", "Warm"], named, lambda call: False, set()) == ["GetOOMEvent"]
