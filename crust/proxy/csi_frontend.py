"""The CSI endpoint kubelet talks to.

Every call is forwarded to the plugin (the crust shim) unchanged, except the
four Node calls where deferral applies: NodePublishVolume (decide, ask the
plugin to defer, stage the returned description before answering kubelet),
and NodeUnpublishVolume, NodeGetVolumeStats and NodeExpandVolume of a target
that was deferred (they carry defer_fs_ops, even after a restart, from the
decision recorded on disk).
"""

from __future__ import annotations

import logging

from crust.api import csi_pb2
from crust.common.errors import FailedPrecondition, Unavailable
from crust.csi_shim.backend import Backend
from crust.contract import device as device_identity
from crust.contract import encryption
from crust.contract.mountinfo import MountInfo
from crust.proxy.paths import check_target
from crust.proxy.policy import Decider
from crust.proxy.records import Decision
from crust.proxy.routing import Router
from crust.proxy.state import DEFERRED_PUBLISHED, ProxyState

log = logging.getLogger(__name__)

NodeRPC = csi_pb2.NodeServiceCapability.RPC


class CsiFrontend:
    def __init__(self, state: ProxyState, plugin: Backend, decider: Decider, router: Router):
        self.state = state
        self.router = router
        self.plugin = plugin
        self.decider = decider

    def _require_deferral(self, verdict) -> None:
        caps = self.plugin.node_capabilities
        if NodeRPC.DEFER_FS_OPS not in caps:
            raise FailedPrecondition(
                f"deferral applies ({verdict.reason}) but the plugin {self.plugin.plugin_name} does not advertise "
                "DEFER_FS_OPS; refusing rather than mounting on the host (put `crust shim` in front of it)")
        if verdict.fs_group and NodeRPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP not in caps:
            raise FailedPrecondition("the plugin does not advertise DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP")
        if verdict.fs_group_change_policy and \
                NodeRPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY not in caps:
            raise FailedPrecondition("the plugin does not advertise DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY")

    async def NodePublishVolume(self, request: csi_pb2.NodePublishVolumeRequest, context):
        verdict = await self.decider.decide(request)
        if not verdict.defer:
            return await self.plugin.call(self.plugin.node.NodePublishVolume, request, context)
        target = check_target(request.target_path, self.state.config.kubelet_root)
        self._require_deferral(verdict)
        # An encrypted volume's passphrase, from the node-publish secret:
        # refused before anything is done without it; kept in memory only
        # once the publish is staged (a copy the proxy wipes).
        passphrase = encryption.passphrase_of(request.secrets) \
            if encryption.of_context(request.volume_context) else None
        try:
            return await self._publish_deferred(request, context, verdict, target, passphrase)
        finally:
            encryption.wipe(passphrase)

    async def _publish_deferred(self, request, context, verdict, target: str, passphrase: bytearray | None):
        forwarded = csi_pb2.NodePublishVolumeRequest()
        forwarded.CopyFrom(request)
        forwarded.defer_fs_ops = True
        if verdict.fs_group:
            forwarded.volume_capability.mount.volume_supplemental_group = verdict.fs_group
        if verdict.fs_group_change_policy:
            forwarded.volume_capability.mount.volume_supplemental_group_change_policy = verdict.fs_group_change_policy
        # Recorded before the plugin acts, so every later call for this target
        # carries the flag even if the proxy dies right after the plugin.
        earlier = self.state.decision(target)
        # A republish of a target whose description is already delivered
        # (kubelet's retry, its restart): that earlier publish stands
        # whatever becomes of this call; a sandbox may be using it.
        delivered = self.state.get(target) is not None
        await self.state.record_decision(Decision(target_path=target, volume_id=request.volume_id,
                                                  deferred=True, reason=verdict.reason))
        try:
            response = await self.plugin.call(self.plugin.node.NodePublishVolume, forwarded, context)
        except BaseException:
            # The plugin refused (or the call died): nothing was deferred by
            # this call, so no decision of it may outlive it.
            if earlier is None:
                await self.state.forget_decision(target)
            raise
        if not response.HasField("deferred_mount"):
            # No silent fallback: whatever the plugin did, it did not defer.
            await self.plugin.call(self.plugin.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=request.volume_id, target_path=target, defer_fs_ops=True), context)
            raise FailedPrecondition(f"the plugin {self.plugin.plugin_name} did not return a deferred-mount "
                                     "description; the publish was undone")
        described = response.deferred_mount
        try:
            major, minor = device_identity.handed_over(
                described.device, described.device_major, described.device_minor, target_path=target,
                source=f"the plugin {self.plugin.plugin_name}")
            info = MountInfo.from_deferred(target, described)
            await self.state.stage(info.model_copy(update={"device_major": major, "device_minor": minor}))
        except BaseException:
            # Another device than described, or not staged (a full state or
            # watched directory): kubelet gets no OK, so nothing of the
            # publish may stay either.
            if not delivered:
                await self._undo_publish(request.volume_id, target, earlier is None, context)
            raise
        if described.encryption:
            if passphrase is None:
                # The plugin says encrypted where the volume context did not.
                await self._undo_publish(request.volume_id, target, earlier is None, context)
                raise FailedPrecondition(f"the plugin {self.plugin.plugin_name} described {target} as encrypted "
                                         f"({described.encryption}) but its volume_context has no "
                                         f"{encryption.PARAMETER}; the publish was undone")
            self.state.keep_passphrase(target, passphrase)
        DEFERRED_PUBLISHED.inc()
        log.info("deferred publish staged", extra={"fields": {"reason": verdict.reason,
                                                              "device": response.deferred_mount.device}})
        return response

    async def _undo_publish(self, volume_id: str, target: str, forget: bool, context) -> None:
        try:
            await self.plugin.call(self.plugin.node.NodeUnpublishVolume, csi_pb2.NodeUnpublishVolumeRequest(
                volume_id=volume_id, target_path=target, defer_fs_ops=True), context)
            if forget:
                await self.state.forget_decision(target)
        except Exception as exc:  # noqa: BLE001 - the failure answered is the first one
            log.warning("could not undo a deferred publish that was not staged",
                        extra={"fields": {"error": getattr(exc, "message", str(exc))}})

    def _deferred(self, path: str) -> bool:
        decision = self.state.decision(path) if path.startswith("/") else None
        return decision is not None and decision.deferred

    async def NodeUnpublishVolume(self, request: csi_pb2.NodeUnpublishVolumeRequest, context):
        if not (request.defer_fs_ops or self._deferred(request.target_path)):
            return await self.plugin.call(self.plugin.node.NodeUnpublishVolume, request, context)
        target = request.target_path
        volume = self.state.get(target)
        if volume is not None and volume.claim is not None and self.state.holder_alive(volume.claim):
            # Only the handler sees whether its pod is over: asked, it lets
            # go of what its stopped containers held (a runtime under CRI-O
            # deletes a container only after this call).
            await self.router.sandbox_state(volume.claim.handler, volume.claim.sandbox_id)
            volume = self.state.get(target)
        if volume is not None and volume.claim is not None and self.state.holder_alive(volume.claim):
            raise Unavailable(f"{target} is still mounted by sandbox {volume.claim.sandbox_id} of handler "
                              f"{volume.claim.handler}; unpublish is retried once the sandbox stops")
        forwarded = csi_pb2.NodeUnpublishVolumeRequest()
        forwarded.CopyFrom(request)
        forwarded.defer_fs_ops = True
        response = await self.plugin.call(self.plugin.node.NodeUnpublishVolume, forwarded, context)
        await self.state.unstage(target)
        await self.state.forget_decision(target)
        return response

    async def NodeGetVolumeStats(self, request: csi_pb2.NodeGetVolumeStatsRequest, context):
        if self._deferred(request.volume_path) and not request.defer_fs_ops:
            forwarded = csi_pb2.NodeGetVolumeStatsRequest()
            forwarded.CopyFrom(request)
            forwarded.defer_fs_ops = True
            request = forwarded
        return await self.plugin.call(self.plugin.node.NodeGetVolumeStats, request, context)

    async def NodeExpandVolume(self, request: csi_pb2.NodeExpandVolumeRequest, context):
        deferred = self._deferred(request.volume_path)
        if deferred and not request.defer_fs_ops:
            forwarded = csi_pb2.NodeExpandVolumeRequest()
            forwarded.CopyFrom(request)
            forwarded.defer_fs_ops = True
            request = forwarded
        try:
            return await self.plugin.call(self.plugin.node.NodeExpandVolume, request, context)
        finally:
            if deferred:
                # The device may have grown even when the file system could
                # not (yet): the entry follows the device either way.
                await self.state.refresh_capacity(request.volume_path)


METHODS = {
    "NodePublishVolume": (csi_pb2.NodePublishVolumeRequest, csi_pb2.NodePublishVolumeResponse),
    "NodeUnpublishVolume": (csi_pb2.NodeUnpublishVolumeRequest, csi_pb2.NodeUnpublishVolumeResponse),
    "NodeGetVolumeStats": (csi_pb2.NodeGetVolumeStatsRequest, csi_pb2.NodeGetVolumeStatsResponse),
    "NodeExpandVolume": (csi_pb2.NodeExpandVolumeRequest, csi_pb2.NodeExpandVolumeResponse),
}
