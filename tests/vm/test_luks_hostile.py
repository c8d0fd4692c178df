"""Encrypted volumes against a hostile disk: the guest opens only the LUKS2
header crust made, from a copy it checked, and formats only a blank device.

The attacker is docs/encryption.md's ("Threat model"): whoever can write a volume's backing
file or block device, without its passphrase. Headers are crafted on the
host (tests/luks2_header.py). What is checked is what a pod would lose:
the bytes of the device (its sha256 before and after a refusal), the
plaintext of the pod's writes on the raw device, the mapping the guest's
kernel really holds, and the gRPC status the sandbox start gets.

- the shape check (crust/guest/luks_shape.py) on the host, against every
  variant: fast, and the same code the guest runs;
- one guest, each variant hot-plugged as a disk and offered to the agent's
  OpenEncrypted with the pod's passphrase;
- a header rewritten many times a second during the opens;
- the blank rule, host (crust/sys/fs.py) and guest (an OpenEncrypted that
  may not format), on one table of devices;
- integrity (crust.dev/integrity: hmac-sha256): a flipped ciphertext byte
  reads as an I/O error; without it, as altered data;
- through the whole stack: a hostile header fails the sandbox's claim with
  FAILED_PRECONDITION naming the field, and the pod's data never reaches the
  disk.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import struct
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from crust.api import agent_pb2, csi_pb2, registry_pb2, registry_pb2_grpc
from crust.common import ttrpc
from crust.contract import encryption
from crust.kata import port_volumes
from crust.sys import fs as sysfs
from crust.sys import loop as sysloop
from crust.sys.run import CommandError
from tests.guest_vm import Guest
from tests.guest_vm import guest as run_in_guest
from tests.harness import MIB
from tests.luks2_header import Header, luks_format, plant_null_key_slot, shape_verdict
from tests.vm.test_encryption import Encrypted, cap, holds, sha256_of
from tests.vm.test_kata import kata_env

Code = grpc.StatusCode
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


def test_the_shape_check_accepts_crusts_header_and_names_what_differs_in_every_other(tmp_path):
    crust_header(new_image(tmp_path / "crust.img"))
    assert shape_verdict(tmp_path / "crust.img") == ""
    # The same header for a volume that asks for integrity is not its shape.
    assert "segments.0.integrity is missing" in shape_verdict(tmp_path / "crust.img", encryption.HMAC_SHA256)
    for n, variant in enumerate(VARIANTS):
        image = new_image(tmp_path / f"v{n}.img")
        variant.make(image)
        verdict = shape_verdict(image)
        assert verdict, f"{variant.name}: taken for crust's"
        if variant.make not in (reencryption, luks1):  # cryptsetup itself cannot dump these
            assert variant.refusal in verdict, (variant.name, verdict)


# -- one guest, many disks --------------------------------------------------------------------------


class LuksGuest(Guest):
    """A guest whose encrypted volumes are opened and closed by its agent's
    OpenEncrypted and CloseEncrypted, answers put in words a test compares."""

    def __init__(self, base: Path):
        super().__init__(base, "luks-hostile")

    async def luksopen(self, serial: str, name: str, passphrase: bytes = PASSPHRASE, integrity: str = "",
                       fs_type: str = "ext4", format_if_blank: bool = True) -> str:
        """"ok device=mapper/<name> formatted=0|1 cipher=... [integrity=...]"
        or "err <code>: <message>"."""
        client = await self.vm.port.ready(wait=60)
        request = agent_pb2.OpenEncryptedRequest(
            name=name, disk=agent_pb2.Disk(serial=serial), passphrase=passphrase, fs_type=fs_type,
            format_if_blank=format_if_blank,
            integrity=agent_pb2.OpenEncryptedRequest.HMAC_SHA256 if integrity else agent_pb2.OpenEncryptedRequest.NONE)
        try:
            answer = await client.call("OpenEncrypted", request, timeout=600)
        except ttrpc.TtrpcError as exc:
            return f"err {Code(_CODES[exc.code]).name}: {exc.message}"
        authenticated = " integrity=hmac-sha256" if answer.cipher.startswith("capi:authenc") else ""
        return f"ok device=mapper/{name} formatted={int(answer.formatted)} cipher={answer.cipher}{authenticated}"

    async def luksclose(self, name: str) -> str:
        client = await self.vm.port.ready(wait=60)
        try:
            await client.call("CloseEncrypted", agent_pb2.CloseEncryptedRequest(name=name), timeout=60)
        except ttrpc.TtrpcError as exc:
            return f"err {exc.message}"
        return "ok"


_CODES = {code.value[0]: code for code in Code}


def guest(root, coro_fn):
    return run_in_guest(root, coro_fn, LuksGuest)


def image_file(root, name: str, size: int = SIZE) -> Path:
    return new_image(root.path / f"{name}.img", size)


def test_the_guest_opens_only_crusts_header_and_writes_nothing_to_any_other(root):
    images = []
    for n, variant in enumerate(VARIANTS):
        image = image_file(root, f"v{n}")
        variant.make(image)
        images.append((variant, image, sha256_of(image)))
    made = image_file(root, "made")

    async def run(g: Guest):
        for n, (variant, image, before) in enumerate(images):
            await g.attach(image, f"v{n}")
            answer = await g.luksopen(f"v{n}", f"crypt-v{n}")
            assert answer.startswith("err ") and variant.refusal in answer, (variant.name, answer)
            assert sha256_of(image) == before, f"{variant.name}: the refused device changed"
        # Nothing of any of them is open or kept in the guest.
        code, out = await g.sh("ls /dev/mapper; ls /run/crust/luks 2>/dev/null")
        assert out.split() == ["control"], out
        # A blank disk: crust's shape is made, checked, opened, and opened again after a close.
        await g.attach(made, "made")
        assert (await g.luksopen("made", "crypt-made")).startswith("ok device=mapper/crypt-made formatted=1")
        code, status = await g.sh("cryptsetup status crypt-made")
        assert "cipher:  aes-xts-plain64" in status and "keysize: 512 bits" in status, status
        assert (await g.luksclose("crypt-made")) == "ok"
        assert (await g.luksopen("made", "crypt-made")).startswith("ok device=mapper/crypt-made formatted=0")
        # The wrong passphrase on crust's own header is told apart from a foreign header.
        await g.luksclose("crypt-made")
        wrong = await g.luksopen("made", "crypt-made", passphrase=b"not the pod's secret")
        assert wrong.startswith("err PERMISSION_DENIED: passphrase: no key slot"), wrong
        # The same header claimed as an integrity volume is not its shape.
        other = await g.luksopen("made", "crypt-made", integrity=encryption.HMAC_SHA256)
        assert "segments.0.integrity is missing" in other, other

    guest(root, run)
    assert shape_verdict(made) == "", "the guest made a header its own check refuses"


# -- a header rewritten while the guest opens -------------------------------------------------------


class HeaderFlipper(threading.Thread):
    """Writes two headers over the device's first MiB in turn, through the
    loop device the VM reads (its page cache is QEMU's), each kept for a
    random 20 to 250 ms: about as long as a copy, a check or an open takes
    in the guest, so each of them meets either header, or both."""

    def __init__(self, device: str, headers: list[bytes]):
        super().__init__(daemon=True)
        self.device, self.headers = device, headers
        self.stop = threading.Event()
        self.writes = 0

    def run(self) -> None:
        fd = os.open(self.device, os.O_WRONLY)
        try:
            while not self.stop.is_set():
                os.pwrite(fd, self.headers[self.writes % 2], 0)
                os.fsync(fd)
                self.writes += 1
                self.stop.wait(random.uniform(0.02, 0.25))
        finally:
            os.close(fd)


def test_a_header_rewritten_during_the_opens_changes_nothing(root):
    """The host swaps crust's header for one with a null key slot holding a
    key it chose (the header alone decides which key decrypts) as fast as
    it can while the guest opens the volume again and again. Whatever copy
    the guest took, it opened that copy: every open is crust's volume (the
    same plaintext at its start), every refusal names the planted field."""
    image = image_file(root, "raced")
    header_mib = 1 * MIB

    async def run(g: Guest):
        device = await g.attach(image, "raced")
        assert (await g.luksopen("raced", "crypt-raced")).startswith("ok device=mapper/crypt-raced formatted=1")
        code, first = await g.sh("head -c 65536 /dev/mapper/crypt-raced | sha256sum")
        assert code == 0
        await g.luksclose("crypt-raced")
        with open(image, "rb") as f:
            good = f.read(header_mib)
        evil_image = root.path / "evil.img"
        evil_image.write_bytes(good + bytes(16 * MIB - header_mib))
        plant_null_key_slot(evil_image, HOST_VOLUME_KEY)
        evil = evil_image.read_bytes()[:header_mib]
        opened = refused = 0
        flipper = HeaderFlipper(device, [evil, good])
        flipper.start()
        try:
            # At least 16 opens, and on until both headers were met (at most
            # 64): the opens' pace is the guest's, the flips' the host's.
            for attempt in range(64):
                if attempt >= 16 and opened and refused:
                    break
                answer = await g.luksopen("raced", "crypt-raced")
                if answer.startswith("ok "):
                    opened += 1
                    code, now = await g.sh("head -c 65536 /dev/mapper/crypt-raced | sha256sum")
                    assert now == first, "an open used a key the host planted"
                    await g.luksclose("crypt-raced")
                else:
                    # The planted header was copied, or a torn mix of both
                    # (crust's metadata over the planted key material: its
                    # digest then matches no key the passphrase unlocks).
                    # Never a genuine open undone: the check after the open
                    # reads the kernel's table, not the disk's header.
                    assert "not the cipher crust makes" not in answer, answer
                    refused += 1
                    assert 'keyslots.0.area.encryption is "cipher_null-ecb"' in answer \
                        or "does not read" in answer or "no key slot" in answer, answer
        finally:
            flipper.stop.set()
            flipper.join()
        # Both headers were written again and again, and both were met: the
        # race was real.
        assert flipper.writes >= 4, flipper.writes
        assert opened and refused, (opened, refused, flipper.writes)

    guest(root, run)


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


def host_verdict(device: str) -> str:
    try:
        probe = asyncio.run(sysfs.probe(device))
    except CommandError:
        return "error"
    return "blank" if probe.state is sysfs.ProbeState.BLANK else probe.fs_type


def test_host_and_guest_tell_blank_apart_by_the_same_rule(root):
    images = []
    for n, (name, make, host_says, guest_says) in enumerate(BLANK_TABLE):
        image = image_file(root, f"b{n}")
        make(image)
        images.append((name, image, host_says, guest_says, sha256_of(image)))
    for name, image, host_says, _, _ in images:
        device = sysloop.attach_sync(image, read_only=True)
        try:
            assert host_verdict(device) == host_says, name
        finally:
            sysloop.detach_sync(device)

    async def run(g: Guest):
        for n, (name, image, host_says, guest_says, _) in enumerate(images):
            await g.attach(image, f"b{n}")
            answer = await g.luksopen(f"b{n}", f"crypt-b{n}", format_if_blank=False)
            said, words = guest_says.split(": ", 1) if ": " in guest_says else guest_says.split(" ", 1)
            assert answer.startswith(said) and words in answer, (name, answer)
            if answer.startswith("ok "):
                await g.luksclose(f"crypt-b{n}")
            elif "LUKS1" not in name:
                # What is not blank and not LUKS is refused by an open that may format too, written to by nobody.
                opened = await g.luksopen(f"b{n}", f"crypt-b{n}")
                assert opened.startswith("ok ") == (host_says == "blank"), (name, opened)

    guest(root, run)
    for name, image, host_says, _, before in images:
        if host_says != "blank":
            assert sha256_of(image) == before, f"{name}: changed"
    assert holds(root.path / "b3.img", MARKER * 100), "the partitioned disk's data is gone"


# -- integrity ----------------------------------------------------------------------------------------


def changed_runs(before: bytes, after: bytes, block: int = 4096) -> list[tuple[int, int]]:
    """(offset, length) of each run of blocks that differ, longest first."""
    runs, start = [], None
    for offset in range(0, len(after), block):
        differs = before[offset:offset + block] != after[offset:offset + block]
        if differs and start is None:
            start = offset
        if not differs and start is not None:
            runs.append((start, offset - start))
            start = None
    if start is not None:
        runs.append((start, len(after) - start))
    return sorted(runs, key=lambda r: -r[1])


def test_integrity_makes_altered_ciphertext_an_io_error_where_plain_luks2_reads_garbage(root):
    """The pod writes a file; the host flips one byte in the middle of each
    extent of ciphertext that write produced. With crust.dev/integrity the
    guest's read fails with EIO; without it the read succeeds with altered
    data."""
    data = (MARKER * (MIB // len(MARKER) + 1))[:4 * MIB]
    digest = hashlib.sha256(data).hexdigest()
    verdicts = {}

    async def run(g: Guest):
        for kind, integrity in (("plain", ""), ("authenticated", encryption.HMAC_SHA256)):
            image = image_file(root, kind, 96 * MIB)
            device = await g.attach(image, kind)
            opened = await g.luksopen(kind, f"crypt-{kind}", integrity=integrity)
            assert opened.startswith("ok ") and (f"integrity={integrity}" in opened) == bool(integrity), opened
            await port_volumes.mount(await g.port(), port_volumes.storage(f"crypt-{kind}", "ext4", [], False,
                                                                          f"/mnt/{kind}", None))
            code, _ = await g.sh("sync; echo 3 > /proc/sys/vm/drop_caches")
            before = image.read_bytes()
            # The data crosses the serial line once as a pattern the guest repeats.
            code, out = await g.sh(f"yes {MARKER.decode()} | tr -d '\\n' | head -c {len(data)} > /mnt/{kind}/f "
                                   f"&& sync && sha256sum /mnt/{kind}/f")
            assert code == 0 and digest in out, out
            after = image.read_bytes()
            assert MARKER not in after, f"{kind}: the pod's data is in the clear on the host"
            # The file's ciphertext: the long runs of changed blocks (ext4
            # places 4 MiB in a few extents; the rest is metadata).
            runs = [r for r in changed_runs(before, after) if r[1] >= 256 * 1024]
            assert sum(length for _, length in runs) >= len(data), runs
            with open(device, "r+b") as f:   # through the loop device QEMU reads
                for start, length in runs:   # one byte in the middle of each
                    f.seek(start + length // 2)
                    byte = f.read(1)
                    f.seek(start + length // 2)
                    f.write(bytes([byte[0] ^ 0x01]))
                f.flush()
                os.fsync(f.fileno())
            code, out = await g.sh(f"echo 3 > /proc/sys/vm/drop_caches; sha256sum /mnt/{kind}/f")
            verdicts[kind] = (code, out)

    guest(root, run)
    plain_code, plain_out = verdicts["plain"]
    assert plain_code == 0 and digest not in plain_out, f"the flip was not seen at all: {plain_out}"
    auth_code, auth_out = verdicts["authenticated"]
    assert auth_code != 0 and "Input/output error" in auth_out, auth_out


# -- through the whole stack ---------------------------------------------------------------------------


@pytest.fixture
def kenv(root):
    yield from kata_env(root)


def write_over(device: str, scratch: Path, make: Callable[[Path], None]) -> None:
    """What make() writes into an image file of the device's size, written
    over the device itself (the loop device's page cache is what QEMU reads)."""
    with open(device, "rb") as f:
        size = f.seek(0, os.SEEK_END)
    with open(scratch, "wb") as f:
        f.truncate(size)
    make(scratch)
    assert scratch.stat().st_size == size
    with open(scratch, "rb") as src, open(device, "r+b") as dst:
        while chunk := src.read(4 * MIB):
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    scratch.unlink()


def test_a_sandbox_on_a_hostile_disk_fails_its_claim_and_the_pods_data_never_reaches_it(kenv):
    enc = Encrypted(kenv)
    hostile = [(VARIANTS[1], "pv-null-slot"), (VARIANTS[2], "pv-null-segment")]
    for variant, pv in hostile:
        v = enc.create(pv)
        enc.publish(v, passphrase=PASSPHRASE.decode())
        backing = enc.backing_file(v)
        write_over(v.device, kenv.path / f"{pv}.img", variant.make)
        before = sha256_of(backing)
        out = kenv.run(kenv.bundle(pv, f"printf {MARKER.decode()} > /data/m; sync; exec sleep 600",
                                   [("/data", str(v.target))]), f"sb-{pv}")
        assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and variant.refusal in out.stderr, \
            out.stderr
        assert kenv.claims() == [] and kenv.sandboxes() == {}
        assert sha256_of(backing) == before and not holds(backing, MARKER), variant.name
        kenv.unpublish(v)

    # A volume that holds a partition table and data: never formatted over.
    v = enc.create("pv-partitioned")
    enc.publish(v, passphrase=PASSPHRASE.decode())
    write_over(v.device, kenv.path / "partitioned.img", mbr_with_data)
    before = sha256_of(enc.backing_file(v))
    out = kenv.run(kenv.bundle("partitioned", "exec sleep 600", [("/data", str(v.target))]), "sb-partitioned")
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and "holds dos" in out.stderr, out.stderr
    assert sha256_of(enc.backing_file(v)) == before
    kenv.unpublish(v)


def test_an_integrity_volume_through_the_stack(kenv):
    enc = Encrypted(kenv)
    # The parameter needs LUKS2 and a known mode; both are refused naming the key.
    for params in ({encryption.INTEGRITY_PARAMETER: encryption.HMAC_SHA256},
                   {encryption.PARAMETER: encryption.LUKS2, encryption.INTEGRITY_PARAMETER: "crc32"}):
        for plugin in (kenv.driver, kenv.shim):
            with pytest.raises(grpc.RpcError) as err:
                plugin.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
                    name="pv-bad-integrity", capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE),
                    volume_capabilities=[cap()], parameters=params), timeout=60)
            assert err.value.code() == Code.INVALID_ARGUMENT and encryption.INTEGRITY_PARAMETER in err.value.details()

    v = enc.create("pv-integrity", integrity=encryption.HMAC_SHA256)
    d = enc.publish(v, passphrase=PASSPHRASE.decode())
    assert (d.encryption, d.integrity) == ("luks2", "hmac-sha256")
    # A handler that registered luks2 but not the integrity is not handed the key.
    with kenv.proxy.runtime_channel() as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        lease = stub.RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name="vm-luks-only", endpoint=f"unix://{kenv.path}/vm-luks-only.sock", filesystems=["ext4"],
            features=["luks2"])).lease_id
        with pytest.raises(grpc.RpcError) as err:
            stub.ClaimVolume(registry_pb2.ClaimVolumeRequest(target_path=str(v.target), handler="vm-luks-only",
                                                             sandbox_id="sb-x", lease_id=lease), timeout=10)
        assert err.value.code() == Code.FAILED_PRECONDITION and "integrity-hmac-sha256" in err.value.details()
    kenv.run_ok(kenv.bundle("integrity", f"printf {MARKER.decode()} > /data/m && sync && echo WRITTEN && "
                                         "exec sleep 600", [("/data", str(v.target))]), "sb-integrity")
    kenv.wait_console("sb-integrity", "WRITTEN", timeout=300)
    stats = kenv.stats(v)
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    # Growing is refused (cryptsetup resizes no dm-integrity device): at the
    # node, naming the parameter; the guest's file system stays as it was.
    with pytest.raises(grpc.RpcError) as err:
        kenv.expand(v, SIZE * 2)
    assert err.value.code() == Code.FAILED_PRECONDITION and encryption.INTEGRITY_PARAMETER in err.value.details()
    assert kenv.stats(v).usage == stats.usage
    # The driver on its own (no shim in front) knows the parameter and
    # refuses at the controller, before the backing file grows.
    direct = kenv.driver.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="pv-integrity-direct", capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE),
        volume_capabilities=[cap()], parameters={encryption.PARAMETER: encryption.LUKS2,
                                                 encryption.INTEGRITY_PARAMETER: encryption.HMAC_SHA256}),
        timeout=60).volume
    with pytest.raises(grpc.RpcError) as err:
        kenv.driver.controller.ControllerExpandVolume(csi_pb2.ControllerExpandVolumeRequest(
            volume_id=direct.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE * 2)), timeout=60)
    assert err.value.code() == Code.FAILED_PRECONDITION and encryption.INTEGRITY_PARAMETER in err.value.details()
    kenv.delete("sb-integrity")
    backing = enc.backing_file(v)
    assert not holds(backing, MARKER)
    assert shape_verdict(backing, encryption.HMAC_SHA256) == ""
    kenv.unpublish(v)
