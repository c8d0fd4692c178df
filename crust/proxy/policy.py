"""Deciding deferral for a NodePublishVolume, for today's kubelet (which
knows nothing of defer_fs_ops):

1. a request that already carries defer_fs_ops is honoured as it is;
2. a volume_context entry listed in the policy's storageClassParameters defers;
3. a pod whose runtime class is listed in the policy's runtimeClasses defers
   (looked up through the Kubernetes API from the pod info kubelet passes).

The fsGroup of a deferred volume comes from the request when kubelet passes
it (volume_mount_group, because the plugin advertises VOLUME_MOUNT_GROUP),
else from the pod (fsGroupFromPod).

Raw block volumes are never deferred: there is no file system to defer.
"""

from __future__ import annotations

from dataclasses import dataclass

from crust.api import csi_pb2
from crust.common.errors import Unavailable
from crust.contract import encryption
from crust.proxy.config import DeferralPolicy
from crust.proxy.kube import POD_NAME, POD_NAMESPACE, PodFacts, PodLookup, PodLookupError


@dataclass(frozen=True)
class Verdict:
    defer: bool
    reason: str
    fs_group: str = ""
    fs_group_change_policy: str = ""


class Decider:
    def __init__(self, policy: DeferralPolicy, pods: PodLookup | None):
        self.policy = policy
        self.pods = pods

    async def _pod(self, request: csi_pb2.NodePublishVolumeRequest) -> PodFacts | None:
        name = request.volume_context.get(POD_NAME)
        namespace = request.volume_context.get(POD_NAMESPACE)
        if not (name and namespace) or self.pods is None:
            return None
        try:
            return await self.pods.pod(namespace, name)
        except PodLookupError as exc:
            # Without the pod we cannot tell whether it must be deferred;
            # mounting on the host by guess is exactly what must not happen.
            raise Unavailable(f"cannot decide deferral: {exc}")

    async def decide(self, request: csi_pb2.NodePublishVolumeRequest) -> Verdict:
        if request.volume_capability.WhichOneof("access_type") != "mount":
            return Verdict(False, "not a file system volume")
        reason = ""
        if request.defer_fs_ops:
            reason = "requested by the CO"
        elif request.volume_context.get(encryption.PARAMETER):
            # Never mounted on the host (the shim refuses): only a sandbox
            # that claims it gets its key.
            reason = f"encrypted volume ({encryption.PARAMETER}={request.volume_context[encryption.PARAMETER]})"
        else:
            for key, value in self.policy.storage_class_parameters.items():
                if request.volume_context.get(key) == value:
                    reason = f"volume_context {key}={value}"
                    break
        pod = None
        if not reason and self.policy.runtime_classes:
            pod = await self._pod(request)
            if pod is not None and pod.runtime_class in self.policy.runtime_classes:
                reason = f"runtime class {pod.runtime_class}"
        if not reason:
            return Verdict(False, "no deferral rule matched")
        mount = request.volume_capability.mount
        group, change = mount.volume_supplemental_group, mount.volume_supplemental_group_change_policy
        if not group and mount.volume_mount_group:
            # Kubelet delegated the pod's fsGroup (the plugin advertises
            # VOLUME_MOUNT_GROUP) but sends no change policy: take the pod's
            # when the policy allows the lookup, else OnRootMismatch.
            group = mount.volume_mount_group
            if not change and self.policy.fs_group_from_pod:
                pod = pod or await self._pod(request)
                change = pod.fs_group_change_policy if pod is not None else ""
            change = change or "OnRootMismatch"
        # A CO that sets defer_fs_ops passes the pod's fsGroup itself
        # (volume_supplemental_group): the pod is looked up only for today's
        # kubelet, which knows nothing of deferral.
        if not group and self.policy.fs_group_from_pod and not request.defer_fs_ops:
            pod = pod or await self._pod(request)
            if pod is not None:
                group, change = pod.fs_group, change or pod.fs_group_change_policy
        return Verdict(True, reason, group, change if group else "")
