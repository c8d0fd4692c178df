"""A line in runc's log, in its format: where containerd's runc shim and
CRI-O look for the reason a runtime call failed (the last error line)."""

from __future__ import annotations

import json
import sys
import time


def log_line(flags: dict[str, str], level: str, message: str) -> None:
    """A line in runc's log (--log), in its format; the shim reports the
    last error line as the reason create failed."""
    path = flags.get("--log")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1e9):09d}Z"
    if flags.get("--log-format") == "json":
        line = json.dumps({"level": level, "msg": message, "time": stamp})
    else:
        line = f'time="{stamp}" level={level} msg={json.dumps(message)}'
    if path:
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
            return
        except OSError:
            pass
    print(line, file=sys.stderr)
