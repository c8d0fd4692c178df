"""Node side of the shim: deferral of file system operations.

For a volume served with the mount access type, the backend only ever sees a
raw block volume: the shim stages and publishes it as block into the shim's
own state dir, finds the device, formats it when positively blank, and mounts
nothing. Then:

- NodePublishVolume with defer_fs_ops mounts no file system of the volume on
  the host. It puts an empty read-only tmpfs on the target (a runtime that
  ignores deferral gets a read-only empty directory and fails loudly instead
  of writing to the host's disk) and returns the deferred-mount description.
- NodePublishVolume without it mounts the file system on the host (once per
  staged volume, at the staging path) and bind-mounts it to the target, like
  any plugin.
- Stats and expansion of a deferred target go to the proxy's Runtime API.

Safety rules, each a FAILED_PRECONDITION naming the holder: never defer a
volume whose file system is mounted on the host, never host-mount a volume
deferred to a sandbox, never defer a single-writer volume to a second target.
Raw block volumes pass through to the backend unchanged.

The checks cost the same whatever the number of volumes: a mount is looked
up for its one place (crust.common.copath), and "mounted anywhere on the
host" is first asked of the device itself (an exclusive open fails while a
file system on it is mounted); only a device someone holds makes the shim
read the whole mount table, to find where.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import stat

from crust.api import csi_pb2
from crust.common import copath, csi_input, volumefs
from crust.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from crust.common.inflight import InFlight
from crust.common.private import make_dirs
from crust.common.recordstore import RecordStore
from crust.contract import encryption
from crust.contract.mountinfo import PLACEHOLDER_SOURCE
from crust.csi_shim.backend import Backend
from crust.csi_shim.config import ShimConfig
from crust.csi_shim.description import describe
from crust.csi_shim.publish_groups import publish_groups
from crust.csi_shim.records import ShimPublish, ShimVolumeRecord, volume_key
from crust.csi_shim.runtime_client import RuntimeClient
from crust.csi_shim.translate import to_block
from crust.sys import blockdev, fs, loop, mount, ownership

log = logging.getLogger(__name__)

RPC = csi_pb2.NodeServiceCapability.RPC
# VOLUME_MOUNT_GROUP: kubelet then hands the pod's fsGroup to the shim
# (volume_mount_group) instead of walking and chowning the target itself,
# which for a deferred volume is only the read-only placeholder.
SHIM_CAPABILITIES = [RPC.STAGE_UNSTAGE_VOLUME, RPC.GET_VOLUME_STATS, RPC.EXPAND_VOLUME, RPC.VOLUME_MOUNT_GROUP]
DEFERRAL_CAPABILITIES = [RPC.DEFER_FS_OPS, RPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP,
                         RPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY]
AccessMode = csi_pb2.VolumeCapability.AccessMode



class NodeShim:
    def __init__(self, config: ShimConfig, backend: Backend, runtime: RuntimeClient):
        self.config = config
        self.backend = backend
        self.runtime = runtime
        self.private = config.state_dir / "backend"
        self.records = RecordStore(config.state_dir / "volumes", ShimVolumeRecord, self._belongs)
        self.inflight = InFlight()

    # -- start-up ------------------------------------------------------------------

    def reconcile(self) -> None:
        """Drop publishes whose mount vanished (after a reboot the CO publishes
        again); the kernel's mount table is the truth."""
        for key, rec in self.records.load_all():
            gone = [t for t, p in rec.published.items() if not self._target_is_ours(t, p.deferred, rec)]
            for target in gone:
                del rec.published[target]
            if gone:
                self.records.put_sync(key, rec)
                log.info("dropped vanished publishes", extra={"fields": {"volume_id": rec.volume_id, "targets": gone}})

    def _belongs(self, key: str, rec: ShimVolumeRecord) -> str:
        """A record must be its volume's, and name the backend's paths the
        shim made for that volume inside its state dir."""
        if volume_key(rec.volume_id) != key:
            return f"it describes volume {rec.volume_id!r}, whose record is not {key!r}"
        private = self.private / key
        if rec.backend_target != str(private / "device") or rec.backend_staging not in ("", str(private / "staging")):
            return f"its backend paths are not the shim's own for this volume ({private})"
        return ""

    # -- helpers -------------------------------------------------------------------

    def _record(self, volume_id: str) -> ShimVolumeRecord | None:
        return self.records.get(volume_key(volume_id))

    async def _save(self, rec: ShimVolumeRecord) -> None:
        await self.records.put(volume_key(rec.volume_id), rec)

    def _device(self, rec: ShimVolumeRecord) -> tuple[str, int, int]:
        try:
            return blockdev.resolve(rec.backend_target)
        except (FileNotFoundError, ValueError) as exc:
            raise FailedPrecondition(
                f"volume {rec.volume_id}: the backend no longer publishes its device ({exc}); "
                "call NodeStageVolume again")

    def _host_mounts(self, rec: ShimVolumeRecord, *, probe: bool = True) -> list[mount.MountEntry]:
        """Mounts of the volume's file system on the host (not the device node).

        probe: first ask the device whether anyone holds it (O(1)); a free
        device has no mount anywhere. Not while a sandbox may be mounting
        the volume for another deferred target: the probe's brief exclusive
        open would make that mount fail."""
        try:
            device, major, minor = blockdev.resolve(rec.backend_target)
            if probe and not blockdev.claimed(device):
                return []
        except (FileNotFoundError, ValueError):
            return []
        return mount.of_device(major, minor)

    def _has_live_deferral(self, rec: ShimVolumeRecord, but: str = "") -> bool:
        return any(p.deferred and t != but for t, p in rec.published.items())

    def _target_is_ours(self, target: str, deferred: bool, rec: ShimVolumeRecord) -> bool:
        entry = copath.mounted_at(target, "target_path")
        if entry is None:
            return False
        if deferred:
            return self._is_placeholder(entry)
        return self._is_host_mount(entry, rec)

    def _is_host_mount(self, entry: mount.MountEntry | None, rec: ShimVolumeRecord) -> bool:
        """Is this mount the volume's file system (a host publish, or the
        shared mount at the staging path)?"""
        if entry is None:
            return False
        try:
            _, major, minor = blockdev.resolve(rec.backend_target)
        except (FileNotFoundError, ValueError):
            return False
        return (entry.major, entry.minor) == (major, minor)

    @staticmethod
    def _is_placeholder(entry: mount.MountEntry | None) -> bool:
        return entry is not None and entry.fs_type == "tmpfs" and entry.source == PLACEHOLDER_SOURCE

    def _fs_type(self, cap: csi_pb2.VolumeCapability, volume_context) -> str:
        fs_type = cap.mount.fs_type or volume_context.get("fsType") or self.config.default_fs_type
        if fs_type not in fs.SUPPORTED:
            # The capability's own fs_type was checked already: name the field
            # the bad value really came from.
            field = "volume_capability.mount.fs_type" if cap.mount.fs_type else "volume_context.fsType"
            raise InvalidArgument(f"{field} {fs_type!r} is not supported; use one of {', '.join(fs.SUPPORTED)}")
        return fs_type

    def _capability(self, request) -> str:
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is required")
        modes = set(AccessMode.Mode.values()) - {AccessMode.UNKNOWN}
        return csi_input.capability(request.volume_capability, "volume_capability", modes, fs.SUPPORTED)

    # -- capabilities ----------------------------------------------------------------

    async def NodeGetCapabilities(self, request, context):
        caps = set(self.backend.node_capabilities) | set(SHIM_CAPABILITIES)
        if self.config.advertise_deferral:
            caps |= set(DEFERRAL_CAPABILITIES)
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=c)) for c in sorted(caps)
        ])

    # -- stage / unstage ---------------------------------------------------------------

    async def NodeStageVolume(self, request: csi_pb2.NodeStageVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        staging = csi_input.path(request.staging_target_path, "staging_target_path")
        kind = self._capability(request)
        if kind == "block":
            if not self.backend.stages:
                return csi_pb2.NodeStageVolumeResponse()  # the CO stages because we advertise it
            copath.refuse_links(staging, "staging_target_path")  # whatever the backend does with it
            return await self.backend.call(self.backend.node.NodeStageVolume, request, context)
        cap = request.volume_capability
        fs_type = self._fs_type(cap, request.volume_context)
        encrypted = encryption.of_context(request.volume_context)
        flags = list(cap.mount.mount_flags)
        copath.refuse_links(staging, "staging_target_path")  # mounted on at a host publish
        with self.inflight.hold(volume_id):
            rec = self._record(volume_id)
            if rec is not None:
                if rec.staging_path != staging:
                    raise FailedPrecondition(f"volume {volume_id} is already staged at {rec.staging_path}")
                if (rec.fs_type, rec.mount_flags) != (fs_type, flags):
                    raise AlreadyExists(f"volume {volume_id} is staged at {staging} with a different volume_capability")
            private = self.private / volume_key(volume_id)
            backend_staging = private / "staging"
            backend_target = private / "device"
            make_dirs(backend_staging)
            block_cap = to_block(cap)
            try:
                if self.backend.stages:
                    await self.backend.call(self.backend.node.NodeStageVolume, csi_pb2.NodeStageVolumeRequest(
                        volume_id=volume_id, publish_context=request.publish_context,
                        staging_target_path=str(backend_staging), volume_capability=block_cap,
                        secrets=request.secrets, volume_context=request.volume_context), context)
                await self.backend.call(self.backend.node.NodePublishVolume, csi_pb2.NodePublishVolumeRequest(
                    volume_id=volume_id, publish_context=request.publish_context,
                    staging_target_path=str(backend_staging) if self.backend.stages else "",
                    target_path=str(backend_target), volume_capability=block_cap, readonly=False,
                    secrets=request.secrets, volume_context=request.volume_context), context)
                record = rec or ShimVolumeRecord(
                    volume_id=volume_id, staging_path=staging, fs_type=fs_type, mount_flags=flags,
                    access_mode=cap.access_mode.mode,
                    backend_staging=str(backend_staging) if self.backend.stages else "",
                    backend_target=str(backend_target), publish_context=dict(request.publish_context),
                    volume_context=dict(request.volume_context))
                device, _, _ = self._device(record)
                # A repeated stage (rec found) formatted, or found formatted,
                # the volume the first time: no second probe.
                # An encrypted volume stays raw: only the guest that holds
                # its key formats it (LUKS2, then the file system inside).
                if rec is None and not encrypted and not self._host_mounts(record):
                    # A loop device over a file with no data reads as zeros
                    # whoever the backend is: mkfs need not write zeros; and
                    # one over a file this shim reaches can be formatted
                    # through the file.
                    await volumefs.format_if_blank(device, fs_type, volume_id,
                                                   zeroed=loop.reads_as_zeros(device),
                                                   image=loop.image_of(device))
                if rec is None:  # a repeated stage found its record as it is
                    await self._save(record)
            except Exception:
                if rec is None:
                    # A failed first stage (a full state dir included) leaves
                    # no backend publish behind: no NodeUnstageVolume follows
                    # a failed stage, so the backend would keep the device
                    # attached for good (e.g. an ext4 volume staged asking
                    # for xfs).
                    await self._release_backend(volume_id, context, quiet=True)
                raise
            log.info("staged without mounting", extra={"fields": {"device": device, "fs_type": fs_type}})
            return csi_pb2.NodeStageVolumeResponse()

    async def NodeUnstageVolume(self, request: csi_pb2.NodeUnstageVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        staging = csi_input.path(request.staging_target_path, "staging_target_path")
        private = self.private / volume_key(volume_id)
        rec = self._record(volume_id)
        if rec is None and not private.exists():
            if not self.backend.stages:
                return csi_pb2.NodeUnstageVolumeResponse()
            return await self.backend.call(self.backend.node.NodeUnstageVolume, request, context)
        with self.inflight.hold(volume_id):
            if rec is not None:
                live = [t for t, p in rec.published.items() if self._target_is_ours(t, p.deferred, rec)]
                if live:
                    raise FailedPrecondition(f"volume {volume_id} is still published at {', '.join(live)}")
                host = [m for m in self._host_mounts(rec) if m.mount_point != staging]
                if host:
                    raise FailedPrecondition(f"volume {volume_id} is still mounted on the host at {host[0].mount_point}")
                with copath.reach(staging, "staging_target_path", checked=True) as staging_at:
                    staging_at.refuse_symlink()
                    if self._is_host_mount(staging_at.mount_entry(), rec):
                        staging_at.unmount_all()
            else:
                # No record (it was found damaged and set aside), but the
                # backend's device is still published in our private dir: the
                # volume's host mount at the staging path is known by that
                # device, and goes, or the backend could never unstage it.
                with copath.reach(staging, "staging_target_path", checked=True) as staging_at:
                    staging_at.refuse_symlink()
                    if self._is_host_mount(staging_at.mount_entry(), ShimVolumeRecord(
                            volume_id=volume_id, staging_path=staging, fs_type="",
                            backend_target=str(private / "device"))):
                        staging_at.unmount_all()
            await self._release_backend(volume_id, context)
            await self.records.delete(volume_key(volume_id))
            return csi_pb2.NodeUnstageVolumeResponse()

    async def _release_backend(self, volume_id: str, context, *, quiet: bool = False) -> None:
        """Undo the backend's raw block stage and publish in the private dir.
        quiet: log failures instead of raising (cleaning up after another error)."""
        private = self.private / volume_key(volume_id)
        try:
            await self.backend.call(self.backend.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=volume_id, target_path=str(private / "device")), context)
            if self.backend.stages:
                await self.backend.call(self.backend.node.NodeUnstageVolume, csi_pb2.NodeUnstageVolumeRequest(
                    volume_id=volume_id, staging_target_path=str(private / "staging")), context)
        except Exception as exc:
            if not quiet:
                raise
            log.warning("could not release the backend's publish", extra={"fields": {"error": str(exc)}})
            return
        shutil.rmtree(private, ignore_errors=True)

    # -- publish / unpublish --------------------------------------------------------------

    async def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        target = csi_input.path(request.target_path, "target_path")
        kind = self._capability(request)
        if kind == "block":
            if request.defer_fs_ops:
                raise InvalidArgument("defer_fs_ops: a raw block volume has no file system operations to defer")
            copath.refuse_links(target, "target_path")  # whatever the backend does with it
            return await self.backend.call(self.backend.node.NodePublishVolume, request, context)
        staging = csi_input.path(request.staging_target_path, "staging_target_path")
        group, policy, mount_group = publish_groups(request)
        mode = request.volume_capability.access_mode.mode
        readonly = request.readonly or mode in csi_input.READ_ONLY_MODES
        wanted = ShimPublish(deferred=request.defer_fs_ops, readonly=readonly, supplemental_group=group,
                             supplemental_group_change_policy=policy, mount_group=mount_group)
        with self.inflight.hold(volume_id), copath.reach(target, "target_path", checked=True) as target_at:
            target_at.refuse_symlink()
            rec = self._record(volume_id)
            if rec is None or rec.staging_path != staging:
                raise FailedPrecondition(f"volume {volume_id} is not staged at {staging}; call NodeStageVolume first")
            if not wanted.deferred and encryption.of_context(rec.volume_context):
                raise FailedPrecondition(
                    f"volume {volume_id} is encrypted ({encryption.PARAMETER}="
                    f"{rec.volume_context[encryption.PARAMETER]}): it is opened only inside a microVM sandbox, "
                    "never mounted on the host; publish it with defer_fs_ops to a runtime handler that opens it")
            device, major, minor = self._device(rec)
            known = rec.published.get(target)
            if known is not None and self._target_is_ours(target, known.deferred, rec):
                if known != wanted:
                    raise AlreadyExists(f"volume {volume_id} is already published at {target} "
                                        f"(deferred={known.deferred}, readonly={known.readonly}); the request differs")
                return self._response(rec, wanted, device, major, minor)
            entry = target_at.mount_entry()
            if entry is not None:
                if wanted.deferred and self._is_placeholder(entry):
                    pass  # placed before a crash; adopted below
                elif not wanted.deferred and self._is_host_mount(entry, rec):
                    pass
                else:
                    raise FailedPrecondition(f"target_path {target} already has a mount ({entry.source})")
            try:
                if wanted.deferred:
                    await self._publish_deferred(rec, target_at, wanted, entry)
                else:
                    await self._publish_on_host(rec, target_at, wanted, device, entry)
                # Recorded before it is answered; one that cannot be (a full
                # state dir) is undone.
                await self._save(rec.model_copy(update={"published": {**rec.published, target: wanted}}))
            except Exception:
                self._undo_publish(rec, target_at, entry)
                raise
            return self._response(rec, wanted, device, major, minor)

    def _undo_publish(self, rec: ShimVolumeRecord, target_at: copath.CoPath, entry_before) -> None:
        """After a failed publish: the mount it put on the target (when there
        was none before), and the host mount at the staging path when no
        recorded host publish needs it."""
        try:
            if entry_before is None:
                current = target_at.mount_entry()
                if current is not None and (self._is_placeholder(current) or self._is_host_mount(current, rec)):
                    target_at.unmount_all()
                    if (st := target_at.lstat()) is not None and stat.S_ISDIR(st.st_mode):
                        target_at.remove()
            if not [t for t in rec.host_targets() if self._target_is_ours(t, False, rec)]:
                with copath.reach(rec.staging_path, "staging_target_path", checked=True) as staging_at:
                    if self._is_host_mount(staging_at.mount_entry(), rec):
                        staging_at.unmount_all()
        except Exception as exc:  # noqa: BLE001 - the failure answered is the publish's own
            log.warning("could not undo a failed publish", extra={"fields": {
                "target_path": target_at.path, "error": getattr(exc, "message", str(exc))}})

    def _response(self, rec, publish: ShimPublish, device, major, minor) -> csi_pb2.NodePublishVolumeResponse:
        if not publish.deferred:
            return csi_pb2.NodePublishVolumeResponse()
        return csi_pb2.NodePublishVolumeResponse(deferred_mount=describe(
            volume_id=rec.volume_id, device=device, major=major, minor=minor, fs_type=rec.fs_type,
            flags=rec.mount_flags, readonly=publish.readonly, capacity_bytes=blockdev.size_bytes(device),
            supplemental_group=publish.supplemental_group,
            change_policy=publish.supplemental_group_change_policy, volume_context=rec.volume_context))

    async def _publish_deferred(self, rec: ShimVolumeRecord, target_at: copath.CoPath, wanted: ShimPublish,
                                entry) -> None:
        target = target_at.path
        host = self._host_mounts(rec, probe=not self._has_live_deferral(rec, but=target))
        if host:
            raise FailedPrecondition(
                f"volume {rec.volume_id}: its file system is mounted on the host at {host[0].mount_point}; "
                "unpublish the host publishes before deferring it to a sandbox")
        others = [t for t, p in rec.published.items() if p.deferred and t != target
                  and self._target_is_ours(t, True, rec)]
        if others and not (wanted.readonly and all(rec.published[t].readonly for t in others)):
            raise FailedPrecondition(
                f"volume {rec.volume_id} is already deferred to a sandbox at {others[0]}; a single-writer "
                "file system mounted by two sandboxes would be corrupted")
        if entry is None:
            # Fail closed: a runtime that ignores deferral sees an empty
            # read-only directory, never the host's disk.
            await _made_then_mounted(target_at, lambda: target_at.mount(
                PLACEHOLDER_SOURCE, "tmpfs", ["ro", "size=4k", "nr_inodes=16", "mode=0555"]))
        log.info("deferred publish", extra={"fields": {"target": target}})

    async def _publish_on_host(self, rec: ShimVolumeRecord, target_at: copath.CoPath, wanted: ShimPublish,
                               device: str, entry) -> None:
        target = target_at.path
        deferred = [t for t, p in rec.published.items() if p.deferred and self._target_is_ours(t, True, rec)]
        if deferred:
            raise FailedPrecondition(
                f"volume {rec.volume_id} is deferred to a sandbox at {deferred[0]}; it cannot be mounted on the host too")
        if rec.access_mode == AccessMode.SINGLE_NODE_SINGLE_WRITER:
            others = [t for t in rec.host_targets() if t != target and self._target_is_ours(t, False, rec)]
            if others:
                raise FailedPrecondition(
                    f"volume {rec.volume_id} has access mode SINGLE_NODE_SINGLE_WRITER and is published at {others[0]}")
        with copath.reach(rec.staging_path, "staging_target_path", create_parents=True,
                          checked=True) as staging_at:
            staged = staging_at.mount_entry()
            if not self._is_host_mount(staged, rec):
                if staged is not None:
                    raise FailedPrecondition(
                        f"staging_target_path {rec.staging_path} has another mount ({staged.source})")
                staging_at.mkdir()
                await volumefs.fill_device_offline(rec.fs_type, device)
                await staging_at.mount(device, rec.fs_type, volumefs.mount_options(rec.fs_type, rec.mount_flags))
                if rec.fs_type == "xfs":
                    with staging_at.opened() as staging_fd:
                        await volumefs.grow_online("xfs", device, staging_fd)
            if entry is None:
                async def bind() -> None:
                    target_at.bind_from(staging_at, readonly=wanted.readonly)
                await _made_then_mounted(target_at, bind)
            if wanted.mount_group and not wanted.readonly:
                # What kubelet would have done after mounting, had it not
                # delegated fsGroup to us: through the staging mount, which
                # is writable whatever the target's bind says.
                with staging_at.opened() as fd:
                    walked = await asyncio.to_thread(ownership.apply_fs_group, fd, int(wanted.mount_group))
                log.info("fsGroup applied on the host", extra={"fields": {"gid": wanted.mount_group,
                                                                          "walked": walked}})

    async def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        target = csi_input.path(request.target_path, "target_path")
        rec = self._record(volume_id)
        with copath.reach(target, "target_path", checked=True) as target_at:
            # A target reached through a link is refused, never "OK": the
            # mount it may lead to stays until the CO names its real path.
            entry = target_at.mount_entry()
            if rec is None and not self._is_placeholder(entry):
                return await self.backend.call(self.backend.node.NodeUnpublishVolume, request, context)
            with self.inflight.hold(volume_id):
                if entry is not None:
                    ours = self._is_placeholder(entry) or (rec is not None and self._is_host_mount(entry, rec))
                    if not ours:
                        raise FailedPrecondition(f"target_path {target} holds a mount that is not volume {volume_id}")
                    target_at.unmount_all()
                if (st := target_at.lstat()) is not None and stat.S_ISDIR(st.st_mode):
                    target_at.remove()
                if rec is not None:
                    rec.published.pop(target, None)
                    if not rec.host_targets():
                        # The last host publish is gone: unmount the shared host
                        # mount so the volume can be deferred again.
                        with copath.reach(rec.staging_path, "staging_target_path", checked=True) as staging_at:
                            if self._is_host_mount(staging_at.mount_entry(), rec):
                                staging_at.unmount_all()
                    await self._save(rec)
                return csi_pb2.NodeUnpublishVolumeResponse()

    # -- stats / expand ---------------------------------------------------------------------

    def _is_deferred(self, rec: ShimVolumeRecord, path: str, flag: bool) -> bool:
        publish = rec.published.get(path)
        if publish is not None:
            return publish.deferred  # the record wins over a missing flag (a downgraded CO)
        return flag

    async def NodeGetVolumeStats(self, request: csi_pb2.NodeGetVolumeStatsRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        path = csi_input.required(request.volume_path, "volume_path")
        rec = self._record(volume_id)
        if rec is None:
            return await self.backend.call(self.backend.node.NodeGetVolumeStats, request, context)
        path = csi_input.lookup_path(path, "volume_path")
        if self._is_deferred(rec, path, request.defer_fs_ops):
            if path not in rec.published:
                raise NotFound(f"volume {volume_id} is not published at volume_path {path!r}")
            response = await self.runtime.stats(path, context)
            return csi_pb2.NodeGetVolumeStatsResponse(usage=response.usage,
                                                      volume_condition=response.volume_condition)
        publish = rec.published.get(path)
        wanted_ro = publish.readonly if publish else False
        with copath.reach(path, "volume_path", checked=True) as volume_at:
            entry = volume_at.mount_entry()
            if not self._is_host_mount(entry, rec):
                raise NotFound(f"volume {volume_id} is not mounted at volume_path {path!r}")
            with volume_at.opened() as fd:
                return volumefs.stats(fd, went_readonly="ro" in entry.super_options and not wanted_ro)

    async def NodeExpandVolume(self, request: csi_pb2.NodeExpandVolumeRequest, context):
        volume_id = csi_input.required(request.volume_id, "volume_id")
        path = csi_input.required(request.volume_path, "volume_path")
        rec = self._record(volume_id)
        if rec is None:
            return await self.backend.call(self.backend.node.NodeExpandVolume, request, context)
        path = csi_input.lookup_path(path, "volume_path")
        with self.inflight.hold(volume_id):
            deferred = self._is_deferred(rec, path, request.defer_fs_ops)
            if path not in rec.published and path != rec.staging_path:
                raise NotFound(f"volume {volume_id} is not published at volume_path {path!r}")
            integrity = encryption.integrity_of(rec.volume_context)
            if integrity:
                # Before the backend grows anything here. The controller
                # cannot tell (ControllerExpandVolume carries no volume
                # context, and the backend never saw crust's parameters).
                raise FailedPrecondition(f"volume {volume_id} has {encryption.INTEGRITY_PARAMETER}={integrity}: "
                                         "an integrity-protected volume cannot grow (the guest's cryptsetup "
                                         "resizes no dm-integrity device)")
            # First the device: the backend grows it as a raw block volume.
            if self.backend.expands:
                forwarded = csi_pb2.NodeExpandVolumeRequest(
                    volume_id=volume_id, volume_path=rec.backend_target, staging_target_path=rec.backend_staging,
                    volume_capability=to_block(request.volume_capability) if request.HasField("volume_capability")
                    else None, secrets=request.secrets)
                if request.HasField("capacity_range"):
                    forwarded.capacity_range.CopyFrom(request.capacity_range)
                await self.backend.call(self.backend.node.NodeExpandVolume, forwarded, context)
            device, _, _ = self._device(rec)
            size = blockdev.size_bytes(device)
            if deferred:
                # Then the file system, by the one who can see it: the sandbox.
                rng = request.capacity_range if request.HasField("capacity_range") else None
                capacity = await self.runtime.expand(path, rng, context)
                return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=capacity or size)
            with copath.reach(rec.staging_path, "staging_target_path", checked=True) as staging_at:
                if self._is_host_mount(staging_at.mount_entry(), rec):
                    with staging_at.opened() as staging_fd:
                        await volumefs.grow_online(rec.fs_type, device, staging_fd)
            return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)


METHODS = {
    "NodeGetCapabilities": (csi_pb2.NodeGetCapabilitiesRequest, csi_pb2.NodeGetCapabilitiesResponse),
    "NodeStageVolume": (csi_pb2.NodeStageVolumeRequest, csi_pb2.NodeStageVolumeResponse),
    "NodeUnstageVolume": (csi_pb2.NodeUnstageVolumeRequest, csi_pb2.NodeUnstageVolumeResponse),
    "NodePublishVolume": (csi_pb2.NodePublishVolumeRequest, csi_pb2.NodePublishVolumeResponse),
    "NodeUnpublishVolume": (csi_pb2.NodeUnpublishVolumeRequest, csi_pb2.NodeUnpublishVolumeResponse),
    "NodeGetVolumeStats": (csi_pb2.NodeGetVolumeStatsRequest, csi_pb2.NodeGetVolumeStatsResponse),
    "NodeExpandVolume": (csi_pb2.NodeExpandVolumeRequest, csi_pb2.NodeExpandVolumeResponse),
}


async def _made_then_mounted(target_at: copath.CoPath, mount_it) -> None:
    """Make the target directory (and its parents, never through a link),
    then mount; a failed mount removes the directory this call made."""
    target_at.ensure_parents()
    made = target_at.mkdir()
    try:
        await mount_it()
    except BaseException:
        if made:
            target_at.remove_after_failure()
        raise
