"""The one LUKS2 shape crust makes, and the check of a header against it.

A LUKS2 header is plain text the disk's owner can rewrite. A null cipher
in the segment (the pod's writes in clear) or in the key slot area (any
passphrase opens, with a volume key the host chose), a shorter key, a
second key slot, a token, a reencryption requirement, a segment that
overlaps the header: each is a published way to turn a guest's own
encryption against it (Trail of Bits, 2025, CVE-2025-59054). So the guest
accepts exactly what its own luksFormat writes, field by field; salts and
digests are the only free values, and only their length is fixed.

The check reads the metadata as `cryptsetup luksDump --dump-json-metadata`
prints it: as cryptsetup itself parsed it, the same parse its open makes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

INTEGRITY = "hmac-sha256"
# luksFormat's options, every parameter named: none is left to
# cryptsetup's defaults, which change between its releases and with the
# device (the sector size is auto-detected otherwise). The key slot's
# PBKDF2 has the fewest iterations: argon2's memory-hard defaults (up to
# 1 GiB) do not fit the VM and take seconds under emulation, and the
# passphrase is a random Secret, not a password. With integrity the data
# is authenticated (dm-integrity, HMAC-SHA256 per 4 KiB sector).
FORMAT_OPTIONS = ("--type", "luks2", "--cipher", "aes-xts-plain64", "--key-size", "512", "--hash", "sha256",
                  "--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000", "--luks2-metadata-size", "16k",
                  "--luks2-keyslots-size", "16744448", "--offset", "32768")
PLAIN_SECTORS = ("--sector-size", "512", "--keyslot-cipher", "aes-xts-plain64", "--keyslot-key-size", "512")
INTEGRITY_SECTORS = ("--integrity", INTEGRITY, "--sector-size", "4096")
SEGMENT_OFFSET_SECTORS = 32768   # the data's start on the disk, in 512-byte sectors (16 MiB)
CIPHER = "aes-xts-plain64"
INTEGRITY_CIPHER = "capi:authenc(hmac(sha256),xts(aes))-plain64"
SHOWN = 60                       # the longest value a difference quotes
MOST_DIFFERENCES = 3


def format_options(integrity: bool) -> list[str]:
    """cryptsetup luksFormat's options for crust's shape."""
    return [*FORMAT_OPTIONS, *(INTEGRITY_SECTORS if integrity else PLAIN_SECTORS)]


class Base64Of:
    """A value free but for its length: base64 of this many bytes."""

    def __init__(self, size: int):
        self.size = size
        full = size // 3 * 4
        tail = {0: "", 1: "[A-Za-z0-9+/]{2}==", 2: "[A-Za-z0-9+/]{3}="}[size % 3]
        self.pattern = re.compile(f"[A-Za-z0-9+/]{{{full}}}{tail}")


def crust_shape(integrity: bool) -> dict[str, Any]:
    """The metadata crust's luksFormat writes."""
    key_bytes = 96 if integrity else 64   # AES-XTS 512 bits, plus HMAC-SHA256's 256 with integrity
    segment: dict[str, Any] = {"type": "crypt", "offset": "16777216", "size": "dynamic", "iv_tweak": "0",
                               "encryption": CIPHER, "sector_size": 4096 if integrity else 512}
    if integrity:
        segment["integrity"] = {"type": "hmac(sha256)", "journal_encryption": "none", "journal_integrity": "none"}
    return {
        "keyslots": {"0": {
            "type": "luks2", "key_size": key_bytes,
            "af": {"type": "luks1", "stripes": 4000, "hash": "sha256"},
            # 4000 anti-forensic stripes of the key, rounded up to 4096 bytes.
            "area": {"type": "raw", "offset": "32768", "size": str(math.ceil(key_bytes * 4000 / 4096) * 4096),
                     "encryption": CIPHER, "key_size": 64},
            "kdf": {"type": "pbkdf2", "hash": "sha256", "iterations": 1000, "salt": Base64Of(32)}}},
        "tokens": {},
        "segments": {"0": segment},
        "digests": {"0": {"type": "pbkdf2", "keyslots": ["0"], "segments": ["0"], "hash": "sha256",
                          "iterations": 1000, "salt": Base64Of(32), "digest": Base64Of(32)}},
        "config": {"json_size": "12288", "keyslots_size": "16744448"},
    }


def _shown(value: Any) -> str:
    text = json.dumps(value, separators=(",", ":"))
    return text if len(text) <= SHOWN else text[:SHOWN - 3] + "..."


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _differences(path: str, want: Any, have: Any) -> list[str]:
    if isinstance(want, Base64Of):
        if isinstance(have, str) and want.pattern.fullmatch(have):
            return []
        return [f"{path} is {_shown(have)}, crust makes {want.size} bytes in base64"]
    if isinstance(want, dict):
        if not isinstance(have, dict):
            return [f"{path} is {_shown(have)}, crust makes an object"]
        found = []
        for key, value in want.items():
            found += _differences(_at(path, key), value, have[key]) if key in have else [f"{_at(path, key)} is missing"]
        found += [f"{_at(path, key)} is {_shown(value)}, crust makes none" for key, value in have.items()
                  if key not in want]
        return found
    if isinstance(want, list):
        if not isinstance(have, list) or len(have) != len(want):
            return [f"{path} is {_shown(have)}, crust makes {_shown(want)}"]
        return [d for i, (w, h) in enumerate(zip(want, have)) for d in _differences(f"{path}[{i}]", w, h)]
    # JSON's types, not Python's: true is not 1, 1 is not 1.0 once parsed.
    if type(have) is type(want) and have == want:
        return []
    return [f"{path} is {_shown(have)}, crust makes {_shown(want)}"]


def differences(metadata: Any, integrity: bool) -> str:
    """"" when the metadata is exactly crust's shape; otherwise up to three
    fields that differ, with the value found and crust's, the segment's
    first (its cipher decides whether the data is encrypted at all)."""
    if not isinstance(metadata, dict):
        return f"the metadata is {_shown(metadata)}, crust makes an object"
    shape = crust_shape(integrity)
    segments = shape.pop("segments")
    found = _differences("", {"segments": segments}, {"segments": metadata.get("segments")}) if "segments" in \
        metadata else ["segments is missing"]
    found += _differences("", shape, {k: v for k, v in metadata.items() if k != "segments"})
    return "; ".join(found[:MOST_DIFFERENCES])
