"""Encrypted volumes against a hostile disk, through the whole stack: real
driver -> shim -> proxy processes and the microVM handler
(tests/harness/kata_env.py). A hostile header (tests/harness/luks_variants.py) fails the
sandbox's claim with FAILED_PRECONDITION naming the field, and the pod's
data never reaches the disk; a disk holding a partition table and data is
never formatted over; an integrity volume (crust.dev/integrity:
hmac-sha256) is refused where it cannot be served (a handler without the
feature, growth) and served where it can. What is checked is the bytes of
the backing file (its sha256, the pod's marker), the gRPC status codes and
the header's shape.

In one guest, variant by variant: tests/vm/test_luks_hostile_guest.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2, registry_pb2, registry_pb2_grpc
from crust.contract import encryption
from tests.harness.daemons import MIB
from tests.harness.encryption import Encrypted, cap, holds
from tests.harness.kata_env import kenv  # noqa: F401 - a fixture
from tests.harness.luks2_header import shape_verdict
from tests.harness.luks_variants import MARKER, PASSPHRASE, SIZE, VARIANTS, mbr_with_data
from tests.harness.daemons import sha256_of

Code = grpc.StatusCode


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
