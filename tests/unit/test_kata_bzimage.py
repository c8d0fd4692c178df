"""The kernel inside a bzImage (crust.kata.image.bzimage) and the kernel the guest
image boots (crust.kata.image.build.boot_kernel).
"""

from __future__ import annotations

import gzip
import lzma
import re
import struct

import pytest

from crust.kata.image import bzimage
from crust.kata.image import build as kata_image


def _elf_with_notes(notes: list[tuple[bytes, int, bytes]], machine: int = 62) -> bytes:
    """A 64-bit little-endian ELF header, one PT_NOTE program header and the notes."""
    body = b""
    for name, kind, desc in notes:
        name += b"\0"
        body += struct.pack("<III", len(name), len(desc), kind)
        body += name.ljust((len(name) + 3) & ~3, b"\0") + desc.ljust((len(desc) + 3) & ~3, b"\0")
    header = b"\x7fELF\x02\x01\x01" + b"\0" * 9 + struct.pack("<HHIQQQIHHHHHH", 2, machine, 1, 0, 64, 0, 0, 64,
                                                                 56, 1, 64, 0, 0)
    phdr = struct.pack("<IIQQQQQQ", bzimage.PT_NOTE, 4, 64 + 56, 0, 0, len(body), len(body), 4)
    return header + phdr + body


def _bzimage(kernel: bytes, compress=gzip.compress, setup_sects: int = 4, version: int = 0x20f,
             size: int | None = None) -> bytes:
    """A bzImage shaped as Linux's boot protocol says: setup sectors, then the
    protected-mode part with the payload (and its uncompressed size) in it."""
    compressed = compress(kernel) + struct.pack("<I", len(kernel) if size is None else size)
    setup = bytearray((setup_sects + 1) * 512)
    setup[0x1f1] = setup_sects
    setup[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", setup, 0x206, version)
    decompressor = b"\x90" * 300   # what the payload's offset skips
    struct.pack_into("<II", setup, 0x248, len(decompressor), len(compressed))
    return bytes(setup) + decompressor + compressed + b"\0" * 64


PVH_NOTE = (b"Xen", bzimage.XEN_ELFNOTE_PHYS32_ENTRY, (0x1000850).to_bytes(4, "little"))


@pytest.mark.parametrize("compress", [gzip.compress, lambda b: lzma.compress(b, format=lzma.FORMAT_XZ)],
                         ids=["gzip", "xz"])
def test_bzimage_gives_the_kernel_with_its_pvh_entry(compress):
    kernel = _elf_with_notes([(b"Xen", 6, b"linux\0"), (b"GNU", 3, b"x" * 20), PVH_NOTE])
    assert bzimage.vmlinux(_bzimage(kernel, compress)) == kernel
    assert bzimage.pvh_entry(kernel) == 0x1000850
    assert kata_image.boot_kernel(_bzimage(kernel, compress))[:2] == ("vmlinux", kernel)


@pytest.mark.parametrize("image, why", [
    (b"MZ" + b"\0" * 2000, "not a bzImage"),
    (_bzimage(b"x", version=0x207), "boot protocol 2.7 names no payload"),
    (_bzimage(_elf_with_notes([(b"Xen", 6, b"linux\0")])), "no PVH entry point"),
    (_bzimage(_elf_with_notes([PVH_NOTE]), size=12), "the image says 12"),
    (_bzimage(_elf_with_notes([PVH_NOTE], machine=183)), "not an x86-64 kernel"),
    (_bzimage(b"plain bytes, not ELF"), "not a 64-bit little-endian ELF"),
    (_bzimage(b"k", compress=lambda b: b"\x89LZO" + b), "unknown format (magic 894c5a4f6b"),
    (_bzimage(b"k", compress=lambda b: b"\x1f\x8b\x08\x00" + b"\xff" * 40), "the payload does not decompress"),
    (_bzimage(_elf_with_notes([PVH_NOTE])[:70]), "cut short"),
], ids=["no-header", "old-protocol", "no-pvh-note", "wrong-size", "not-x86-64", "not-elf", "unknown-compression",
        "corrupt-payload", "cut-short-elf"])
def test_bzimage_says_why_a_kernel_cannot_be_booted_directly_and_the_bzimage_is_booted(image, why):
    with pytest.raises(bzimage.NotBootable, match=re.escape(why)):
        bzimage.vmlinux(image)
    name, kernel, reason = kata_image.boot_kernel(image)
    assert (name, kernel) == ("vmlinuz", image) and reason.startswith("bzImage: ") and why in reason
