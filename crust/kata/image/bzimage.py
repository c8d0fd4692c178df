"""The uncompressed kernel inside a bzImage, for a direct (PVH) boot.

A bzImage is a small real-mode setup, a decompressor and the kernel proper
(an ELF file, vmlinux) compressed behind them. Booted as it is, the guest
first runs the decompressor: under software emulation that, with the
firmware's copy of the image, is about a second of every VM start. QEMU
boots an uncompressed vmlinux straight at its PVH entry point (the Xen
note XEN_ELFNOTE_PHYS32_ENTRY, which kernels built with CONFIG_PVH carry),
as Kata and Firecracker boot theirs: the decompression is done once, here,
when the image is built.

The facts used (Linux's x86 boot protocol, 2.08 and later): setup_sects at
0x1f1 (0 means 4), the magic "HdrS" at 0x202, the protocol version at
0x206, payload_offset and payload_length at 0x248 and 0x24c, the offset
counted from the protected-mode code, which starts after the setup's
sectors. The kernel's build appends the uncompressed size (32 bits,
little-endian) to the compressed payload.
"""

from __future__ import annotations

import bz2
import lzma
import shutil
import struct
import subprocess
import zlib

PROTOCOL_WITH_PAYLOAD = 0x208
XEN_ELFNOTE_PHYS32_ENTRY = 18
PT_NOTE = 4


class NotBootable(ValueError):
    """The image holds no kernel QEMU could boot directly; why, in words."""


def payload(image: bytes) -> bytes:
    """The compressed kernel of a bzImage, without the appended size."""
    if len(image) < 0x250 or image[0x202:0x206] != b"HdrS":
        raise NotBootable("not a bzImage (no HdrS header)")
    version = struct.unpack_from("<H", image, 0x206)[0]
    if version < PROTOCOL_WITH_PAYLOAD:
        raise NotBootable(f"boot protocol {version >> 8}.{version & 0xff} names no payload")
    setup_sects = image[0x1f1] or 4
    offset, length = struct.unpack_from("<II", image, 0x248)
    start = (setup_sects + 1) * 512 + offset
    if length < 5 or start + length > len(image):
        raise NotBootable(f"payload at {start}+{length} lies outside the {len(image)}-byte image")
    return image[start:start + length]


def _program(argv: list[str], data: bytes) -> bytes:
    if shutil.which(argv[0]) is None:
        raise NotBootable(f"{argv[0]} is not installed (Debian package {PROGRAM_PACKAGES[argv[0]]})")
    done = subprocess.run(argv, input=data, capture_output=True, timeout=300, check=False)
    if done.returncode != 0:
        raise NotBootable(f"{' '.join(argv)} failed: {done.stderr.decode(errors='replace').strip()[:300]}")
    return done.stdout


PROGRAM_PACKAGES = {"unlz4": "lz4", "zstd": "zstd"}
# Magic of the payload -> how to decompress it (the compressed stream alone,
# the appended size stripped).
DECOMPRESSORS = {
    b"\x1f\x8b": lambda d: zlib.decompressobj(wbits=31).decompress(d),                  # gzip
    b"\xfd7zXZ\x00": lambda d: lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(d),     # xz
    b"\x5d\x00\x00": lambda d: lzma.LZMADecompressor(lzma.FORMAT_ALONE).decompress(d),  # lzma
    b"BZh": lambda d: bz2.BZ2Decompressor().decompress(d),                             # bzip2
    b"\x02\x21\x4c\x18": lambda d: _program(["unlz4", "-c"], d),                       # lz4, legacy frames
    b"\x28\xb5\x2f\xfd": lambda d: _program(["zstd", "-d", "-c"], d),                  # zstd
}


def vmlinux(image: bytes) -> bytes:
    """The uncompressed kernel of a bzImage, checked to be an x86-64 ELF that
    QEMU can boot at its PVH entry. NotBootable says why not."""
    compressed = payload(image)
    size = struct.unpack("<I", compressed[-4:])[0]
    for magic, decompress in DECOMPRESSORS.items():
        if compressed.startswith(magic):
            try:
                kernel = decompress(compressed[:-4])
            except (zlib.error, lzma.LZMAError, OSError, EOFError, ValueError) as exc:
                raise NotBootable(f"the payload does not decompress: {exc}") from None
            break
    else:
        raise NotBootable(f"payload compressed in an unknown format (magic {compressed[:6].hex()})")
    if len(kernel) != size:
        raise NotBootable(f"the payload decompressed to {len(kernel)} bytes, the image says {size}")
    if pvh_entry(kernel) is None:
        raise NotBootable("the kernel has no PVH entry point (built without CONFIG_PVH)")
    return kernel


def pvh_entry(elf: bytes) -> int | None:
    """The PVH entry address of a 64-bit little-endian ELF, None without one;
    NotBootable when elf is not such a file or is cut short."""
    try:
        return _pvh_entry(elf)
    except (struct.error, IndexError):
        raise NotBootable("the kernel's ELF headers are cut short") from None


def _pvh_entry(elf: bytes) -> int | None:
    if elf[:4] != b"\x7fELF" or len(elf) < 64 or elf[4] != 2 or elf[5] != 1:
        raise NotBootable("the payload is not a 64-bit little-endian ELF file")
    if struct.unpack_from("<H", elf, 18)[0] != 62:  # EM_X86_64
        raise NotBootable("the payload is not an x86-64 kernel")
    phoff = struct.unpack_from("<Q", elf, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", elf, 54)
    for n in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", elf, phoff + n * phentsize)
        if kind == PT_NOTE:
            for name, note_type, desc in _notes(elf[offset:offset + filesz]):
                if name == b"Xen" and note_type == XEN_ELFNOTE_PHYS32_ENTRY and len(desc) >= 4:
                    return struct.unpack_from("<I", desc)[0]
    return None


def _notes(section: bytes):
    """(name, type, descriptor) of each ELF note, padded to 4 bytes."""
    at = 0
    while at + 12 <= len(section):
        namesz, descsz, note_type = struct.unpack_from("<III", section, at)
        at += 12
        name = section[at:at + namesz].rstrip(b"\0")
        at += (namesz + 3) & ~3
        desc = section[at:at + descsz]
        at += (descsz + 3) & ~3
        yield name, note_type, desc
