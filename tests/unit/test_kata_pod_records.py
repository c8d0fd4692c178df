"""What a microVM pod's record holds (crust.kata.pod.records): the
containers and their own processes, never an exec, so its size and the
bytes of each write do not grow with the execs a pod ran."""

from __future__ import annotations

import json

from crust.common.formats import decode, encode
from crust.kata.pod.records import ContainerRecord, PodRecord, ProcessRecord


def _pod(execs: int) -> PodRecord:
    c = ContainerRecord(container_id="app", bundle="/b/app",
                        processes={"": ProcessRecord(args=["sh"], env=["A=1"], pid=7)})
    for n in range(execs):
        c.processes[f"e{n}"] = ProcessRecord(exec_id=f"e{n}", args=["true"], env=["X" * 40_000], pid=100 + n,
                                             exit_code=0, on_port=True)
    return PodRecord(sandbox_id="pod", bundle="/b/pod", containers={"app": c}, created_at=1.0)


def test_a_pods_record_holds_no_exec_whatever_it_ran():
    none, many = encode(_pod(0)), encode(_pod(200))
    assert many == none
    assert list(json.loads(many)["containers"]["app"]["processes"]) == [""]


def test_a_record_an_older_crust_wrote_with_its_execs_reads_without_them():
    older = json.loads(encode(_pod(0)))
    older["containers"]["app"]["processes"]["e1"] = {"exec_id": "e1", "args": ["true"], "env": ["X=1"], "pid": 9}
    pod = decode(PodRecord, json.dumps(older).encode())
    assert list(pod.containers["app"].processes) == [""]
    assert pod.containers["app"].processes[""].pid == 7
