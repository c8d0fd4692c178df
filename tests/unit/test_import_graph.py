"""crust's import graph, read from the source (ast; imports at module level
and inside functions alike): no circle among crust's modules, and every
arrow points down the layers (docs/architecture.md).

- crust's packages import only those drawn below them in the picture of
  docs/architecture.md (the tree, floor by floor from the bottom);
- crust.api, crust.sys and crust.common are what everything builds on:
  they import none of crust's subsystems;
- crust.guest runs inside the VM, on the guest's Python: it imports only
  itself, crust.api, crust.common and crust.sys;
- no daemon imports a command-line module (crust.cli,
  crust.oci_runtime.main, crust.containerd_shim.main);
- within crust.kata, vmm/ and agent/ are what supply/, pod/ and sandbox/
  build on and never import them; image/ imports nothing of crust.kata
  but itself.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tests.unit.helpers import REPO

CRUST = REPO / "crust"

BASE = ("crust.api", "crust.sys", "crust.common")
SUBSYSTEMS = ("crust.driver", "crust.csi_shim", "crust.proxy", "crust.runtime_handler", "crust.kata",
              "crust.guest", "crust.containerd_shim", "crust.oci_runtime", "crust.node", "crust.kubelet",
              "crust.demo", "crust.cli")
GUEST_MAY_IMPORT = ("crust.guest", "crust.api", "crust.common", "crust.sys")
CLI_MODULES = ("crust.cli", "crust.oci_runtime.main", "crust.containerd_shim.main")
# The command-line modules themselves and the programs' entries: they may
# import one another (crust.cli dispatches to the others). The runtime
# wrapper is a program of its own (a runtime's executable) that reads runc's
# command line as crust-runc does.
CLI_SIDE = (*CLI_MODULES, "crust.__main__", "crust.containerd_shim.__main__", "crust.oci_runtime.__main__",
            "crust.oci_runtime.entry", "crust.kubelet.runtime_wrapper")
# The top package (crust.__version__) is every module's to import.
TOP = "crust"
KATA_BELOW = ("crust.kata.vmm", "crust.kata.agent")
KATA_ABOVE = ("crust.kata.supply", "crust.kata.pod", "crust.kata.sandbox")

# Arrows the rules refuse that are still in the tree, each with what ends
# it. An entry that no longer matches an arrow fails the test: the list only
# shrinks.
KNOWN: dict[tuple[str, str], str] = {
}
# Circles still in the tree, each with what cuts it; the list only shrinks.
KNOWN_CIRCLES: dict[frozenset[str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(CRUST.rglob("*.py")) if "__pycache__" not in p.parts}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The crust module an imported name is (or lies in): the longest known prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The crust modules that module `name` imports, wherever in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from package import module` imports the module; `from module
            # import name` the module.
            targets = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "crust" or target.startswith("crust."):
                resolved = _resolve(target, known)
                if resolved is not None and resolved != name:
                    found.add(resolved)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle from each strongly connected part of the graph with more
    than one module (Tarjan's algorithm, iterative), as a list of modules
    whose last imports the first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        part.append(member)
                        if member == node:
                            break
                    if len(part) > 1:
                        parts.append(part)
    return [_circle_in(set(part), edges) for part in parts]


def _circle_in(part: set[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest circle through the part's first module (breadth first)."""
    start = min(part)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(edges.get(node, ()) & part):
            if child == start:
                return paths[node]
            if child not in paths:
                paths[child] = paths[node] + [child]
                queue.append(child)
    return sorted(part)


def violations(edges: dict[str, set[str]]) -> list[tuple[str, str, str]]:
    """(importer, imported, the rule) of every arrow a layer rule refuses."""
    found = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets - {TOP}):
            if _within(source, BASE) and _within(target, SUBSYSTEMS):
                found.append((source, target, "the base layer imports a subsystem"))
            if _within(source, ("crust.guest",)) and not _within(target, GUEST_MAY_IMPORT):
                found.append((source, target, "the guest imports what runs on the host"))
            if _within(target, CLI_MODULES) and not _within(source, CLI_SIDE):
                found.append((source, target, "a daemon imports a command-line module"))
            if _within(source, KATA_BELOW) and _within(target, KATA_ABOVE):
                found.append((source, target, "kata's vmm/agent import what builds on them"))
            if _within(source, ("crust.kata.image",)) and _within(target, ("crust.kata",)) \
                    and not _within(target, ("crust.kata.image",)) and target != "crust.kata":
                found.append((source, target, "kata's image build imports the rest of kata"))
    return found


def floors() -> list[str]:
    """crust's packages in the order docs/architecture.md draws them, the
    bottom first."""
    page = (REPO / "docs" / "architecture.md").read_text()
    picture = re.search(r"^```text\ncrust/\n(.*?)^\S", page, re.S | re.M)
    assert picture is not None, "docs/architecture.md draws no tree of crust/"
    return re.findall(r"^  (\w+)/", picture.group(1), re.M)


def kata_floors() -> list[str]:
    """crust.kata's subpackages in the order the picture draws them, the
    bottom first."""
    page = (REPO / "docs" / "architecture.md").read_text()
    kata = re.search(r"^  kata/.*?\n((?:    .*\n)+)", page, re.M)
    assert kata is not None, "docs/architecture.md draws no subpackages of crust/kata/"
    return re.findall(r"^    (\w+)/", kata.group(1), re.M)


def upward(edges: dict[str, set[str]], order: list[str]) -> list[tuple[str, str]]:
    """The arrows from a package to one drawn above it (a module at crust's
    top, crust.cli, is above every package)."""
    def floor(name: str) -> int:
        parts = name.split(".")
        return order.index(parts[1]) if len(parts) > 1 and parts[1] in order else len(order)

    return [(source, target) for source, targets in sorted(edges.items()) for target in sorted(targets - {TOP})
            if floor(target) > floor(source)]


def test_no_kata_subpackage_imports_one_drawn_above_it():
    order = kata_floors()
    assert order[0] == "image" and "pod" in order

    def floor(name: str) -> int:
        parts = name.split(".")
        # crust.kata.handler puts the subpackages together: above them all.
        return order.index(parts[2]) if len(parts) > 3 and parts[2] in order else len(order)

    kata = {m: {t for t in ts if t.startswith("crust.kata.")} for m, ts in graph().items() if m.startswith("crust.kata.")}
    found = [(m, t) for m, ts in sorted(kata.items()) for t in sorted(ts) if floor(t) > floor(m)]
    assert found == [], f"arrows up crust/kata's floors: {found}"


def test_the_graph_is_read():
    edges = graph()
    assert len(edges) > 200
    assert "crust.kata.pod.pods" in edges and "crust.guest.service" in edges
    # Both kinds of import are seen: one at module level, one inside a function.
    assert "crust.guest.errors" in edges["crust.guest.service"]
    assert "crust.containerd_shim.pods" in edges["crust.containerd_shim.main"]   # inside serve()


def test_no_import_circle():
    found = [c for c in cycles(graph()) if frozenset(c) not in KNOWN_CIRCLES]
    assert found == [], "import circles: " + "; ".join(" -> ".join([*c, c[0]]) for c in found)


def test_the_known_circles_are_still_there():
    found = {frozenset(c) for c in cycles(graph())}
    gone = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert gone == [], f"no longer in the tree, remove from KNOWN_CIRCLES: {gone}"


def test_every_arrow_points_down():
    found = [v for v in violations(graph()) if (v[0], v[1]) not in KNOWN]
    assert found == [], "\n".join(f"{source} -> {target}: {rule}" for source, target, rule in found)


def test_no_package_imports_one_drawn_above_it():
    order = floors()
    assert order[:3] == ["api", "sys", "common"] and "kata" in order
    assert set(order) == {p.name for p in CRUST.iterdir() if (p / "__init__.py").is_file()}
    found = [arrow for arrow in upward(graph(), order) if arrow not in KNOWN]
    assert found == [], "\n".join(f"{source} -> {target}: drawn above it" for source, target in found)
    assert upward({"crust.sys.a": {"crust.kata.b"}, "crust.kata.b": {"crust.sys.a"}, "crust.cli": {"crust.kata.b"}},
                  order) == [("crust.sys.a", "crust.kata.b")]


def test_the_known_exceptions_are_still_there():
    arrows = {(v[0], v[1]) for v in violations(graph())}
    gone = sorted(set(KNOWN) - arrows)
    assert gone == [], f"no longer in the tree, remove from KNOWN: {gone}"


def test_the_checks_see_what_they_refuse(tmp_path):
    """The cycle finder and the rules on a made-up graph."""
    edges = {"crust.a": {"crust.b"}, "crust.b": {"crust.c"}, "crust.c": {"crust.a"}, "crust.d": {"crust.a"},
             "crust.e": {"crust.e2"}, "crust.e2": set()}
    assert cycles(edges) == [["crust.a", "crust.b", "crust.c"]]
    assert cycles({"crust.a": {"crust.b"}, "crust.b": set()}) == []
    made_up = {
        "crust.common.x": {"crust.kata.vmm.qemu", "crust.sys.mount"},
        "crust.guest.y": {"crust.kata.agent.client", "crust.common.ttrpc"},
        "crust.kata.vmm.z": {"crust.kata.pod.pods", "crust.kata.agent.client"},
        "crust.kata.image.w": {"crust.kata.vmm.qemu", "crust.kata.image.cpio"},
        "crust.proxy.v": {"crust.cli"},
        "crust.cli": {"crust.oci_runtime.main"},
    }
    assert violations(made_up) == [
        ("crust.common.x", "crust.kata.vmm.qemu", "the base layer imports a subsystem"),
        ("crust.guest.y", "crust.kata.agent.client", "the guest imports what runs on the host"),
        ("crust.kata.image.w", "crust.kata.vmm.qemu", "kata's image build imports the rest of kata"),
        ("crust.kata.vmm.z", "crust.kata.pod.pods", "kata's vmm/agent import what builds on them"),
        ("crust.proxy.v", "crust.cli", "a daemon imports a command-line module"),
    ]
    # Relative imports and `from package import module` resolve to the module.
    package = tmp_path / "crust" / "p"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "m.py").write_text("def f():\n    from . import n\n    from .n import thing\n")
    (package / "n.py").write_text("from crust.p import m\n")
    known = {"crust.p": package / "__init__.py", "crust.p.m": package / "m.py", "crust.p.n": package / "n.py"}
    assert imports_of("crust.p.m", package / "m.py", known) == {"crust.p.n"}
    assert imports_of("crust.p.n", package / "n.py", known) == {"crust.p.m"}
    assert cycles({name: imports_of(name, path, known) for name, path in known.items()}) == [
        ["crust.p.m", "crust.p.n"]]


@pytest.mark.parametrize("source", [
    "import crust.common.ttrpc\n",
    "from crust.common import ttrpc\n",
    "from crust.common.ttrpc import Server\n",
    "def f():\n    from ..common import ttrpc\n",
])
def test_each_form_of_import_is_an_arrow(tmp_path, source):
    path = tmp_path / "mod.py"
    path.write_text(source)
    known = modules()
    assert imports_of("crust.guest.mod", path, known) == {"crust.common.ttrpc"}
