"""Who may import whom among tests/ and bench/: what a test module and a
benchmark share lives in tests/harness/ (and bench's own library), so no
module imports a test module, and no test imports a bench script."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.helpers import REPO

# bench's shared library: all a test may import of bench (a test runs a
# benchmark as its users do: tests/harness/bench_run.py).
BENCH_LIBRARY = "bench.lib"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_files() -> list[Path]:
    return sorted(p for top in ("tests", "bench") for p in (REPO / top).rglob("*.py"))


def known_modules() -> set[str]:
    return {module_name(p) for p in python_files()}


def imported(source: str, package: str, modules: set[str]) -> set[str]:
    """The modules source (a module of package) imports, wherever in it (a
    function's own imports too): `from a import b` names a.b when that is a
    module, a otherwise; a relative import is read against package; a
    literal name given to importlib.import_module or __import__ counts too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Name) and node.func.id == "__import__"
                   or isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            found.add(node.args[0].value)
    return found


def is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def is_bench_script(name: str) -> bool:
    if name != "bench" and not name.startswith("bench."):
        return False
    return name != BENCH_LIBRARY and not name.startswith(BENCH_LIBRARY + ".")


def imports_by_file() -> dict[str, set[str]]:
    modules = known_modules()
    found = {}
    for path in python_files():
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found[str(path.relative_to(REPO))] = imported(path.read_text(), package, modules)
    return found


def test_no_module_imports_a_test_module():
    wrong = []
    for path, names in imports_by_file().items():
        own = module_name(REPO / path)
        # A test module may name itself (to patch its own globals).
        wrong += [f"{path} imports {name}" for name in sorted(names) if is_test_module(name) and name != own]
    assert wrong == [], "shared pieces belong in tests/harness/:\n" + "\n".join(wrong)


def test_tests_import_only_benchs_library():
    found = [f"{path} imports {name}" for path, names in imports_by_file().items() if path.startswith("tests/")
             for name in sorted(names) if is_bench_script(name)]
    assert found == [], "tests may import bench.lib, not a bench script:\n" + "\n".join(found)


def test_the_reader_sees_each_way_of_importing():
    """The reader behind the checks above, on a module written for it."""
    modules = known_modules() | {"tests.integration.test_x", "tests.vm.test_y", "tests.integration.test_z"}
    source = ("import tests.integration.test_x as x\n"
              "from tests.vm import test_y\n"
              "from tests.harness.daemons import Root\n"
              "from bench.lib.benchlib import PROJECT\n"
              "from bench.lib import render\n"
              "from bench.runtime import pod_share\n"
              "from . import test_z\n"
              "from ..harness import guest_container\n"
              "def later():\n"
              "    importlib.import_module('bench.csi.hop_cost')\n")
    names = imported(source, "tests.integration", modules)
    assert {n for n in names if is_test_module(n)} == {"tests.integration.test_x", "tests.vm.test_y",
                                                        "tests.integration.test_z"}
    assert {n for n in names if is_bench_script(n)} == {"bench.runtime.pod_share", "bench.csi.hop_cost"}
    assert {"tests.harness.daemons", "tests.harness.guest_container", "bench.lib.benchlib", "bench.lib.render"} <= names
    assert is_bench_script("bench") and not is_bench_script("bench.lib")
