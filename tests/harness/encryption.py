"""kubelet's side of encrypted volumes (crust.dev/encryption: luks2) over
the proxy's CSI socket: the StorageClass parameter on create, the PV's
volume_context on every node call, the Secret's passphrase on every
publish; and a search of a file's bytes for what must never be there in
clear."""

from __future__ import annotations

from pathlib import Path

from crust.api import csi_pb2
from crust.contract import encryption
from crust.sys import mount as sysmount
from tests.harness.daemons import MIB
from tests.harness.handler_env import Env, Vol

AccessMode = csi_pb2.VolumeCapability.AccessMode
PASSPHRASE = "7f3a-luks-test-passphrase-c0ffee-91d2"
SIZE = 64 * MIB


def cap(fs: str = "ext4") -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs),
                                    access_mode=AccessMode(mode=AccessMode.SINGLE_NODE_WRITER))


class Encrypted:
    """kubelet's side for encrypted volumes: the PV's volume_context on
    every node call, the Secret's passphrase on every publish."""

    def __init__(self, env: Env):
        self.env = env
        self.proxy = env.proxy
        self.context: dict[str, dict[str, str]] = {}

    def create(self, pv: str, fs: str = "ext4", source: csi_pb2.VolumeContentSource | None = None,
               size: int = SIZE, integrity: str = "") -> Vol:
        request = csi_pb2.CreateVolumeRequest(
            name=pv, capacity_range=csi_pb2.CapacityRange(required_bytes=size), volume_capabilities=[cap(fs)],
            parameters={encryption.PARAMETER: encryption.LUKS2,
                        **({encryption.INTEGRITY_PARAMETER: integrity} if integrity else {})})
        if source is not None:
            request.volume_content_source.CopyFrom(source)
        volume = self.proxy.controller.CreateVolume(request, timeout=60).volume
        assert volume.volume_context[encryption.PARAMETER] == "luks2"
        v = Vol(volume.volume_id, pv, fs, self.proxy.staging(pv), self.proxy.target(f"pod-{pv}", pv))
        self.context[v.volume_id] = dict(volume.volume_context)
        self.proxy.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(
            volume_id=v.volume_id, staging_target_path=str(v.staging), volume_capability=cap(fs),
            volume_context=self.context[v.volume_id]), timeout=60)
        return v

    def publish_request(self, v: Vol, passphrase: str | None = PASSPHRASE) -> csi_pb2.NodePublishVolumeRequest:
        return csi_pb2.NodePublishVolumeRequest(
            volume_id=v.volume_id, staging_target_path=str(v.staging), target_path=str(v.target),
            volume_capability=cap(v.fs), volume_context=self.context[v.volume_id],
            secrets={encryption.PASSPHRASE_KEY: passphrase} if passphrase is not None else {})

    def publish(self, v: Vol, passphrase: str = PASSPHRASE) -> csi_pb2.DeferredMount:
        """What today's kubelet sends (no defer_fs_ops): the proxy defers an
        encrypted volume by itself."""
        rsp = self.proxy.node.NodePublishVolume(self.publish_request(v, passphrase), timeout=60)
        assert rsp.HasField("deferred_mount"), "an encrypted volume was not deferred"
        d = rsp.deferred_mount
        v.device, v.majmin = d.device, (d.device_major, d.device_minor)
        assert not sysmount.of_device(*v.majmin), "the host mounted an encrypted volume"
        return d

    def backing_file(self, v: Vol) -> Path:
        name = Path(v.device).name
        return Path(Path(f"/sys/block/{name}/loop/backing_file").read_text().strip())


def holds(path: Path | str, needle: bytes) -> bool:
    """Whether the file holds needle anywhere (read in overlapping chunks)."""
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(8 * MIB):
            if needle in tail + chunk:
                return True
            tail = chunk[-len(needle):]
    return False
