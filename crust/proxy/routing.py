"""Stats and expansion of a deferred volume, asked of whoever mounted it:
the claiming handler over its socket, or a KEP-style runtime through the
`runtime-cli` it recorded in the volume's directory."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import grpc
from google.protobuf import json_format

from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc, runtime_pb2
from crust.common.channel import local_aio_channel
from crust.common.errors import CrustError, FailedPrecondition, Forwarded, Internal, Unavailable
from crust.contract import freeze_policy
from crust.proxy.records import DeferredVolume
from crust.proxy.state import ProxyState
from crust.sys.run import CommandError, run

log = logging.getLogger(__name__)

HANDLER_TIMEOUT = 10.0


class Router:
    def __init__(self, state: ProxyState):
        self.state = state
        # One channel per handler endpoint and registration, with its stub
        # (made once: a stub builds a callable per method of the service). A
        # handler that registers again (restarted) gets a fresh channel with
        # its own connection (crust.common.channel): the old one may sit in
        # its reconnect backoff (up to a second) after failing to reach the
        # dead handler, and would refuse the first calls meanwhile.
        self.channels: dict[str, tuple[tuple[str, int], grpc.aio.Channel, handler_pb2_grpc.HandlerStub]] = {}
        self._closing: set[asyncio.Task] = set()

    def _stub(self, handler) -> handler_pb2_grpc.HandlerStub:
        registration = (handler.lease_sha256, handler.generation)
        known, channel, stub = self.channels.get(handler.endpoint, (None, None, None))
        if channel is None or known != registration:
            if channel is not None:
                task = asyncio.get_running_loop().create_task(channel.close())
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            channel = local_aio_channel(handler.endpoint)
            stub = handler_pb2_grpc.HandlerStub(channel)
            self.channels[handler.endpoint] = (registration, channel, stub)
        return stub

    async def close(self) -> None:
        for _, channel, _ in self.channels.values():
            await channel.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _timeout(self, context) -> float:
        remaining = context.time_remaining() if context is not None else None
        return min(HANDLER_TIMEOUT, remaining) if remaining is not None else HANDLER_TIMEOUT

    def _holder(self, volume: DeferredVolume):
        """The registered handler holding the volume, or None for the runtime-cli way."""
        claim = volume.claim
        if claim is None:
            return None
        handler = self.state.handlers.get(claim.handler)
        if handler is None or not self.state.lease_fresh(claim.handler):
            raise Unavailable(
                f"{volume.target_path} is claimed by sandbox {claim.sandbox_id} of handler {claim.handler}, "
                "whose lease expired or who is not registered; it cannot be asked")
        if not self.state.claim_current(claim):
            # The name is held by another lease now: whoever holds it did
            # not mount this volume and must not answer for it.
            raise Unavailable(
                f"{volume.target_path} was claimed by sandbox {claim.sandbox_id} under an earlier lease of "
                f"handler {claim.handler}; its current holder did not mount it")
        return handler

    async def _call_handler(self, handler, method: str, request, context):
        stub = self._stub(handler)
        try:
            return await getattr(stub, method)(request, timeout=self._timeout(context))
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"handler {handler.name} at {handler.endpoint} did not answer: {exc.details()}")
            raise Forwarded.from_rpc_error(exc) from None

    async def _run_cli(self, cli: str, args: list[str]) -> dict:
        try:
            result = await run([cli, "crust", *args], timeout=self.state.config.runtime_cli_timeout_seconds)
        except CommandError as exc:
            if exc.timed_out:
                raise Unavailable(f"runtime-cli {cli} did not answer within "
                                  f"{self.state.config.runtime_cli_timeout_seconds:.0f}s")
            raise Unavailable(f"runtime-cli {cli} failed: {exc}")
        except (FileNotFoundError, PermissionError) as exc:
            raise Unavailable(f"runtime-cli {cli} cannot be run: {exc}")
        try:
            return json.loads(result.stdout)
        except json.JSONDecodeError as exc:
            raise Internal(f"runtime-cli {cli} printed no JSON: {exc}")

    def _not_claimed(self, volume: DeferredVolume, what: str):
        waited = time.time() - volume.staged_at
        if waited <= self.state.config.claim_grace_seconds:
            return None  # the sandbox is still starting: not abnormal
        raise FailedPrecondition(
            f"no sandbox has claimed {volume.target_path} in {waited:.0f}s; {what} needs the runtime that mounts it")

    async def stats(self, volume: DeferredVolume, context) -> runtime_pb2.RuntimeGetVolumeStatsResponse:
        handler = self._holder(volume)
        if handler is not None:
            rsp = await self._call_handler(handler, "GetVolumeStats", handler_pb2.GetVolumeStatsRequest(
                target_path=volume.target_path, sandbox_id=volume.claim.sandbox_id), context)
            return runtime_pb2.RuntimeGetVolumeStatsResponse(usage=rsp.usage, volume_condition=rsp.volume_condition)
        cli = self.state.dir.runtime_cli(volume.target_path)
        if cli is not None:
            data = await self._run_cli(cli, ["stats", volume.target_path])
            try:
                return json_format.ParseDict(data, runtime_pb2.RuntimeGetVolumeStatsResponse())
            except json_format.ParseError as exc:
                raise Internal(f"runtime-cli {cli} stats: unexpected JSON: {exc}")
        if volume.abnormal_reason:
            return runtime_pb2.RuntimeGetVolumeStatsResponse(volume_condition=csi_pb2.VolumeCondition(
                abnormal=True, message=volume.abnormal_reason))
        self._not_claimed(volume, "stats")
        return runtime_pb2.RuntimeGetVolumeStatsResponse(volume_condition=csi_pb2.VolumeCondition(
            abnormal=False, message="the sandbox that mounts this volume is still starting"))

    async def expand(self, volume: DeferredVolume, rng: csi_pb2.CapacityRange, context) -> int:
        handler = self._holder(volume)
        if handler is not None:
            rsp = await self._call_handler(handler, "ExpandVolume", handler_pb2.ExpandVolumeRequest(
                target_path=volume.target_path, sandbox_id=volume.claim.sandbox_id, capacity_range=rng), context)
            return rsp.capacity_bytes
        cli = self.state.dir.runtime_cli(volume.target_path)
        if cli is not None:
            data = await self._run_cli(cli, ["resize", volume.target_path, str(rng.required_bytes),
                                             str(rng.limit_bytes)])
            value = data.get("capacity_bytes", data.get("capacityBytes"))
            if not isinstance(value, int):
                raise Internal(f"runtime-cli {cli} resize: no integer capacity_bytes in its JSON")
            return value
        if self._not_claimed(volume, "expansion") is None:
            raise Unavailable(f"{volume.target_path} is not mounted by a sandbox yet; retry when it is")
        return 0

    def in_sandboxes(self, volume_id: str) -> list[DeferredVolume]:
        """The deferred targets of a volume that a sandbox claimed (published
        through kubelet or staged with RuntimeStageVolume), in one order (by
        target path)."""
        return sorted((v for v in self.state.by_digest.values() if v.info.volume_id == volume_id
                       and v.claim is not None), key=lambda v: v.target_path)

    async def freeze(self, volume_id: str, timeout: int, policy: str, context) -> list[runtime_pb2.FrozenTarget]:
        """Each target frozen by its holder, or answered with why not; a
        target whose policy is required and cannot be frozen fails the call,
        and the ones frozen before are thawed again."""
        answer: list[runtime_pb2.FrozenTarget] = []
        frozen: list[runtime_pb2.FrozenTarget] = []
        try:
            for volume in self.in_sandboxes(volume_id):
                mode = freeze_policy.of_volume(policy, volume.info.volume_context)
                target = runtime_pb2.FrozenTarget(volume_target_path=volume.target_path,
                                                  sandbox_id=volume.claim.sandbox_id)
                answer.append(target)
                if mode == freeze_policy.NEVER:
                    continue
                try:
                    handler = self._holder(volume)
                    if handler is None:
                        raise FailedPrecondition(f"{volume.target_path} is mounted by a runtime through its "
                                                 "runtime-cli, which cannot freeze it")
                    rsp = await self._call_handler(handler, "FreezeVolume", handler_pb2.FreezeVolumeRequest(
                        target_path=volume.target_path, sandbox_id=volume.claim.sandbox_id,
                        timeout_seconds=timeout), context)
                except CrustError as exc:
                    if mode == freeze_policy.REQUIRED:
                        raise
                    log.warning("could not freeze a deferred volume", extra={"fields": {
                        "volume": volume_id, "target": volume.target_path, "error": exc.message}})
                    target.error = exc.message
                    continue
                target.handler, target.depth, target.frozen = handler.name, rsp.depth, True
                frozen.append(target)
        except BaseException:
            for target in frozen:
                try:
                    await self._thaw_one(target.volume_target_path, None)
                except Exception as exc:  # noqa: BLE001 - the sandbox's timeout ends it
                    log.warning("thaw after a failed freeze failed", extra={"fields": {
                        "target": target.volume_target_path, "error": str(exc)}})
            raise
        return answer

    async def _thaw_one(self, target_path: str, context) -> runtime_pb2.FrozenTarget:
        volume = self.state.get(target_path)
        if volume is None or volume.claim is None:
            return runtime_pb2.FrozenTarget(volume_target_path=target_path, was_frozen=False)
        handler = self._holder(volume)
        if handler is None:
            return runtime_pb2.FrozenTarget(volume_target_path=target_path, was_frozen=False)
        rsp = await self._call_handler(handler, "ThawVolume", handler_pb2.ThawVolumeRequest(
            target_path=target_path, sandbox_id=volume.claim.sandbox_id), context)
        return runtime_pb2.FrozenTarget(volume_target_path=target_path, sandbox_id=volume.claim.sandbox_id,
                                        handler=handler.name, depth=rsp.depth, was_frozen=rsp.was_frozen)

    async def thaw(self, volume_id: str, only: set[str], context) -> list[runtime_pb2.FrozenTarget]:
        return [await self._thaw_one(v.target_path, context) for v in self.in_sandboxes(volume_id)
                if not only or v.target_path in only]

    async def sandbox_state(self, handler_name: str, sandbox_id: str) -> int | None:
        handler = self.state.handlers.get(handler_name)
        if handler is None:
            return None
        try:
            rsp = await self._stub(handler).GetSandbox(
                handler_pb2.GetSandboxRequest(sandbox_id=sandbox_id), timeout=2.0)
        except grpc.aio.AioRpcError:
            return None
        return rsp.state
