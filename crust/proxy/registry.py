"""The handler registry: leases, claims, and listings for `crust status`."""

from __future__ import annotations

from typing import Awaitable, Callable

from crust.api import registry_pb2, registry_pb2_grpc
from crust.common import csi_input
from crust.common.endpoint import socket_path
from crust.common.errors import InvalidArgument
from crust.common.peergate import caller
from crust.contract.volumes_dir import check_sandbox_id
from crust.proxy.paths import check_target
from crust.proxy.records import Claim
from crust.proxy.state import ProxyState, check_handler_name


def claim_message(target: str, volume_id: str, claim: Claim) -> registry_pb2.Claim:
    return registry_pb2.Claim(target_path=target, handler=claim.handler, sandbox_id=claim.sandbox_id,
                              volume_id=volume_id, claimed_at=int(claim.claimed_at), sandbox_pid=claim.sandbox_pid)


class RegistryService(registry_pb2_grpc.RegistryServicer):
    def __init__(self, state: ProxyState,
                 node_status: Callable[[], Awaitable[registry_pb2.GetNodeStatusResponse]] | None = None):
        self.state = state
        self.node_status = node_status

    def _target(self, value: str) -> str:
        return check_target(value, self.state.config.kubelet_root)

    async def RegisterHandler(self, request: registry_pb2.RegisterHandlerRequest, context):
        name = check_handler_name(request.name)
        csi_input.required(request.endpoint, "endpoint")
        try:
            socket_path(request.endpoint)
        except ValueError as exc:
            raise InvalidArgument(f"endpoint: {exc}")
        _, lease = await self.state.register(name, request.endpoint, list(request.filesystems),
                                             list(request.features), request.lease_id, caller.get())
        return registry_pb2.RegisterHandlerResponse(lease_id=lease, lease_seconds=self.state.config.lease_seconds)

    async def Heartbeat(self, request, context):
        self.state.heartbeat(check_handler_name(request.name), request.lease_id)
        return registry_pb2.HeartbeatResponse(lease_seconds=self.state.config.lease_seconds)

    async def UnregisterHandler(self, request, context):
        await self.state.unregister(check_handler_name(request.name), request.lease_id)
        return registry_pb2.UnregisterHandlerResponse()

    async def ClaimVolume(self, request: registry_pb2.ClaimVolumeRequest, context):
        target = self._target(request.target_path)
        handler = check_handler_name(request.handler)
        sandbox = check_sandbox_id(request.sandbox_id)
        if request.sandbox_pid < 0:
            raise InvalidArgument("sandbox_pid must not be negative")
        earlier = self.state.get(target)
        again = earlier is not None and earlier.claim is not None and \
            (earlier.claim.handler, earlier.claim.sandbox_id) == (handler, sandbox)
        volume = await self.state.claim(target, handler, sandbox, request.sandbox_pid, request.lease_id)
        answer = registry_pb2.ClaimVolumeResponse(mount_info_json=volume.info.to_json().decode())
        passphrase = self.state.passphrase(target) if volume.info.encryption and not again else None
        if passphrase is not None:
            # bytes(): protobuf wants an immutable copy, freed (not wiped)
            # once the answer is sent (docs/encryption.md, "Where the key is").
            answer.volume_passphrase = bytes(passphrase)
        return answer

    async def ReleaseVolume(self, request, context):
        target = self._target(request.target_path)
        await self.state.release(target, check_handler_name(request.handler), check_sandbox_id(request.sandbox_id),
                                 request.abnormal_reason[:500], request.lease_id)
        return registry_pb2.ReleaseVolumeResponse()

    async def ListClaims(self, request, context):
        claims = [claim_message(v.target_path, v.info.volume_id, v.claim) for v in self.state.by_digest.values()
                  if v.claim is not None and (not request.handler or v.claim.handler == request.handler)]
        return registry_pb2.ListClaimsResponse(claims=sorted(claims, key=lambda c: c.target_path))

    async def ListHandlers(self, request, context):
        return registry_pb2.ListHandlersResponse(handlers=[
            registry_pb2.Handler(name=h.name, endpoint=h.endpoint, filesystems=h.filesystems, features=h.features,
                                 lease_age_seconds=h.lease_age(),
                                 lease_expired=not self.state.lease_fresh(h.name),
                                 registered_by_uid=h.registered_by.uid if h.registered_by else -1,
                                 registered_by_pid=h.registered_by.pid if h.registered_by else 0)
            for h in sorted(self.state.handlers.values(), key=lambda h: h.name)
        ])

    async def ListVolumes(self, request, context):
        volumes = []
        for v in sorted(self.state.by_digest.values(), key=lambda v: v.target_path):
            volumes.append(registry_pb2.DeferredVolume(
                target_path=v.target_path, volume_id=v.info.volume_id, device=v.info.device, fs_type=v.info.fstype,
                state=self.state.volume_state(v),
                claim=claim_message(v.target_path, v.info.volume_id, v.claim) if v.claim else None,
                kata_mirror_error=v.kata_mirror_error))
        return registry_pb2.ListVolumesResponse(volumes=volumes)

    async def GetNodeStatus(self, request, context):
        if self.node_status is None:
            return registry_pb2.GetNodeStatusResponse()
        return await self.node_status()
