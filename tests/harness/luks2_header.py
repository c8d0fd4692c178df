"""LUKS2 headers as a host with write access to a disk can rewrite them.

The tests play the attacker of docs/encryption.md's threat model: someone who
can write the volume's backing file or block device, but knows neither its
passphrase nor its volume key. The host has no device-mapper, so nothing
here opens a volume: headers are made by the host's cryptsetup on image
files (luksFormat needs no device-mapper), then edited the way an attacker
edits them: the JSON metadata rewritten in both header copies with fresh
checksums and a higher sequence id, and for a null-cipher key slot the key
material written in the clear.

Formats (public, from the LUKS2 on-disk format document): a 4096-byte
binary header, big-endian, then the JSON area; the second copy follows
the first at hdr_size. The checksum (sha256 here) covers the binary header
with its checksum field zeroed, then the JSON area. A key slot of "af"
type luks1 stores the volume key split into `stripes` random-looking
blocks (anti-forensic split, sha256 diffusion); its "digest" is PBKDF2 of
the volume key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from crust.guest import luks_shape

BINARY_HEADER = 4096
MAGIC_PRIMARY = b"LUKS\xba\xbe"
MAGIC_SECONDARY = b"SKUL\xba\xbe"
_SEQID = slice(16, 24)
_HDR_SIZE = slice(8, 16)
_CHECKSUM = slice(448, 512)
SEGMENT_OFFSET = 16 * 1024 * 1024


def crust_format_options() -> list[str]:
    """The guest's luksFormat options for a volume without integrity, so
    these headers are the ones it makes."""
    return luks_shape.format_options(integrity=False)


def luks_format(image: Path, passphrase: bytes, *options: str, replace: dict[str, str] | None = None) -> None:
    """A LUKS2 header made by the host's cryptsetup with crust's options on
    an image file (of the volume's size); replace swaps an option's value
    (e.g. {"--key-size": "256"}), options are added."""
    argv = crust_format_options()
    for flag, value in (replace or {}).items():
        argv[argv.index(flag) + 1] = value
    subprocess.run(["cryptsetup", "luksFormat", "--batch-mode", *argv, *options, "--key-file=-", str(image)],
                   input=passphrase, check=True, capture_output=True, timeout=120)


@dataclass
class Header:
    """Both copies of a LUKS2 header as read from an image."""
    primary: bytes      # binary header of the first copy
    secondary: bytes
    hdr_size: int
    metadata: dict

    @classmethod
    def read(cls, image: Path) -> Header:
        with open(image, "rb") as f:
            first = f.read(BINARY_HEADER)
            assert first[:6] == MAGIC_PRIMARY and struct.unpack(">H", first[6:8])[0] == 2, "no LUKS2 header"
            hdr_size = struct.unpack(">Q", first[_HDR_SIZE])[0]
            json_area = f.read(hdr_size - BINARY_HEADER)
            f.seek(hdr_size)
            second = f.read(BINARY_HEADER)
        return cls(first, second, hdr_size, json.loads(json_area.rstrip(b"\0")))

    def write(self, image: Path) -> None:
        """Both copies, with this metadata, a sequence id one higher and
        fresh checksums: what cryptsetup itself would accept as current."""
        area = json.dumps(self.metadata, separators=(",", ":")).encode()
        assert len(area) < self.hdr_size - BINARY_HEADER, "metadata larger than its area"
        area += bytes(self.hdr_size - BINARY_HEADER - len(area))
        with open(image, "r+b") as f:
            for offset, binary in ((0, self.primary), (self.hdr_size, self.secondary)):
                header = bytearray(binary)
                seqid = struct.unpack(">Q", header[_SEQID])[0] + 1
                header[_SEQID] = struct.pack(">Q", seqid)
                header[_CHECKSUM] = bytes(64)
                digest = hashlib.sha256(bytes(header) + area).digest()
                header[_CHECKSUM] = digest + bytes(64 - len(digest))
                f.seek(offset)
                f.write(bytes(header) + area)

    @staticmethod
    def edit(image: Path, change) -> None:
        """Read, let change(metadata) edit it in place, write both copies."""
        header = Header.read(image)
        change(header.metadata)
        header.write(image)


def _diffuse(block: bytes) -> bytes:
    """The anti-forensic diffusion: each 32-byte piece hashed with its
    index (big-endian u32) in front, the last piece cut to its length."""
    out = b""
    for i in range(0, len(block), 32):
        piece = block[i:i + 32]
        out += hashlib.sha256(struct.pack(">I", i // 32) + piece).digest()[:len(piece)]
    return out


def af_split(key: bytes, stripes: int) -> bytes:
    """The volume key split into stripes blocks of its length: all but the
    last random; the last makes their diffused XOR chain give the key."""
    size = len(key)
    chain = bytes(size)
    out = b""
    for _ in range(stripes - 1):
        stripe = os.urandom(size)
        out += stripe
        chain = _diffuse(bytes(a ^ b for a, b in zip(chain, stripe)))
    return out + bytes(a ^ b for a, b in zip(chain, key))


def plant_null_key_slot(image: Path, volume_key: bytes, *, segment_cipher: str | None = None) -> None:
    """What a host without the passphrase does to make every passphrase
    open the volume with a key it chose: key slot 0's area becomes
    cipher_null-ecb holding the split key in the clear, and the digest is
    remade for that key (optionally the segment's cipher changes too)."""
    header = Header.read(image)
    meta = header.metadata
    slot = meta["keyslots"]["0"]
    slot["area"]["encryption"] = "cipher_null-ecb"
    slot["key_size"] = len(volume_key)
    material = af_split(volume_key, slot["af"]["stripes"])
    assert len(material) <= int(slot["area"]["size"])
    with open(image, "r+b") as f:
        f.seek(int(slot["area"]["offset"]))
        f.write(material)
    digest = meta["digests"]["0"]
    salt = os.urandom(32)
    digest["salt"] = base64.b64encode(salt).decode()
    digest["digest"] = base64.b64encode(
        hashlib.pbkdf2_hmac("sha256", volume_key, salt, digest["iterations"], 32)).decode()
    if segment_cipher is not None:
        meta["segments"]["0"]["encryption"] = segment_cipher
    header.write(image)


def shape_verdict(image: Path, integrity: str = "") -> str:
    """What crust's shape check says of the header in image: "" when it is
    crust's, else the fields that differ (the guest runs the same check)."""
    dump = subprocess.run(["cryptsetup", "luksDump", "--dump-json-metadata", str(image)],
                          check=False, capture_output=True, text=True, timeout=60)
    if dump.returncode != 0:
        return f"does not read: {dump.stderr.strip()}"
    return luks_shape.differences(json.loads(dump.stdout), integrity == luks_shape.INTEGRITY)
