#!/usr/bin/env python3
"""Regenerate the tables of docs/agent-protocol.md from specs/agent.proto.

    python tools/gen_agent_doc.py            # rewrite the tables in the page
    python tools/gen_agent_doc.py --check    # exit 1 if the page is stale

The proto is the protocol's one text. The page keeps its own prose; between
each pair of markers it holds a table made from the proto's comments: the
calls (each rpc in the service's order: the capability that names it, the
first sentence of its comment, what a retry does) and the capabilities
(GuestDetailsResponse.capabilities' comment).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = ROOT / "specs" / "agent.proto"
PAGE = ROOT / "docs" / "agent-protocol.md"
TABLES = ("calls", "capabilities")


def begin_marker(table: str) -> str:
    return f"<!-- {table} table: generated from specs/agent.proto by tools/gen_agent_doc.py; do not edit -->"


def end_marker(table: str) -> str:
    return f"<!-- end of the generated {table} table -->"


def _comment_text(lines: list[str]) -> str:
    return " ".join(line.strip().removeprefix("//").strip() for line in lines).strip()


def rpcs(proto: str) -> list[tuple[str, str, str, str]]:
    """(name, request, response, comment) of each rpc of the service, in order."""
    service = re.search(r"^service \w+ \{\n(.*?)^\}", proto, re.S | re.M)
    if service is None:
        raise ValueError("no service in the proto")
    found, comment = [], []
    for line in service.group(1).splitlines():
        stripped = line.strip()
        match = re.match(r"rpc (\w+) \((\w+)\) returns \((\w+)\)", stripped)
        if match:
            found.append((*match.groups(), _comment_text(comment)))
            comment = []
        elif stripped.startswith("//") and not re.fullmatch(r"// -+ *[\w ()]*", stripped):
            comment.append(stripped)
        else:
            comment = []   # a blank line or a section header ends a comment
    return found


def capabilities(proto: str) -> dict[str, str]:
    """Each capability the proto names (GuestDetailsResponse.capabilities'
    comment: a name, then what it means, continued on indented lines)."""
    message = re.search(r"^message GuestDetailsResponse \{\n(.*?)repeated string capabilities", proto, re.S | re.M)
    if message is None:
        raise ValueError("no GuestDetailsResponse.capabilities in the proto")
    names: dict[str, list[str]] = {}
    current = None
    for line in message.group(1).splitlines():
        text = line.strip().removeprefix("//")
        entry = re.match(r"   ([a-z0-9][a-z0-9.<>-]*) {2,}(\S.*)", text)
        if entry:
            current = entry.group(1)
            names[current] = [entry.group(2)]
        elif current is not None and re.match(r" {4,}\S", text):
            names[current].append(text.strip())
        else:
            current = None
    return {name: " ".join(words) for name, words in names.items()}


def named_by(proto: str) -> dict[str, list[str]]:
    """The capabilities whose meaning names each rpc."""
    calls = [name for name, *_ in rpcs(proto)]
    found: dict[str, list[str]] = {name: [] for name in calls}
    for capability, meaning in capabilities(proto).items():
        for call in calls:
            if re.search(rf"\b{call}\b", meaning):
                found[call].append(capability)
    return found


# A summary longer than this ends at its first colon or semicolon outside
# parentheses (the comment's detail stays in the proto).
SUMMARY_CHARS = 200


def summary(text: str) -> str:
    """The comment's first sentence, at most its first clause when long."""
    match = re.match(r"(.*?\.)(?= [A-Z]|$)", text)
    sentence = match.group(1) if match else text
    if len(sentence) <= SUMMARY_CHARS:
        return sentence
    depth = 0
    for at, char in enumerate(sentence):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ":;" and sentence[at + 1:at + 2] == " ":
            return sentence[:at] + "."
    return sentence


def _retry(text: str) -> str:
    if "Retry:" in text:
        return text.split("Retry:", 1)[1].strip()
    match = re.search(r"(Mutates[^.]*(?:\([^)]*\))?\.)", text)
    return match.group(1) if match else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def calls_table(proto: str) -> str:
    names = named_by(proto)
    rows = ["| call | capability | what it does | retry |", "|---|---|---|---|"]
    retry = ""
    for name, _request, _response, comment in rpcs(proto):
        capability = ", ".join(f"`{c}`" for c in names[name]) or "none"
        # "The same for ...": as the call before it, retry included.
        retry = retry if comment.startswith("The same for") and not _retry(comment) else _retry(comment)
        rows.append(f"| `{name}` | {capability} | {_cell(summary(comment))} | {_cell(retry)} |")
    return "\n".join(rows)


def capabilities_table(proto: str) -> str:
    rows = ["| capability | means |", "|---|---|"]
    for name, meaning in capabilities(proto).items():
        rows.append(f"| `{name}` | {_cell(meaning)} |")
    return "\n".join(rows)


def render(page: str, proto: str) -> str:
    """The page with each generated table made anew from the proto."""
    for table, make in zip(TABLES, (calls_table, capabilities_table)):
        begin, end = begin_marker(table), end_marker(table)
        if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
            raise ValueError(f"{PAGE.name}: the {table} table's markers are not there once each, in order")
        head, rest = page.split(begin, 1)
        _old, tail = rest.split(end, 1)
        page = f"{head}{begin}\n{make(proto)}\n{end}{tail}"
    return page


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    args = parser.parse_args()
    page = PAGE.read_text()
    fresh = render(page, PROTO.read_text())
    if args.check:
        if fresh != page:
            print(f"{PAGE.relative_to(ROOT)} is stale (run: python tools/gen_agent_doc.py)")
            return 1
        print(f"{PAGE.relative_to(ROOT)} is up to date")
        return 0
    PAGE.write_text(fresh)
    print(f"wrote the tables of {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
