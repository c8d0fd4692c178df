"""The upstream programs the tests and benches drive, and what became of
each upstream suite in a run.

None of these programs is part of crust, and nothing in the repository
ships, downloads or builds them: each is another project's program, built
from that project's public source by whoever runs the suites. A program is
found at the path its environment variable names (CSI_SANITY=/opt/x/csi-sanity),
else on PATH; a program found nowhere skips the tests that need it, with one
line naming it and the project it comes from. That skip is the one a CI run
accepts: a program that is missing says nothing about crust. A variable
naming something that cannot run, or a program found but unusable, fails
the tests instead (the suite was asked for and could not run).

A test module names its suite and programs with `suite()`, a mark that
the `Reporter` plugin (registered by tests/conftest.py) checks before each
test, before its fixtures; the tests that ran a suite record its counts with
`record()`, and the plugin prints one line per upstream suite at the end of
the run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from crust.kubelet.containerd import version_of


@dataclass(frozen=True)
class Program:
    name: str  # the command's name on PATH
    variable: str  # the environment variable naming a build of one's own
    project: str  # the public repository it is built from
    command: str  # what of that project it is
    on_path: bool = True  # else found by its variable alone

    def missing(self) -> str:
        if not self.on_path:
            return f"{self.name} not found ({self.project}): set {self.variable}"
        return f"{self.name} not found ({self.project}): set {self.variable} or put it on PATH"


CSI_SANITY = Program("csi-sanity", "CSI_SANITY", "kubernetes-csi/csi-test", "cmd/csi-sanity, CSI's conformance suite")
HOSTPATHPLUGIN = Program("hostpathplugin", "HOSTPATHPLUGIN", "kubernetes-csi/csi-driver-host-path",
                         "cmd/hostpathplugin, the reference driver, built with a version")
NODE_DRIVER_REGISTRAR = Program("csi-node-driver-registrar", "NODE_DRIVER_REGISTRAR",
                                "kubernetes-csi/node-driver-registrar",
                                "cmd/csi-node-driver-registrar, kubelet's plugin registration sidecar")
LIVENESSPROBE = Program("livenessprobe", "LIVENESSPROBE", "kubernetes-csi/livenessprobe",
                        "cmd/livenessprobe, the CSI health sidecar")
CRICTL = Program("crictl", "CRICTL", "kubernetes-sigs/cri-tools", "cmd/crictl, the CRI client")
CRITEST = Program("critest", "CRITEST", "kubernetes-sigs/cri-tools",
                  "cmd/critest, CRI's validation suite (a Go test binary)")
CRIO = Program("crio", "CRIO", "cri-o/cri-o", "cmd/crio, with cgo (seccomp, libsqlite3)")
PINNS = Program("pinns", "PINNS", "cri-o/cri-o", "pinns/, CRI-O's namespace pinner")
# Debian's containerd 1.6 is installed by ./run; a 2.x is looked for by this
# variable alone (its name on PATH is the 1.6 one's), with its ctr and
# containerd-shim-runc-v2 in the same directory.
CONTAINERD2 = Program("containerd 2.x", "CONTAINERD2", "containerd/containerd",
                      "cmd/containerd of a 2.x release, its ctr and containerd-shim-runc-v2 beside it",
                      on_path=False)
PROGRAMS = (CSI_SANITY, HOSTPATHPLUGIN, NODE_DRIVER_REGISTRAR, LIVENESSPROBE, CRICTL, CRITEST, CRIO, PINNS,
            CONTAINERD2)
BY_NAME = {p.variable: p for p in PROGRAMS}


@dataclass(frozen=True)
class Found:
    """Where a program is, or why it cannot be used: absent (skip) or
    unusable (fail)."""

    program: Program
    path: Path | None = None
    absent: str = ""  # the skip's line
    unusable: str = ""  # the failure's line


def locate(program: Program, environ: Mapping[str, str] = os.environ) -> Found:
    """The program at its variable's path, else on the environment's PATH."""
    given = environ.get(program.variable, "")
    if given:
        path = Path(given)
        if not (path.is_file() and os.access(path, os.X_OK)):
            return Found(program, unusable=f"{program.variable}={given} is not an executable file "
                                           f"({program.name}, {program.project})")
        return Found(program, path=path)
    on_path = shutil.which(program.name, path=environ.get("PATH", os.defpath)) if program.on_path else None
    if on_path is None:
        return Found(program, absent=program.missing())
    return Found(program, path=Path(on_path))


def usable(found: Found) -> Found:
    """What a found program's own answer says of it, for those that can be
    built so that they refuse to serve."""
    if found.path is None:
        return found
    if found.program is CONTAINERD2:
        release = version_of(str(found.path))
        if release < (2, 0):
            return Found(found.program, unusable=f"{CONTAINERD2.variable}={found.path} is containerd "
                                                 f"{release[0]}.{release[1]}, not a 2.x")
        return found
    if found.program is not HOSTPATHPLUGIN:
        return found
    # Built without `-X main.version=...` it refuses to start ("Driver is
    # missing version"); `-version` then prints its name alone.
    shown = subprocess.run([str(found.path), "-version"], capture_output=True, text=True, timeout=30).stdout.split()
    if len(shown) < 2:
        return Found(found.program, unusable=f"{found.program.name} at {found.path} has no version, so it refuses "
                                             f"to start: build {found.program.project} with one")
    return found


@functools.cache
def find(program: Program) -> Found:
    """The program for this process (looked up once)."""
    return usable(locate(program))


def path(program: Program) -> Path:
    """The path of a program a test's `suite()` mark made sure of."""
    found = find(program)
    if found.path is None:
        raise LookupError(found.absent or found.unusable)
    return found.path


# -- suites in a run ----------------------------------------------------------------------------------

MARK = "upstream"
SUITE_PROPERTY = "upstream-suite"  # (suite, "") on every test of a suite
MISSING_PROPERTY = "upstream-missing"  # (suite, the skip's line)
COUNTS_PROPERTY = "upstream-counts"  # (suite, {"target": ..., "passed": n, ...})


def suite(name: str, *programs: Program) -> pytest.MarkDecorator:
    """The mark of a test (or a module's pytestmark, or a fixture param)
    that runs the upstream suite `name` and needs `programs`."""
    return getattr(pytest.mark, MARK)(name, *(p.variable for p in programs))


def check(item: pytest.Item) -> None:
    """Before a test of an upstream suite: skip it when a program is
    absent, fail it when one is unusable."""
    marks = list(item.iter_markers(MARK))
    if not marks:
        return
    name = marks[-1].args[0]  # the module's own: a param's mark adds programs, not a suite
    item.user_properties.append((SUITE_PROPERTY, (name, "")))
    programs = [BY_NAME[p] for mark in marks for p in mark.args[1:]]
    found = [find(p) for p in dict.fromkeys(programs)]
    unusable = [f.unusable for f in found if f.unusable]
    if unusable:
        pytest.fail("; ".join(unusable), pytrace=False)
    absent = [f.absent for f in found if f.absent]
    if absent:
        item.user_properties.extend((MISSING_PROPERTY, (name, line)) for line in absent)
        pytest.skip("; ".join(absent))


def record(node: pytest.Item, suite_name: str, target: str, passed: int, failed: int, skipped: int) -> None:
    """One run of an upstream suite against one target (a runtime, a
    driver stack), for the run's closing lines."""
    node.user_properties.append(
        (COUNTS_PROPERTY, (suite_name, {"target": target, "passed": passed, "failed": failed, "skipped": skipped})))


@dataclass
class SuiteOutcome:
    tests: dict[str, int] = field(default_factory=dict)  # outcome -> tests
    missing: set[str] = field(default_factory=set)
    runs: dict[str, dict] = field(default_factory=dict)  # target -> counts (the last recorded)

    def line(self, name: str) -> str:
        tests = ", ".join(f"{n} {outcome}" for outcome, n in sorted(self.tests.items()) if outcome != "skipped")
        if not self.runs and not tests:
            return f"{name}: skipped: {'; '.join(sorted(self.missing)) or 'no test of it ran'}"
        # Tests that all failed before the suite gave any count did not run it.
        ran = self.runs or self.tests.get("passed")
        parts = [f"{'ran' if ran else 'failed'}: tests {tests}"]
        parts += [f"{target}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped specs"
                  for target, c in self.runs.items()]
        if self.missing:
            parts.append("skipped where " + "; ".join(sorted(self.missing)))
        return f"{name}: " + "; ".join(parts)


class Outcomes:
    """What the run's test reports say of each upstream suite (reports
    from xdist's workers arrive here with their user properties)."""

    def __init__(self) -> None:
        self.suites: dict[str, SuiteOutcome] = {}

    def add(self, when: str, outcome: str, properties: Iterable[tuple[str, object]]) -> None:
        properties = list(properties)
        names = [value[0] for key, value in properties if key == SUITE_PROPERTY]
        if not names:
            return
        result = self.suites.setdefault(names[0], SuiteOutcome())
        for key, value in properties:
            if key == MISSING_PROPERTY:
                result.missing.add(value[1])
            elif key == COUNTS_PROPERTY:
                counts = dict(value[1])
                result.runs[counts.pop("target")] = counts
        # A test counts once: its call, or the phase that ended it early.
        if when == "call" or outcome != "passed" and when == "setup":
            result.tests[outcome] = result.tests.get(outcome, 0) + 1

    def summary_lines(self) -> list[str]:
        return [self.suites[name].line(name) for name in sorted(self.suites)]


class Reporter:
    """The pytest plugin: a suite's mark checked before each test's
    fixtures, the reports gathered (with xdist, the workers' arrive at the
    controller with their user properties), one line per suite printed."""

    def __init__(self) -> None:
        self.outcomes = Outcomes()

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        check(item)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.outcomes.add(report.when, report.outcome, report.user_properties)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        lines = self.outcomes.summary_lines()
        if lines:
            terminalreporter.section("upstream suites")
            for line in lines:
                terminalreporter.write_line(line)
