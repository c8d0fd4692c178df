"""The CRI conformance suite (critest, kubernetes-sigs/cri-tools) on every
run, against each engine kubelet drives (tests/critest.ENGINES), one node
after the other (critest's fixed host ports allow one run at a time):
- a private containerd 1.6 with three runtime handlers: `runc` (the
  baseline), `crust-runc` (crust's OCI runtime) and `crust-microvm`
  (handler `crust`: crust's shim v2 and the microVM handler, under tcg
  here);
- a private CRI-O with `runc` and `crust-runc` (crust's OCI runtime behind
  conmon, its settings in the handler's monitor_env).
No network: a local registry holds the images critest pulls
(tests/harness/critest_images.py), and each engine mirrors every registry critest
names to it.

Spec by spec, by name, per engine:
- runc's failures are exactly that engine's baseline list of
  docs/critest.yaml (this machine's and the engine's) and the specs that
  need a real registry;
- crust-runc passes every spec runc passes in the same run, and fails
  nothing but what runc fails;
- crust-microvm fails nothing but those and its exceptions (the microvm
  list: a reason and the issue that fixes each, or why a VM cannot), and
  a listed spec that passes fails the test, so the lists stay true and only
  shrink. In CI the microVM runs the specs of the groups
  tests/critest.MICROVM_CI_GROUPS names that no list says fail (every one
  must pass); CRUST_CRITEST_MICROVM=all runs every spec of every group, the
  listed ones included (the longer job, README and docs/conformance.md).
A failure on no list is run once more, alone, before it counts: one that
passes then is reported as a warning naming the spec and its first failure
(critest's OOM spec races containerd 1.6's runc shim, see
docs/conformance.md), and one that fails again fails the test.

critest is not part of crust (kubernetes-sigs/cri-tools' cmd/critest), nor
is CRI-O (cri-o/cri-o's crio and pinns): each is found on PATH or by CRITEST,
CRIO and PINNS (tests/harness/upstream.py). Without critest this module is skipped,
without CRI-O its CRI-O runs are, naming the missing program, in CI too.
"""

from __future__ import annotations

import os
import subprocess
import warnings

import pytest

from crust.kubelet import cni
from crust.kubelet import registry as local_registry
from crust.kubelet.crio import available as crio_available
from tests.harness.critest import (ENGINES, FAILED, MICROVM_ALL, MICROVM_CI_GROUPS, PASSED, SKIPPED, Run,
                           critest_node, documented_expectations, exact_focus, group_specs, list_specs,
                           load_expectations, read_report, render_expectations, rerun_unexpected_failures,
                           run_critest, run_critest_sharded)
from tests.harness import upstream
from tests.harness.crio import crio_tools
from tests.harness.upstream import CONTAINERD2, CRIO, CRITEST, PINNS

pytestmark = pytest.mark.slow
# The tests that run critest (the lists' own checks need no program).
RUNS_CRITEST = upstream.suite("critest", CRITEST)
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")

# runc and crust-runc take 1.5 to 2.5 minutes each here; the microVM about
# 11 s a spec under tcg.
TIMEOUTS = {"runc": 900, "crust-runc": 900, "crust-microvm": 3600 if MICROVM_ALL else 1500}
# The microVM's specs run in this many critest runs at once (run_critest_sharded).
MICROVM_SHARDS = int(os.environ.get("CRUST_CRITEST_SHARDS", "2"))


@pytest.fixture(scope="module")
def critest():
    problems = [p for p in (local_registry.available(), cni.available()) if p]
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)
    return upstream.path(CRITEST)


# The engines whose nodes run the microVM's handler (ENGINES names the
# RuntimeClasses each one serves).
MICROVM_ENGINES = [engine for engine, classes in ENGINES.items() if "crust-microvm" in classes]
# CRI-O's runs need its programs, containerd 2's its binary; without them
# they are skipped, containerd 1.6's run.
ENGINE_MARKS = {"crio": [upstream.suite("critest", CRITEST, CRIO, PINNS)],
                "containerd2": [upstream.suite("critest", CRITEST, CONTAINERD2)]}


def engine_params(engines) -> list:
    return [pytest.param(engine, marks=ENGINE_MARKS.get(engine, []), id=engine) for engine in engines]


def engine_problem(engine: str) -> str:
    """Why this engine cannot run here ("" when it can)."""
    if engine != "crio":
        return ""
    tools = crio_tools()
    return crio_available(tools["crio"], tools["pinns"])


@pytest.fixture(scope="module", params=engine_params(ENGINES))
def node(request, critest):
    """One engine's node at a time: pytest closes one before it starts
    the next (the tests are ordered by engine)."""
    problem = engine_problem(request.param)
    if problem:
        if IN_CI:
            pytest.fail(f"CI=true and {request.param} cannot run: {problem}", pytrace=False)
        pytest.skip(problem)
    with critest_node(request.param) as made:
        yield made


@pytest.fixture(scope="module")
def runs(critest, node):
    """Each handler's run, made once (crust-runc's test needs runc's)."""
    made: dict[str, Run] = {}

    def run(runtime_class: str) -> Run:
        if runtime_class not in made:
            if runtime_class == "crust-microvm":
                # CI's groups, without the specs the lists say fail (each
                # costs a VM boot, some a one-minute timeout): the longer
                # job runs those, and fails when one of them passes.
                everything = list_specs(critest, node.root.path)
                names = {n for n, s in everything.items() if s.state != SKIPPED}
                if not MICROVM_ALL:
                    listed = load_expectations()
                    expected_to_fail = listed.known_failures(node.engine, runtime_class)
                    names = group_specs(everything, MICROVM_CI_GROUPS) - expected_to_fail
                first = run_critest_sharded(critest, node, runtime_class, names, MICROVM_SHARDS,
                                            timeout=TIMEOUTS[runtime_class])
            else:
                first = run_critest(critest, node, runtime_class, timeout=TIMEOUTS[runtime_class])
            # A spec counted for no handler on this engine is not run again either.
            expected = load_expectations()
            made[runtime_class] = rerun_unexpected_failures(
                critest, node, first,
                expected.known_failures(node.engine, runtime_class) | expected.unstable_on(node.engine))
        return made[runtime_class]

    return run


def summary(run: Run) -> str:
    counts = run.counts()
    line = (f"critest on {run.engine} --runtime-handler={ENGINES[run.engine][run.handler]} ({run.handler}): "
            f"ran {counts['ran']}, passed {counts[PASSED]}, failed {counts[FAILED]}, skipped {counts[SKIPPED]} "
            f"in {run.seconds:.0f} s")
    if run.host_traces:
        line += f"; released {len(run.host_traces)} mounts its specs left on the host"
    if run.flaked:
        line += f"; {len(run.flaked)} passed only when run again: " + "; ".join(
            f"{name} (first: {why})" for name, why in sorted(run.flaked.items()))
    return line


def check_against_lists(run: Run, test: pytest.Item) -> None:
    """Failures on no list, and listed specs that passed, fail the test;
    the run's counts go to the run's closing lines."""
    counts = run.counts()
    upstream.record(test, "critest", f"{run.engine} {run.handler}", counts[PASSED], counts[FAILED], counts[SKIPPED])
    expected = load_expectations()
    if not run.specs:
        pytest.fail(f"critest for {run.handler} wrote no report (exit {run.returncode}):\n{run.output[-3000:]}",
                    pytrace=False)
    known = expected.known_failures(run.engine, run.handler)
    unexpected = sorted(run.named(FAILED) - known - expected.unstable_on(run.engine))
    # The baseline is runc's: the microVM passing one of those (it runs no
    # runc) says nothing about the list.
    must_fail = known - set(expected.baseline(run.engine)) if run.handler == "crust-microvm" else known
    listed_but_passed = sorted(run.named(PASSED) & must_fail)
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} specs failed that no list of docs/critest.yaml names:\n  "
                        + "\n  ".join(f"{n}\n      {run.why(n)}" for n in unexpected))
    if listed_but_passed:
        problems.append(f"{len(listed_but_passed)} specs passed that docs/critest.yaml lists as failing "
                        "(take them off the list):\n  " + "\n  ".join(listed_but_passed))
    print(summary(run))
    if run.flaked:
        warnings.warn(f"critest on {run.engine}, {run.handler}: passed only when run again: {summary(run)}",
                      stacklevel=1)
    if problems:
        pytest.fail(f"{summary(run)}\n" + "\n".join(problems), pytrace=False)


# -- the lists ----------------------------------------------------------------------------------------


def test_the_lists_are_well_formed_and_disjoint():
    """The lists an engine's runs are checked against are disjoint: its
    baseline and the registry's list, and the microVM's too where the
    engine runs the microVM (the microVM's exceptions are specs runc
    passes there). The engines' baselines may share a spec (the image's
    fault is both's). Every engine has a baseline, every entry a reason."""
    expected = load_expectations()
    assert set(expected.baselines) == set(ENGINES)
    for engine, baseline in expected.baselines.items():
        lists = [set(baseline), set(expected.needs_registry), expected.unstable_on(engine)]
        if engine in MICROVM_ENGINES:
            lists.append(set(expected.microvm_for(engine)))
        assert all(not (a & b) for i, a in enumerate(lists) for b in lists[i + 1:]), f"{engine}: a spec is on two lists"
        assert all(baseline.values()), f"{engine}: a baseline spec without a reason"
        assert all(expected.unstable.get(engine, {}).values()), f"{engine}: an unstable spec without a reason"
    assert not set(expected.needs_registry) & set(expected.microvm)
    for spec, entry in expected.microvm.items():
        assert entry.get("reason"), f"{spec}: no reason"
        assert set(entry.get("engines", ENGINES)) <= set(MICROVM_ENGINES), f"{spec}: an engine without the microVM"
        why_not = [bool(entry.get("issue") in (35, 36, 37)), bool(entry.get("vm_cannot")),
                   bool(entry.get("engine_lacks"))]
        assert sum(why_not) == 1, (f"{spec}: name the issue that fixes it (35, 36, 37), why a VM cannot, or what "
                                   "the engine lacks: one of the three")
        assert not entry.get("engine_lacks") or entry.get("engines"), f"{spec}: which engine lacks it?"


def test_the_doc_shows_the_lists():
    assert documented_expectations() == render_expectations(load_expectations()), \
        "docs/conformance.md does not show docs/critest.yaml: paste `python -m tests.harness.critest` between its markers"


@RUNS_CRITEST
def test_the_ci_focus_selects_exactly_the_ci_groups(critest, tmp_path):
    """The microVM's focus in CI, as critest itself applies it (a dry run):
    every spec of the groups MICROVM_CI_GROUPS names, and nothing else
    (not Image Manager's, nor a group whose name only begins as one of
    them: Container's focus takes nothing of Container Mount Readonly's
    unless that group is named too)."""
    everything = list_specs(critest, tmp_path)
    chosen = group_specs(everything, MICROVM_CI_GROUPS)
    assert {everything[n].group for n in chosen} == {f"[k8s.io] {g}" for g in MICROVM_CI_GROUPS}
    without = group_specs(everything, tuple(g for g in MICROVM_CI_GROUPS if g != "Container Mount Readonly"))
    assert not any(n.startswith("[k8s.io] Container Mount Readonly") for n in without)
    report = tmp_path / "focused.json"
    subprocess.run([str(critest), "--ginkgo.dry-run", "--ginkgo.no-color", f"--ginkgo.json-report={report}",
                    f"--ginkgo.focus={exact_focus(chosen)}"], capture_output=True, text=True, cwd=tmp_path,
                   timeout=60)
    focused = read_report(report)
    assert {n for n, s in focused.items() if s.state == PASSED} == chosen


# -- the runs -----------------------------------------------------------------------------------------


@RUNS_CRITEST
def test_critest_runc_fails_only_the_baseline(request, runs):
    check_against_lists(runs("runc"), request.node)


@RUNS_CRITEST
def test_critest_crust_runc_passes_every_spec_runc_passes(request, runs):
    baseline, crust = runs("runc"), runs("crust-runc")
    missing = sorted(baseline.named(PASSED) - crust.named(PASSED) - load_expectations().unstable_on(crust.engine))
    how = {n: f"{crust.specs[n].state}: {crust.why(n)}" if n in crust.specs else "not run" for n in missing}
    assert not missing, (f"{summary(crust)}\n{summary(baseline)}\ncrust-runc does not pass {len(missing)} specs runc "
                         "passes:\n  " + "\n  ".join(f"{n}: {how[n]}" for n in missing))
    check_against_lists(crust, request.node)


@RUNS_CRITEST
@pytest.mark.parametrize("node", engine_params(MICROVM_ENGINES), indirect=True)
def test_critest_crust_microvm_fails_only_its_listed_exceptions(request, runs):
    microvm = runs("crust-microvm")
    check_against_lists(microvm, request.node)
    # Each exception is a spec runc passes (else it belongs on the baseline).
    baseline = runs("runc")
    expected = load_expectations()
    not_runc_passes = sorted(s for s in expected.microvm_for(microvm.engine)
                             if s in baseline.specs and s not in baseline.named(PASSED))
    assert not not_runc_passes, f"listed as the microVM's exceptions, but runc does not pass them: {not_runc_passes}"
