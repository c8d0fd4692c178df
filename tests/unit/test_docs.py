"""The documentation holds together: links resolve, pages and tables stay short.

- every relative link in README.md and docs/*.md names a file or directory
  of the repository, and a link with an #anchor into a Markdown file names
  one of its headings (GitHub's anchors);
- no page of docs/ is over 600 lines;
- no table cell of README.md or docs/*.md is over 300 characters;
- every file of the repository a page names by its path (a test, a bench,
  a module, a manifest) is there.

Nothing here needs root, a device or a daemon.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MAX_LINES = 600
MAX_CELL = 300

LINK = re.compile(r"(?<!\!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# A path into the repository as pages name one: tests/vm/test_kata_handler.py, deploy/crio/.
REPO_PATH = re.compile(r"(?<![\w./~-])((?:tests|bench|crust|deploy|specs|tools|examples|docs)/[\w./-]*\w)")


def pages() -> list[Path]:
    return [REPO / "README.md"] + sorted(DOCS.glob("*.md"))


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of a Markdown file outside fenced code blocks, numbered from 1."""
    out, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)   # a link in a heading keeps its text
    text = text.strip().lower()
    kept = []
    for ch in text:
        if ch in " -_" or ch.isalnum() or unicodedata.category(ch).startswith("M"):
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        text = INLINE_CODE.sub("", line)
        for pattern in (LINK, IMAGE):
            for m in pattern.finditer(text):
                found.append((number, m.group(1)))
    return found


def table_cells(line: str) -> list[str]:
    """The cells of a Markdown table row (a `\\|` is a pipe inside a cell)."""
    body = line.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    return [c.strip() for c in re.split(r"(?<!\\)\|", body)]


def test_the_pages_are_found():
    names = {p.name for p in pages()}
    assert {"README.md", "architecture.md", "limitations.md", "operations.md"} <= names


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = page if not file_part else (page.parent / file_part).resolve()
        if not dest.exists():
            broken.append(f"{page.name}:{number}: {target}: no such file")
            continue
        if not dest.resolve().is_relative_to(REPO):
            broken.append(f"{page.name}:{number}: {target}: outside the repository")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}:{number}: {target}: no heading with the anchor #{anchor}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")),
                         ids=lambda p: p.name)
def test_no_page_is_over_600_lines(page: Path):
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{page.name} has {lines} lines (at most {MAX_LINES}): split it"


@pytest.mark.parametrize("page", pages(),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_table_cell_is_over_300_characters(page: Path):
    long = []
    for number, line in prose_lines(page):
        if not line.lstrip().startswith("|"):
            continue
        for cell in table_cells(line):
            if len(cell) > MAX_CELL:
                long.append(f"{page.name}:{number}: a cell of {len(cell)} characters: {cell[:60]}...")
    assert not long, f"table cells over {MAX_CELL} characters:\n  " + "\n  ".join(long)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_file_a_page_names_is_there(page: Path):
    missing = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        for m in REPO_PATH.finditer(line):
            named = m.group(1)
            if not (REPO / named).exists() and not (page.parent / named).exists():
                missing.append(f"{page.name}:{number}: {named}")
    assert not missing, "files named but not in the repository:\n  " + "\n  ".join(missing)


def test_the_checks_themselves():
    assert slug("Stats and expansion of a deferred volume") == "stats-and-expansion-of-a-deferred-volume"
    assert slug("The microVM handler (`crust kata`)") == "the-microvm-handler-crust-kata"
    assert slug("3'. Or in a pod") == "3-or-in-a-pod"
    assert table_cells("| a | `x\\|y` | c |") == ["a", "`x\\|y`", "c"]
    assert [m.group(1) for m in REPO_PATH.finditer("(`tests/vm/test_kata_handler.py`, /var/lib/crust/x, bench/results/.)")] \
        == ["tests/vm/test_kata_handler.py", "bench/results"]


def tree_picture() -> list[str]:
    """The package tree docs/architecture.md draws: each line's folder,
    joined to the folders above it by indentation."""
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    block = text.split("```text\ncrust/\n", 1)[1].split("```", 1)[0]
    folders, stack = [], []
    for line in ["crust/", *block.splitlines()]:
        m = re.match(r"^( *)(\w+)/", line)
        if not m:
            continue
        depth = len(m.group(1)) // 2
        stack[depth:] = [m.group(2)]
        folders.append("/".join(stack))
    return folders


def packages_of_the_tree() -> list[str]:
    """The folders the picture must show: crust's packages two levels down,
    specs/, and the test tiers and benchmark groups."""
    found = ["crust", "specs", "tests", "bench"]
    for base, depth in (("crust", 2), ("tests", 1), ("bench", 1)):
        for d in sorted((REPO / base).rglob("*")):
            rel = d.relative_to(REPO / base)
            if d.is_dir() and len(rel.parts) <= depth and "__pycache__" not in rel.parts \
                    and (any(d.glob("*.py")) or any(d.glob("*.c")) or base == "crust"):
                found.append(f"{base}/{rel}")
    return found


def test_the_architecture_pages_tree_is_the_tree():
    drawn, there = tree_picture(), packages_of_the_tree()
    assert sorted(set(drawn) - set(there)) == [], "drawn but not in the tree"
    assert sorted(set(there) - set(drawn)) == [], "in the tree but not drawn"
