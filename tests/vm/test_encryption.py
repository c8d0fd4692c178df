"""Encrypted volumes (crust.dev/encryption: luks2), opened only inside the microVM guest.

Real driver -> shim -> proxy processes; kubelet is played over the proxy's
CSI socket with the node-publish secret in NodePublishVolumeRequest.secrets.
The host-side tests need no VM: the driver keeps the parameter, the shim
never formats or mounts the volume on the host, the proxy keeps the
passphrase out of every file, and every host-side path (host publish, the
mount-namespace handler, crust's OCI runtime, Kata's layouts, a handler
without the feature) refuses with FAILED_PRECONDITION. The microVM tests
run real QEMU guests (tcg here) on real loop devices: what is checked is
the bytes on the host's disks, the guest's own output on its console and
the gRPC status codes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import grpc
import pytest

from crust.api import (
    csi_pb2,
    handler_pb2,
    handler_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from crust.common.errors import FailedPrecondition
from crust.contract import encryption
from crust.contract.mountinfo import digest, kata_name
from crust.kata.sandbox.direct_volume import DirectVolumes
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB, sha256_of
from tests.harness.encryption import PASSPHRASE, SIZE, Encrypted, cap, holds
from tests.harness.handler_env import Env
from tests.harness.daemons import wait_until
from tests.harness.kata_env import (  # noqa: F401 - kenv_bus: a fixture
    DF_SCRIPT,
    anyone_mounts,
    guest_df,
    kata_env,
    kenv_bus,
    usage_dict,
)
from tests.harness.pod_runtime_client import PodClient, bind, container_bundle

Code = grpc.StatusCode
WRONG = "not-the-passphrase-of-this-volume"
MARKER = b"crust-encrypted-marker-5b8e1d"
LUKS2_MAGIC = b"LUKS\xba\xbe"
EXT4_MAGIC_OFFSET = 1080  # s_magic 0xEF53 in the superblock at 1024
XFS_MAGIC = b"XFSB"


def closed_in_guest(console: str) -> bool:
    """Whether the guest's console says an encrypted volume's mapping was
    closed (by its agent)."""
    return re.search(r"encrypted volume crypt-[a-z0-9-]+: closed", console) is not None


def head(path: Path | str, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def files_holding(top: Path, needle: bytes) -> list[str]:
    """Every regular file below top holding needle (never following links)."""
    found = []
    for dirpath, _, names in os.walk(top):
        for name in names:
            path = Path(dirpath) / name
            try:
                if path.is_symlink() or not path.is_file():
                    continue
                if holds(path, needle):
                    found.append(str(path))
            except OSError:
                continue
    return found


def assert_ciphertext_only(paths: list[Path | str], fs: str) -> None:
    """A LUKS2 header at 0; nowhere the marker; no file system magic where
    a plain volume (or the inside of the LUKS2 volume, at its 16 MiB data
    offset) would have it."""
    for path in paths:
        assert head(path, 6) == LUKS2_MAGIC, f"{path} has no LUKS2 header"
        assert not holds(path, MARKER), f"{path} holds the marker in clear"
        with open(path, "rb") as f:
            for base in (0, 16 * MIB):
                f.seek(base + EXT4_MAGIC_OFFSET)
                assert f.read(2) != b"\x53\xef", f"{path}: ext4 magic at {base}"
                f.seek(base)
                assert f.read(4) != XFS_MAGIC, f"{path}: xfs magic at {base}"


# -- host side: no VM ---------------------------------------------------------------------------


def test_the_parameter_is_kept_in_the_volume_context_and_an_unknown_value_is_refused(root):
    driver = root.driver().start()
    shim = root.shim(driver).start()
    for plugin in (driver, shim):
        request = csi_pb2.CreateVolumeRequest(
            name=f"enc-{plugin.socket.stem}", capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE),
            volume_capabilities=[cap()], parameters={encryption.PARAMETER: "luks2"})
        assert plugin.controller.CreateVolume(request, timeout=60).volume.volume_context[
            encryption.PARAMETER] == "luks2"
        request.name += "-bad"
        request.parameters[encryption.PARAMETER] = "aes-cbc"
        with pytest.raises(grpc.RpcError) as err:
            plugin.controller.CreateVolume(request, timeout=60)
        assert err.value.code() == Code.INVALID_ARGUMENT and encryption.PARAMETER in err.value.details()
    # Nothing was made for the refused one.
    names = {e.volume.volume_id for e in driver.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries}
    assert len(names) == 2
    # The file system is made inside, after the LUKS2 header: xfs's 300 MiB
    # minimum is the inside's, so the volume is 16 MiB larger.
    xfs = driver.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name="enc-xfs", capacity_range=csi_pb2.CapacityRange(required_bytes=300 * MIB),
        volume_capabilities=[cap("xfs")], parameters={encryption.PARAMETER: "luks2"}), timeout=60).volume
    assert xfs.capacity_bytes >= 300 * MIB + encryption.HEADER_BYTES


@pytest.fixture
def env(root):
    """driver -> shim -> proxy with the mount-namespace handler."""
    return Env(root)


def test_the_host_never_formats_mounts_or_writes_down_an_encrypted_volume(env):
    enc = Encrypted(env)
    v = enc.create("pv-enc-host")
    # A host publish straight to the shim (no deferral) is refused, naming why.
    with pytest.raises(grpc.RpcError) as err:
        env.shim.node.NodePublishVolume(enc.publish_request(v), timeout=60)
    assert err.value.code() == Code.FAILED_PRECONDITION and "encrypted" in err.value.details()
    assert not v.target.exists() or sysmount.at(str(v.target)) is None

    # Through the proxy without the node-publish secret: INVALID_ARGUMENT
    # naming the secret's key, and nothing published.
    with pytest.raises(grpc.RpcError) as err:
        env.proxy.node.NodePublishVolume(enc.publish_request(v, passphrase=None), timeout=60)
    assert err.value.code() == Code.INVALID_ARGUMENT and "passphrase" in err.value.details()
    assert not (env.proxy.volumes_dir / digest(str(v.target))).exists()

    # With it: deferred; the description says encrypted, never with what.
    d = enc.publish(v)
    assert d.encryption == "luks2"
    entry = (env.proxy.volumes_dir / digest(str(v.target)) / "mountInfo.json").read_bytes()
    assert json.loads(entry)["encryption"] == "luks2"
    assert PASSPHRASE.encode() not in entry
    # NodeStage left the device raw: no mkfs on the host, nothing written.
    assert head(v.device, 4096) == bytes(4096), "the host wrote to an encrypted volume's device"
    probe = subprocess.run(["blkid", "-p", v.device], capture_output=True, text=True, check=False)
    assert probe.returncode == 2, probe.stdout
    # No Kata mirror: a stock Kata would mount the raw device.
    assert not (env.proxy.kata_dir / kata_name(str(v.target))).exists()
    with env.proxy.runtime_channel() as channel:
        (listed,) = registry_pb2_grpc.RegistryStub(channel).ListVolumes(registry_pb2.ListVolumesRequest()).volumes
    assert "encrypted" in listed.kata_mirror_error

    # The mount-namespace handler refuses it before claiming it.
    out = env.run(env.bundle("enc-mountns", "exec sleep 60", [("/data", str(v.target))]), "sb-enc-mountns")
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and "encrypted" in out.stderr, out.stderr
    assert env.claims() == [] and env.sandboxes() == {}
    # So does crust's OCI runtime (runc's containers, through the same handler).
    with grpc.insecure_channel(f"unix://{env.handler.socket}") as channel, pytest.raises(grpc.RpcError) as err:
        handler_pb2_grpc.ContainerVolumesStub(channel).PrepareContainer(handler_pb2.PrepareContainerRequest(
            container_id="ctr-enc", sandbox_id="pod-enc", bundle=str(env.path / "bundles" / "enc-mountns"),
            mounts=[handler_pb2.ContainerMount(destination="/data", type="bind", source=str(v.target),
                                               options=["rbind"])]), timeout=30)
    assert err.value.code() == Code.FAILED_PRECONDITION and "encrypted" in err.value.details()
    assert env.claims() == []

    # The proxy refuses a claim by a handler that did not register the
    # feature (the key would go to it), whatever the handler itself checks.
    lease = (env.handler.state_dir / "lease").read_text().strip()
    with env.proxy.runtime_channel() as channel, pytest.raises(grpc.RpcError) as err:
        registry_pb2_grpc.RegistryStub(channel).ClaimVolume(registry_pb2.ClaimVolumeRequest(
            target_path=str(v.target), handler="mountns", sandbox_id="sb-x", lease_id=lease), timeout=10)
    assert err.value.code() == Code.FAILED_PRECONDITION and "luks2" in err.value.details()

    # Kata's direct-volume layout has no path for a key.
    with pytest.raises(FailedPrecondition, match="encrypted"):
        DirectVolumes(env.path / "direct").add(str(v.target), json.dumps({
            "volume-type": "block", "device": v.device, "fstype": "ext4", "encryption": "luks2"}))

    # The proxy restarted: the passphrase (memory only) is gone until the
    # next publish; a claim by a new sandbox is UNAVAILABLE, saying so.
    env.proxy.restart()
    with env.proxy.runtime_channel() as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        lease = stub.RegisterHandler(registry_pb2.RegisterHandlerRequest(
            name="vm-test2", endpoint=f"unix://{env.path}/vm-test2.sock", filesystems=["ext4"],
            features=["luks2"])).lease_id
        claim = registry_pb2.ClaimVolumeRequest(target_path=str(v.target), handler="vm-test2", sandbox_id="sb-vm",
                                                lease_id=lease)
        with pytest.raises(grpc.RpcError) as err:
            stub.ClaimVolume(claim, timeout=10)
        assert err.value.code() == Code.UNAVAILABLE and "NodePublishVolume" in err.value.details()
        # kubelet publishes again (as after its own restart): the key is back.
        enc.publish(v)
        answer = stub.ClaimVolume(claim, timeout=10)
        assert answer.volume_passphrase == PASSPHRASE.encode()
        # The same sandbox claiming again gets no key: it opened the volume.
        assert stub.ClaimVolume(claim, timeout=10).volume_passphrase == b""
        stub.ReleaseVolume(registry_pb2.ReleaseVolumeRequest(target_path=str(v.target), handler="vm-test2",
                                                             sandbox_id="sb-vm", lease_id=lease), timeout=10)
    env.unpublish(v)
    # No daemon that saw the passphrase can leave a core dump of its memory.
    for daemon in (env.handler, env.proxy, env.shim, env.driver):
        limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
        assert [line.split()[-3:-1] for line in limits.splitlines() if line.startswith("Max core file size")] \
            == [["0", "0"]], limits
    for daemon in (env.handler, env.proxy, env.shim, env.driver):
        daemon.stop()
    assert files_holding(env.path, PASSPHRASE.encode()) == []


# -- in the microVM guest ---------------------------------------------------------------------


@pytest.fixture
def kenv(root):
    yield from kata_env(root)


def guest_script(*steps: str) -> str:
    return " && ".join(steps)


def test_an_encrypted_volume_is_opened_formatted_grown_and_restored_in_the_guest_only(kenv_bus):  # noqa: F811 - the fixture
    kenv = kenv_bus
    enc = Encrypted(kenv)
    v = enc.create("pv-luks")
    enc.publish(v)
    backing = enc.backing_file(v)

    # A blank volume: the guest luksFormats it, makes ext4 inside, the pod writes.
    write = kenv.bundle("luks-w", guest_script(
        f"printf {MARKER.decode()} > /data/marker", "sync", DF_SCRIPT.format(path="/data"), "echo WRITTEN",
        "exec sleep 600"), [("/data", str(v.target))])
    kenv.run_ok(write, "sb-luks-w")
    console = kenv.wait_console("sb-luks-w", "WRITTEN", timeout=120)
    assert anyone_mounts(v.majmin) == [], "a host process has the guest's file system mounted"
    first = kenv.stats(v)
    assert not first.volume_condition.abnormal, first.volume_condition.message
    assert usage_dict(first.usage) == guest_df(console)

    # Online expansion: the disk, then the LUKS2 mapping, then ext4, in the guest.
    before = usage_dict(first.usage)["bytes_total"]
    assert kenv.expand(v, 96 * MIB) >= 96 * MIB
    after = usage_dict(kenv.stats(v).usage)["bytes_total"]
    assert after > before + 24 * MIB, (before, after)
    kenv.delete("sb-luks-w")
    assert kenv.claims() == []

    # The host's disks hold ciphertext only: a LUKS2 header, no marker, no
    # file system magic, on the backing file and on the loop device.
    assert_ciphertext_only([backing, v.device], "ext4")
    probe = subprocess.run(["blkid", "-p", "-o", "value", "-s", "TYPE", v.device], capture_output=True, text=True,
                           check=False)
    assert probe.stdout.strip() == "crypto_LUKS"

    # A wrong passphrase: the sandbox fails, saying why, and nothing changed.
    kenv.unpublish(v)
    enc.publish(v, passphrase=WRONG)
    written = sha256_of(backing)
    out = kenv.run(kenv.bundle("luks-bad", "exec sleep 600", [("/data", str(v.target))]), "sb-luks-bad")
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and "passphrase" in out.stderr, out.stderr
    assert kenv.claims() == [] and kenv.sandboxes() == {}
    assert sha256_of(backing) == written, "a refused passphrase changed the volume"

    # The right one again, in a new sandbox: the data reads back, in the grown file system.
    kenv.unpublish(v)
    enc.publish(v)
    read = kenv.bundle("luks-r", guest_script(
        "echo read-back: $(cat /data/marker)", DF_SCRIPT.format(path="/data"), "echo READ", "exec sleep 600"),
        [("/data", str(v.target))])
    kenv.run_ok(read, "sb-luks-r")
    console = kenv.wait_console("sb-luks-r", "READ", timeout=120)
    assert f"read-back: {MARKER.decode()}" in console
    assert guest_df(console)["bytes_total"] == after
    kenv.delete("sb-luks-r")

    # A snapshot restored into a new volume is the same ciphertext: the same key opens it.
    snap = kenv.proxy.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        name="snap-luks", source_volume_id=v.volume_id), timeout=60).snapshot
    source = csi_pb2.VolumeContentSource(snapshot=csi_pb2.VolumeContentSource.SnapshotSource(
        snapshot_id=snap.snapshot_id))
    restored = enc.create("pv-luks-restored", source=source, size=96 * MIB)
    enc.publish(restored)
    assert head(restored.device, 6) == LUKS2_MAGIC
    kenv.run_ok(kenv.bundle("luks-snap", guest_script("echo restored: $(cat /data/marker)", "echo RESTORED",
                                                      "exec sleep 600"), [("/data", str(restored.target))]),
                "sb-luks-snap")
    assert f"restored: {MARKER.decode()}" in kenv.wait_console("sb-luks-snap", "RESTORED", timeout=120)
    kenv.delete("sb-luks-snap")
    assert_ciphertext_only([enc.backing_file(restored)], "ext4")

    # After a whole life, the passphrase is nowhere on the host's disks: no
    # state, record, entry, backing file, console or log of any daemon.
    kenv.unpublish(restored)
    kenv.unpublish(v)
    for daemon in (kenv.handler, kenv.proxy, kenv.shim, kenv.driver):
        daemon.stop()
    assert files_holding(kenv.path, PASSPHRASE.encode()) == []
    assert files_holding(kenv.path, WRONG.encode()) == []


def test_xfs_inside_luks2_and_a_device_holding_a_plain_file_system_is_never_formatted_over(kenv):
    enc = Encrypted(kenv)
    v = enc.create("pv-luks-xfs", "xfs", size=300 * MIB)
    d = enc.publish(v)
    # The shim asked the backend for room for the header on top of xfs's 300 MiB.
    assert d.capacity_bytes >= 300 * MIB + encryption.HEADER_BYTES
    kenv.run_ok(kenv.bundle("luks-xfs", guest_script(f"printf {MARKER.decode()} > /data/marker", "sync",
                                                     "echo WRITTEN", "exec sleep 600"), [("/data", str(v.target))]),
                "sb-luks-xfs")
    kenv.wait_console("sb-luks-xfs", "WRITTEN", timeout=120)
    kenv.delete("sb-luks-xfs")
    assert_ciphertext_only([enc.backing_file(v), v.device], "xfs")
    kenv.unpublish(v)

    # A plain volume's snapshot restored with the encrypted class: the guest
    # finds ext4, not LUKS, and refuses; nothing is written.
    plain = kenv.create("pv-plain-src", "ext4")
    snap = kenv.proxy.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        name="snap-plain", source_volume_id=plain.volume_id), timeout=60).snapshot
    restored = enc.create("pv-plain-restored", source=csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)))
    enc.publish(restored)
    before = sha256_of(enc.backing_file(restored))
    out = kenv.run(kenv.bundle("luks-plain", "exec sleep 600", [("/data", str(restored.target))]), "sb-luks-plain")
    assert out.returncode != 0 and "FAILED_PRECONDITION" in out.stderr and "ext4" in out.stderr \
        and "refusing to format" in out.stderr, out.stderr
    assert sha256_of(enc.backing_file(restored)) == before
    assert kenv.claims() == [] and kenv.sandboxes() == {}
    kenv.unpublish(restored)


def test_a_pod_container_opens_an_encrypted_volume_and_its_removal_closes_it(kenv):
    """PodRuntime (containerd's crust shim): a container's bind of an
    encrypted volume opens it in the pod's VM; removing the container
    closes the mapping, so the disk leaves the guest cleanly."""
    enc = Encrypted(kenv)
    v = enc.create("pv-luks-pod")
    enc.publish(v)
    client = PodClient(kenv.handler.socket)
    try:
        sandbox_bundle = kenv.path / "bundles" / "pod-luks-sandbox"
        sandbox_bundle.mkdir(parents=True)
        (sandbox_bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                                "process": {"args": ["/pause"]}}))
        client.create_pod("pod-luks", sandbox_bundle)
        bundle = container_bundle(kenv.path, "luks-ctr", ["/bin/sh", "-c",
                                  f"echo {MARKER.decode()} > /data/marker && cat /data/marker && sync"],
                                  [bind("/data", v.target)])
        client.create_container("pod-luks", "luks-ctr", bundle)
        client.start("luks-ctr")
        assert client.wait("luks-ctr").exit_code == 0
        assert client.output("luks-ctr")[0] == MARKER + b"\n"
        client.delete_container("luks-ctr")
        assert kenv.claims() == []
        assert closed_in_guest(kenv.console("pod-luks")), "the mapping was not closed in the guest"
        client.delete_pod("pod-luks")
    finally:
        client.close()
    assert_ciphertext_only([enc.backing_file(v), v.device], "ext4")
    kenv.unpublish(v)


def test_a_restarted_handler_keeps_an_opened_encrypted_volume_without_its_key(kenv):
    """The VM outlives a killed handler; the new one claims the volume again
    (no key comes, none is needed: the guest has it open), answers stats,
    and closes it at delete."""
    enc = Encrypted(kenv)
    v = enc.create("pv-luks-restart")
    enc.publish(v)
    kenv.run_ok(kenv.bundle("luks-rs", guest_script(f"printf {MARKER.decode()} > /data/marker", "sync",
                                                    "echo WRITTEN", "exec sleep 600"), [("/data", str(v.target))]),
                "sb-luks-rs")
    kenv.wait_console("sb-luks-rs", "WRITTEN", timeout=120)
    kenv.handler.kill()
    kenv.handler.start(timeout=300)
    # start() returns on the old registration (its lease is still fresh): wait for the new handler itself.
    wait_until(lambda: kenv.handler.sandbox("list").returncode == 0, timeout=120, interval=0.5,
               what="the restarted handler's socket")
    wait_until(lambda: kenv.claim_set() == {(str(v.target), "kata", "sb-luks-rs")}, timeout=30,
               what="the claim re-asserted")
    assert list(kenv.sandboxes()) == ["sb-luks-rs"]

    def stats_answered():
        try:
            return kenv.stats(v)
        except grpc.RpcError as exc:
            assert exc.code() == Code.UNAVAILABLE, exc.details()   # the proxy reconnecting to the new handler
            return None

    stats = wait_until(stats_answered, timeout=30, interval=0.5, what="stats from the restarted handler")
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    kenv.delete("sb-luks-rs")
    assert closed_in_guest(kenv.console("sb-luks-rs"))
    assert kenv.claims() == []
    assert_ciphertext_only([enc.backing_file(v)], "ext4")
    kenv.unpublish(v)
