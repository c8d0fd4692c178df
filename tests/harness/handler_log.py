"""A handler daemon's log, one JSON object a line, as the tests read it."""

from __future__ import annotations

import json


def entries(handler, *messages: str) -> list[dict]:
    """The handler's log entries whose message is one of messages, oldest first."""
    found = []
    for line in handler.log_path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") in messages:
            found.append(entry)
    return found
