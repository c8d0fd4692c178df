"""The guest agent's checks of an encrypted volume's disk before it opens
anything (crust/guest/luks.py), on the host: loop devices of headers the
host's cryptsetup made and an attacker edited (tests/harness/luks2_header.py).
The host has no device-mapper, so the opens themselves run in the VM
(tests/vm/test_luks_hostile_guest.py); what decides whether a disk is formatted or
opened at all runs here."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest

from crust.common import ttrpc
from crust.guest import luks, luks_shape
from crust.guest.errors import AgentError
from crust.sys import loop as sysloop
from tests.harness.luks_variants import (
    BLANK_TABLE,
    VARIANTS,
    crust_header,
    new_image,
    reencryption,
)


@pytest.fixture
def loops():
    attached: list[str] = []

    def attach(image) -> str:
        attached.append(sysloop.attach_sync(image, read_only=True))
        return attached[-1]
    yield attach
    for device in attached:
        sysloop.detach_sync(device)


def _refusal(coro) -> str:
    try:
        asyncio.run(coro)
    except AgentError as exc:
        assert exc.code == ttrpc.FAILED_PRECONDITION, exc
        return exc.message
    return ""


def test_a_header_copy_is_checked_in_memory_and_dropped_when_refused(tmp_path, loops):
    crust_header(new_image(tmp_path / "crust.img"))
    device = loops(tmp_path / "crust.img")
    copy = tmp_path / "crust.header"
    assert _refusal(luks.check_header_copy(device, copy, integrity=False)) == ""
    with open(tmp_path / "crust.img", "rb") as f:
        head = f.read(luks.HEADER_COPY_BYTES)
    # The copy is the disk's first MiB in a sparse file of the header's size, private to the agent.
    assert copy.read_bytes()[:luks.HEADER_COPY_BYTES] == head and copy.stat().st_size == luks.HEADER_BYTES
    assert copy.stat().st_mode & 0o777 == 0o600
    # The same header asked for as an integrity volume is not its shape: refused, and the copy gone.
    refused = _refusal(luks.check_header_copy(device, copy, integrity=True))
    assert "segments.0.integrity is missing" in refused and not copy.exists(), refused

    for n, variant in enumerate(VARIANTS):
        image = new_image(tmp_path / f"v{n}.img")
        variant.make(image)
        refused = _refusal(luks.check_header_copy(loops(image), tmp_path / f"v{n}.header", integrity=False))
        assert variant.refusal in refused, (variant.name, refused)
        if variant.make is not reencryption:
            assert not (tmp_path / f"v{n}.header").exists(), variant.name
    garbage = new_image(tmp_path / "garbage.img")
    with open(garbage, "r+b") as f:
        f.write(os.urandom(4096))
    refused = _refusal(luks.check_header_copy(loops(garbage), tmp_path / "g.header", integrity=False))
    assert "no LUKS2 header at its start" in refused and not (tmp_path / "g.header").exists()


def test_only_a_blank_disk_or_a_luks_header_is_taken(tmp_path, loops):
    verdicts = {}
    for n, (name, make, host_says, _) in enumerate(BLANK_TABLE):
        image = new_image(tmp_path / f"b{n}.img")
        make(image)
        try:
            verdicts[name] = asyncio.run(luks.probe(loops(image)))
        except AgentError as exc:
            verdicts[name] = exc.message
    assert verdicts["zeros"] == "blank" and verdicts["LUKS2"] == verdicts["LUKS1"] == "luks2"
    for name, found in (("ext4", "holds ext4"), ("swap", "holds swap"), ("MBR and data", "holds dos"),
                        ("ext4 and an xfs super block", "blkid -p exited 8")):
        assert found in verdicts[name] and "refusing to format over it" in verdicts[name], (name, verdicts[name])


def test_the_shape_names_what_differs_whatever_the_metadata_holds(tmp_path):
    crust_header(new_image(tmp_path / "crust.img"))
    dump = subprocess.run(["cryptsetup", "luksDump", "--dump-json-metadata", str(tmp_path / "crust.img")],
                          check=True, capture_output=True, text=True, timeout=60)
    metadata = json.loads(dump.stdout)
    assert luks_shape.differences(metadata, False) == ""
    assert luks_shape.differences("not an object", False) == 'the metadata is "not an object", crust makes an object'
    assert luks_shape.differences({}, False).startswith("segments is missing; keyslots is missing")
    # A salt must be base64 of 32 bytes, a number a number (true is no 1000), a
    # segment's cipher is named before anything else.
    kdf = metadata["keyslots"]["0"]["kdf"]
    kdf["salt"], kdf["iterations"] = "AAAA", True
    metadata["segments"]["0"]["encryption"] = "cipher_null-ecb"
    metadata["tokens"]["7"] = {"type": "x" * 100}
    said = luks_shape.differences(metadata, False).split("; ")
    assert said == ['segments.0.encryption is "cipher_null-ecb", crust makes "aes-xts-plain64"',
                    "keyslots.0.kdf.iterations is true, crust makes 1000",
                    'keyslots.0.kdf.salt is "AAAA", crust makes 32 bytes in base64'], said
