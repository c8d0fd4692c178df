"""Format versions of the files crust writes and reads back.

Every record names the format it was written in, as its first key:

    {
     "format_version": 1,
     "volume_id": "vol-1",
     ...

A record model declares the version it writes as FORMAT_VERSION (a
ClassVar; 1 when it declares none). A file without the key was written
before formats were named: it is version 1. A reader takes its own version
and every older one; a model whose format changed in a way the plain
model cannot read defines `upgrade_format(version, data) -> data`, called
with the parsed JSON of an older file. A newer version is refused
(NewerFormat, naming the file and both versions): a newer crust may have
given a key a meaning this one does not know, and acting on a half-read
record could lose a volume. Bump FORMAT_VERSION only when an older crust
would misread the new records; a key added with a default is read by an
older crust as if absent, which is no reason to lock it out.

The key is spliced in front of pydantic's own JSON, so a write costs what
it cost before: no second serialisation, no extra read or fsync. A read
finds the key with one match on the first bytes.

mountInfo.json names its version under its own key, "crust-schema-version"
(crust.contract.mountinfo), with the same rule.
"""

from __future__ import annotations

import json
import os
import re
from typing import TypeVar

from pydantic import BaseModel

from crust import __version__

FORMAT_KEY = "format_version"

Model = TypeVar("Model", bound=BaseModel)

# Where encode() puts the key: the first one, however the JSON is indented.
_LEADING = re.compile(rb'\A\s*\{\s*"format_version"\s*:\s*(\d+)\s*[,}]')


class NewerFormat(Exception):
    """A file written by a newer crust in a format this one does not read.

    Deliberately no ValueError: code that takes an unreadable record for a
    corrupt one (and moves it aside) must never do that to a newer one."""

    def __init__(self, path: str | os.PathLike | None, what: str, found: int, known: int):
        self.path, self.what, self.found, self.known = path, what, found, known
        where = f"{path}: " if path is not None else ""
        super().__init__(
            f"{where}{what} format version {found} was written by a newer crust; crust {__version__} reads "
            f"versions 1 to {known} only, and refuses it rather than misread it. Run a crust that reads "
            f"version {found} on these directories (the release that wrote it, or a newer one).")

    def at(self, path: str | os.PathLike) -> "NewerFormat":
        """The same refusal, naming the file it was found in."""
        return NewerFormat(path, self.what, self.found, self.known)


def format_version(model: type[BaseModel]) -> int:
    """The format version a model writes (FORMAT_VERSION, else 1)."""
    return getattr(model, "FORMAT_VERSION", 1)


def found_version(data: bytes) -> int:
    """The format version a file names (1 when it names none)."""
    match = _LEADING.match(data)
    if match and int(match.group(1)) >= 1:
        return int(match.group(1))
    if b'"format_version"' not in data:
        return 1  # written before formats were named (or not JSON at all: validation says so)
    try:
        value = json.loads(data)
    except ValueError:
        return 1
    version = value.get(FORMAT_KEY, 1) if isinstance(value, dict) else 1
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{FORMAT_KEY} must be a positive integer, not {version!r}")
    return version


def encode(record: BaseModel, indent: int | None = 1) -> bytes:
    """The record's JSON with its format version as the first key."""
    body = record.model_dump_json(indent=indent)
    lead = "\n" + " " * indent if indent is not None else ""
    head = f'{{{lead}"{FORMAT_KEY}":{" " if indent is not None else ""}{format_version(type(record))}'
    if body == "{}":
        return (head + ("\n" if indent is not None else "") + "}").encode()
    return (head + "," + body[1:]).encode()


def decode(model: type[Model], data: bytes, path: str | os.PathLike | None = None) -> Model:
    """A record of model from the bytes of the file at path: its own
    version, or an older one (upgraded); NewerFormat for a newer one;
    ValueError (pydantic's ValidationError included) when it is no record."""
    known = format_version(model)
    found = found_version(data)
    if found > known:
        raise NewerFormat(path, f"{model.__name__} record", found, known)
    try:
        if found < known and hasattr(model, "upgrade_format"):
            raw = json.loads(data)
            if not isinstance(raw, dict):
                raise ValueError(f"a {model.__name__} record is a JSON object")
            raw.pop(FORMAT_KEY, None)
            for version in range(found, known):
                raw = model.upgrade_format(version, raw)
            return model.model_validate(raw)
        return model.model_validate_json(data)
    except NewerFormat as exc:  # a part of the record in a newer format (a mountInfo)
        if path is None:
            raise
        raise exc.at(path) from None


def check_newest(path: str | os.PathLike, model: type[BaseModel], head_bytes: int = 128) -> None:
    """NewerFormat if the file at path names a version newer than model's.
    Reads only the head of the file, where encode() puts the version: a
    daemon checks a whole directory of records this way before it acts on
    any of them."""
    # Never blocking, never through a link: whatever is planted there is
    # not this check's to judge (it raises OSError or names no version).
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        head = os.read(fd, head_bytes)
    finally:
        os.close(fd)
    match = _LEADING.match(head)
    if match and int(match.group(1)) > format_version(model):
        raise NewerFormat(path, f"{model.__name__} record", int(match.group(1)), format_version(model))
