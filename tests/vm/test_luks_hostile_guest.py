"""Encrypted volumes against a hostile disk, in the guest: the guest opens
only the LUKS2 header crust made, from a copy it checked, and formats only
a blank device.

The attacker is docs/encryption.md's ("Threat model"): whoever can write a volume's backing
file or block device, without its passphrase. Headers are crafted on the
host (tests/harness/luks_variants.py, tests/harness/luks2_header.py). What is checked is
what a pod would lose: the bytes of the device (its sha256 before and
after a refusal), the plaintext of the pod's writes on the raw device, and
the mapping the guest's kernel really holds.

- the shape check (crust/guest/luks_shape.py) on the host, against every
  variant: fast, and the same code the guest runs;
- one guest, each variant hot-plugged as a disk and offered to the agent's
  OpenEncrypted with the pod's passphrase;
- a header rewritten many times a second during the opens;
- the blank rule, host (crust/sys/fs.py) and guest (an OpenEncrypted that
  may not format), on one table of devices;
- integrity (crust.dev/integrity: hmac-sha256): a flipped ciphertext byte
  reads as an I/O error; without it, as altered data.

Through the whole stack: tests/vm/test_luks_hostile_stack.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import threading
from pathlib import Path

import grpc

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.contract import encryption
from crust.kata.agent import volume_calls
from crust.sys import fs as sysfs
from crust.sys import loop as sysloop
from crust.sys.run import CommandError
from tests.harness.encryption import holds
from tests.harness.guest_vm import Guest
from tests.harness.guest_vm import guest as run_in_guest
from tests.harness.daemons import MIB
from tests.harness.luks2_header import plant_null_key_slot, shape_verdict
from tests.harness.luks_variants import BLANK_TABLE, HOST_VOLUME_KEY, MARKER, PASSPHRASE, SIZE, VARIANTS
from tests.harness.luks_variants import crust_header, luks1, new_image, reencryption
from tests.harness.daemons import sha256_of

Code = grpc.StatusCode


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
            await volume_calls.mount(await g.port(), volume_calls.storage(f"crypt-{kind}", "ext4", [], False,
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
