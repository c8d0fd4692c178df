"""Human sizes for command lines: 512Mi, 10Gi, 1G, 4096."""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?)?b?\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512Mi, 10Gi)")
    return int(match.group(1)) * _UNITS[match.group(2) or ""]


def format_size(n: int) -> str:
    for unit, factor in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)
