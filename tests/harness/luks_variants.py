"""Hostile disks for encrypted volumes, made on the host: what whoever can
write a volume's backing file or block device writes there
(docs/encryption.md, "Threat model"). VARIANTS are LUKS headers crust must
refuse, each with the words its refusal names (headers crafted with
tests/harness/luks2_header.py); BLANK_TABLE is the devices the blank rule tells
apart, with the host's verdict and the guest's answer to an open that may
not format. The VM tier opens them in a guest and through the stack
(tests/vm/test_luks_hostile_guest.py, tests/vm/test_luks_hostile_stack.py),
the integration tier runs the guest agent's checks on the host
(tests/integration/test_guest_luks.py).
"""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.harness.daemons import MIB
from tests.harness.luks2_header import Header, luks_format, plant_null_key_slot

PASSPHRASE = b"pod-secret-3b1f9e0c-luks-hostile"
MARKER = b"crust-hostile-marker-71c4"
SIZE = 64 * MIB


# -- the variants: what a host without the passphrase (or, for the last ones, with it) writes -----


def null_everything(image: Path) -> None:
    """Made without the passphrase: key slot and segment cipher_null-ecb,
    and a plain ext4 behind the header, where the pod's writes would land
    in the clear."""
    luks_format(image, os.urandom(16))
    plant_null_key_slot(image, os.urandom(64), segment_cipher="cipher_null-ecb")
    inside = (image.stat().st_size - 16 * MIB) // 1024
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", f"offset={16 * MIB}", str(image), f"{inside}k"],
                   check=True, capture_output=True, timeout=60)


def null_key_slot(image: Path) -> None:
    """The segment left as crust makes it, but the key slot area
    cipher_null-ecb holding a volume key the host chose: every passphrase
    opens it, and the host decrypts what the pod writes."""
    luks_format(image, os.urandom(16))
    plant_null_key_slot(image, HOST_VOLUME_KEY)


def null_segment(image: Path) -> None:
    """crust's header made with the pod's passphrase (a host that knows it),
    the segment patched to cipher_null-ecb."""
    luks_format(image, PASSPHRASE)
    Header.edit(image, lambda m: m["segments"]["0"].__setitem__("encryption", "cipher_null-ecb"))


def short_key(image: Path) -> None:
    luks_format(image, PASSPHRASE, replace={"--key-size": "256"})


def four_k_sectors(image: Path) -> None:
    luks_format(image, PASSPHRASE, replace={"--sector-size": "4096"})


def argon2(image: Path) -> None:
    luks_format(image, PASSPHRASE, replace={"--pbkdf": "argon2id", "--pbkdf-force-iterations": "4"})


def second_key_slot(image: Path) -> None:
    luks_format(image, PASSPHRASE)
    extra = image.with_suffix(".key")
    extra.write_bytes(b"a second passphrase")
    subprocess.run(["cryptsetup", "luksAddKey", "--batch-mode", "--pbkdf", "pbkdf2", "--pbkdf-force-iterations",
                    "1000", "--key-file=-", str(image), str(extra)], input=PASSPHRASE, check=True,
                   capture_output=True, timeout=60)


def token(image: Path) -> None:
    luks_format(image, PASSPHRASE)
    Header.edit(image, lambda m: m["tokens"].__setitem__(
        "0", {"type": "luks2-keyring", "keyslots": ["0"], "key_description": "crust:planted"}))


def discards(image: Path) -> None:
    luks_format(image, PASSPHRASE)
    Header.edit(image, lambda m: m["config"].__setitem__("flags", ["allow-discards"]))


def fixed_size(image: Path) -> None:
    luks_format(image, PASSPHRASE)
    Header.edit(image, lambda m: m["segments"]["0"].__setitem__("size", str(8 * MIB)))


def reencryption(image: Path) -> None:
    luks_format(image, PASSPHRASE)
    Header.edit(image, lambda m: m["config"].__setitem__("requirements", {"mandatory": ["online-reencrypt-v2"]}))


def luks1(image: Path) -> None:
    subprocess.run(["cryptsetup", "luksFormat", "--batch-mode", "--type", "luks1", "--pbkdf-force-iterations",
                    "1000", "--key-file=-", str(image)], input=PASSPHRASE, check=True, capture_output=True,
                   timeout=60)


HOST_VOLUME_KEY = os.urandom(64)


@dataclass(frozen=True)
class Variant:
    name: str
    make: Callable[[Path], None]
    refusal: str    # words the refusal names (the field, the value found)


VARIANTS = [
    Variant("null-cipher header made without the passphrase", null_everything,
            'segments.0.encryption is "cipher_null-ecb"'),
    Variant("null key slot, the host's volume key", null_key_slot,
            'keyslots.0.area.encryption is "cipher_null-ecb"'),
    Variant("crust's header, segment patched to the null cipher", null_segment,
            'segments.0.encryption is "cipher_null-ecb"'),
    Variant("a 256-bit key", short_key, "keyslots.0.key_size is 32"),
    Variant("4096-byte sectors", four_k_sectors, "segments.0.sector_size is 4096"),
    Variant("argon2id key slot", argon2, 'keyslots.0.kdf.type is "argon2id"'),
    Variant("a second key slot", second_key_slot, "keyslots.1 is"),
    Variant("a token", token, "tokens.0 is"),
    Variant("allow-discards", discards, 'config.flags is ["allow-discards"]'),
    Variant("a fixed segment size", fixed_size, 'segments.0.size is "8388608"'),
    Variant("a reencryption requirement", reencryption, "LUKS2 header"),
    Variant("LUKS1", luks1, "LUKS1 header: crust makes and opens LUKS2 only"),
]


def crust_header(image: Path) -> None:
    luks_format(image, PASSPHRASE)


def new_image(path: Path, size: int = SIZE) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# -- blank means blank, on the host and in the guest ------------------------------------------------


def mbr_with_data(image: Path) -> None:
    entry = struct.pack("<B3sB3sII", 0, b"\0\0\0", 0x83, b"\0\0\0", 2048, image.stat().st_size // 512 - 2048)
    with open(image, "r+b") as f:
        f.seek(446)
        f.write(entry)
        f.seek(510)
        f.write(b"\x55\xaa")
        f.seek(2048 * 512)
        f.write(MARKER * 100)


def ext4_with_xfs_in_sector_zero(image: Path) -> None:
    """A clean ext4 with data whose first sector also holds an xfs super
    block (ext4 leaves the first KiB to a boot loader): blkid -p sees two
    signatures and exits 8."""
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True, timeout=60)
    xfs = image.with_suffix(".xfs")
    with open(xfs, "wb") as f:
        f.truncate(300 * MIB)
    subprocess.run(["mkfs.xfs", "-q", str(xfs)], check=True, capture_output=True, timeout=60)
    with open(xfs, "rb") as f:
        sector = f.read(512)
    xfs.unlink()
    with open(image, "r+b") as f:
        f.write(sector)


def mkfs(kind: str) -> Callable[[Path], None]:
    def make(image: Path) -> None:
        argv = {"ext4": ["mkfs.ext4", "-q", "-F"], "swap": ["mkswap"]}[kind]
        subprocess.run([*argv, str(image)], check=True, capture_output=True, timeout=60)
    return make


# name, how it is made, the host's verdict (blank, the kind, or "error"), the guest's answer to an
# open that may not format
BLANK_TABLE = [
    ("zeros", lambda image: None, "blank", "err FAILED_PRECONDITION: is blank and format_if_blank is not set"),
    ("ext4", mkfs("ext4"), "ext4", "err FAILED_PRECONDITION: holds ext4: not blank and not LUKS2"),
    ("swap", mkfs("swap"), "swap", "err FAILED_PRECONDITION: holds swap: not blank and not LUKS2"),
    ("MBR and data", mbr_with_data, "dos", "err FAILED_PRECONDITION: holds dos: not blank and not LUKS2"),
    ("ext4 and an xfs super block", ext4_with_xfs_in_sector_zero, "error",
     "err FAILED_PRECONDITION: blkid -p exited 8"),
    ("LUKS2", crust_header, "crypto_LUKS", "ok formatted=0"),
    ("LUKS1", luks1, "crypto_LUKS", "err FAILED_PRECONDITION: has a LUKS1 header"),
]
