"""The guest's own life through its agent (crust/guest/lifecycle.py), on
the host where it can run here: Warm's throwaway container through a real
crun (the image's warm spec, with the host's libraries bound in its empty
root, since the host's /bin/sh is not the guest's static busybox), what it
leaves behind (nothing), and Resume's refusals. Setting the clock, the
entropy and the power-off run in VMs (tests/vm/test_kata_template.py,
tests/vm/test_guest_agent_vm.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest import lifecycle
from crust.guest.errors import AgentError
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import ContainerAgent, crun_container_agent, pod_cgroup_cleaned  # noqa: F401 - a fixture

pytestmark = pytest.mark.usefixtures("pod_cgroup_cleaned")

IMAGE_SPEC = Path(__file__).resolve().parents[2] / "crust" / "guest" / "files" / "warm.json"


def host_spec(tmp_path: Path, name: str, args: list[str]) -> str:
    """The image's warm spec with the host's /usr and /lib bound read-only
    (and no resources: the test namespace's cgroup2 has no free
    controller)."""
    spec = json.loads(IMAGE_SPEC.read_text())
    spec["process"]["args"] = args
    spec["linux"].pop("resources")
    for top in ("/usr", "/lib", "/lib64"):
        if Path(top).exists():
            spec["mounts"].append({"destination": top, "type": "bind", "source": top,
                                   "options": ["bind", "nosuid", "nodev", "ro"]})
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return str(path)


async def _warm(client: AgentClient) -> tuple[int, str]:
    try:
        await client.call("Warm", agent_pb2.WarmRequest(), timeout=60)
    except ttrpc.TtrpcError as exc:
        return exc.code, exc.message
    return ttrpc.OK, ""


def test_warm_runs_one_container_and_leaves_nothing(tmp_path, pod_cgroup_cleaned):  # noqa: F811
    good = host_spec(tmp_path, "good.json", ["/bin/sh", "-c", "echo warm"])
    bad = host_spec(tmp_path, "bad.json", ["/bin/sh", "-c", "echo no"])

    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            answers = [await _warm(client), await _warm(client)]   # again: nothing of the first in its way
            left = [(tmp_path / "run" / "warm").exists(), (c.state / lifecycle.WARM_ID).exists()]
            Path(good).write_text(Path(bad).read_text())   # the spec is read at each Warm
            answers.append(await _warm(client))
            left += [(tmp_path / "run" / "warm").exists(), (c.state / lifecycle.WARM_ID).exists()]
            # An agent on a unix socket (this host) powers nothing off and kills nothing.
            try:
                await client.call("PowerOff", agent_pb2.PowerOffRequest(), timeout=10)
                answers.append((ttrpc.OK, ""))
            except ttrpc.TtrpcError as exc:
                answers.append((exc.code, exc.message))
            await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            return details, answers, left
        finally:
            await client.close()

    with crun_container_agent(tmp_path, agent_args=("--warm-spec", good)) as c:
        details, answers, left = asyncio.run(main(c))
    assert "warm" in details.capabilities
    assert answers[:2] == [(ttrpc.OK, ""), (ttrpc.OK, "")], answers
    assert answers[2][0] == ttrpc.FAILED_PRECONDITION and "ran no container (exit 0): no" in answers[2][1]
    assert answers[3][0] == ttrpc.FAILED_PRECONDITION and "serves no guest of its own" in answers[3][1]
    assert left == [False] * 4
    assert not (pod_cgroup_cleaned / lifecycle.WARM_ID).exists()


@pytest.mark.parametrize(("request_", "field"), [
    (agent_pb2.ResumeRequest(seconds=1_800_000_000, nanos=1_000_000_000, seed=b"s" * 32), "nanos"),
    (agent_pb2.ResumeRequest(seconds=0, nanos=0, seed=b"s" * 32), "seconds"),
    (agent_pb2.ResumeRequest(seconds=1_800_000_000, nanos=0, seed=b"s" * 31), "seed"),
    (agent_pb2.ResumeRequest(seconds=1_800_000_000, nanos=0, seed=b"s" * 513), "seed"),
])
def test_resume_refuses_what_is_not_a_clock_and_a_seed(request_, field):
    with pytest.raises(AgentError) as caught:
        lifecycle.check_resume(request_)
    assert caught.value.code == ttrpc.INVALID_ARGUMENT and caught.value.message.startswith(f"{field}: ")
    lifecycle.check_resume(agent_pb2.ResumeRequest(seconds=1_800_000_000, nanos=999_999_999, seed=b"s" * 512))
