"""tests/harness/upstream.py: where an upstream program is found, what a test of
its suite does when it is not, and the run's closing lines, seen through a
real pytest run (with xdist's workers too) of a small test module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import upstream
from tests.harness.upstream import CONTAINERD2, CSI_SANITY, CRIO, HOSTPATHPLUGIN, PINNS, locate, usable

PROJECT = Path(__file__).resolve().parents[2]


def program(directory: Path, name: str, body: str = "exit 0", mode: int = 0o755) -> Path:
    path = directory / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(mode)
    return path


def test_absent_everywhere_is_a_skip_naming_the_program_its_project_and_variable(tmp_path):
    found = locate(CSI_SANITY, {"PATH": str(tmp_path)})
    assert found.path is None and not found.unusable
    assert found.absent == "csi-sanity not found (kubernetes-csi/csi-test): set CSI_SANITY or put it on PATH"


def test_found_on_path(tmp_path):
    made = program(tmp_path, "csi-sanity")
    assert locate(CSI_SANITY, {"PATH": f"/nonexistent:{tmp_path}"}).path == made


def test_a_file_on_path_that_cannot_run_is_not_the_program(tmp_path):
    program(tmp_path, "crio", mode=0o644)
    assert locate(CRIO, {"PATH": str(tmp_path)}).absent.startswith("crio not found (cri-o/cri-o)")


def test_the_variable_wins_over_path(tmp_path):
    (tmp_path / "bin").mkdir()
    program(tmp_path / "bin", "pinns")
    own = program(tmp_path, "my-pinns")
    assert locate(PINNS, {"PATH": str(tmp_path / "bin"), "PINNS": str(own)}).path == own


@pytest.mark.parametrize("what", ["not executable", "missing", "a directory"])
def test_a_variable_naming_what_cannot_run_is_a_failure_not_a_skip(tmp_path, what):
    given = {"not executable": lambda: program(tmp_path, "x", mode=0o644), "missing": lambda: tmp_path / "none",
             "a directory": lambda: tmp_path}[what]()
    found = locate(CSI_SANITY, {"PATH": "", "CSI_SANITY": str(given)})
    assert found.path is None and not found.absent
    assert found.unusable == f"CSI_SANITY={given} is not an executable file (csi-sanity, kubernetes-csi/csi-test)"


def test_a_reference_driver_built_without_a_version_is_unusable(tmp_path):
    bare = program(tmp_path, "hostpathplugin", 'echo "hostpathplugin"')
    found = usable(locate(HOSTPATHPLUGIN, {"HOSTPATHPLUGIN": str(bare)}))
    assert found.path is None and "has no version" in found.unusable
    versioned = program(tmp_path, "hostpathplugin2", 'echo "hostpathplugin v1.17.0"')
    assert usable(locate(HOSTPATHPLUGIN, {"HOSTPATHPLUGIN": str(versioned)})).path == versioned


# -- a real run -------------------------------------------------------------------------------------

SUITE_MODULE = '''
import pytest
from tests.harness import upstream


@upstream.suite("csi-sanity", upstream.CSI_SANITY)
@pytest.mark.parametrize("target", ["driver", "shim"])
def test_sanity(request, target):
    assert upstream.path(upstream.CSI_SANITY).is_file()
    upstream.record(request.node, "csi-sanity", target, 3, 0, 1)


@upstream.suite("critest")
@pytest.mark.parametrize("engine", ["containerd", pytest.param("crio", marks=upstream.suite("critest", upstream.CRIO))])
def test_critest(request, engine):
    upstream.record(request.node, "critest", engine, 10, 2, 5)


def test_no_suite():
    pass
'''
CONFTEST = '''
from tests.harness import upstream


def pytest_configure(config):
    config.addinivalue_line("markers", "upstream: an upstream suite")
    config.pluginmanager.register(upstream.Reporter(), "crust-upstream")
'''


def run_pytest(tmp_path: Path, environ: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "t").mkdir(exist_ok=True)
    (tmp_path / "t" / "test_suite.py").write_text(SUITE_MODULE)
    (tmp_path / "t" / "conftest.py").write_text(CONFTEST)
    env = {"PATH": os.defpath, "PYTHONPATH": str(PROJECT), "CI": "true", **environ}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                           f"--rootdir={tmp_path / 't'}", "-c", "/dev/null", *args, str(tmp_path / "t")],
                          capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)


def closing_lines(output: str) -> list[str]:
    _, _, after = output.partition("upstream suites")
    return [line for line in after.splitlines()[1:] if line.startswith(("csi-sanity:", "critest:"))]


def test_a_ci_run_without_the_programs_skips_their_tests_and_says_so_at_the_end(tmp_path):
    done = run_pytest(tmp_path, {}, "-p", "no:xdist")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed, 3 skipped" in done.stdout
    assert closing_lines(done.stdout) == [
        f"critest: ran: tests 1 passed; containerd: 10 passed, 2 failed, 5 skipped specs; "
        f"skipped where {CRIO.missing()}",
        f"csi-sanity: skipped: {CSI_SANITY.missing()}",
    ]


def test_a_run_with_the_programs_gives_each_suites_counts_from_xdists_workers(tmp_path):
    (tmp_path / "bin").mkdir()
    program(tmp_path / "bin", "csi-sanity")
    done = run_pytest(tmp_path, {"PATH": f"{tmp_path / 'bin'}:{os.defpath}"}, "-n", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed, 1 skipped" in done.stdout
    assert closing_lines(done.stdout) == [
        f"critest: ran: tests 1 passed; containerd: 10 passed, 2 failed, 5 skipped specs; "
        f"skipped where {CRIO.missing()}",
        "csi-sanity: ran: tests 2 passed; driver: 3 passed, 0 failed, 1 skipped specs; "
        "shim: 3 passed, 0 failed, 1 skipped specs",
    ]


def test_a_variable_naming_nothing_fails_the_suites_tests(tmp_path):
    done = run_pytest(tmp_path, {"CSI_SANITY": str(tmp_path / "none")}, "-p", "no:xdist")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed, 1 skipped, 2 errors" in done.stdout and f"CSI_SANITY={tmp_path / 'none'} is not an executable file" in done.stdout
    assert closing_lines(done.stdout)[-1] == "csi-sanity: failed: tests 2 failed"


def test_every_program_names_its_project_and_variable():
    for p in upstream.PROGRAMS:
        assert "/" in p.project and p.variable.isupper() and p.missing().startswith(f"{p.name} not found")


def test_containerd_2_is_found_by_its_variable_alone_and_must_be_a_2x(tmp_path):
    program(tmp_path, "containerd", 'echo "containerd containerd.io 1.6.20~ds1 1.6.20~ds1-1"')
    assert locate(CONTAINERD2, {"PATH": str(tmp_path)}).absent == \
        "containerd 2.x not found (containerd/containerd): set CONTAINERD2"
    old = usable(locate(CONTAINERD2, {"CONTAINERD2": str(tmp_path / "containerd")}))
    assert old.path is None and old.unusable.endswith("is containerd 1.6, not a 2.x")
    new = program(tmp_path, "c2", 'echo "containerd github.com/containerd/containerd/v2 v2.3.4 0123abc"')
    assert usable(locate(CONTAINERD2, {"CONTAINERD2": str(new)})).path == new
