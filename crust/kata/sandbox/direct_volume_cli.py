"""`crust kata direct-volume add|remove|stats|resize`: Kata's verbs and flags.

add and remove work on the directory alone (as Kata's do); stats and resize
ask the microVM handler whose sandbox uses the volume, over its socket. The
output of stats is the JSON Kata prints: a CSI NodeGetVolumeStatsResponse
with the proto field names, numbers as numbers and the unit as its enum
number, which is what a Go driver decodes into its csi struct.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import grpc

from crust.api import csi_pb2, handler_pb2, handler_pb2_grpc
from crust.common.channel import local_channel
from crust.common.errors import CrustError, FailedPrecondition, InvalidArgument
from crust.kata.sandbox.direct_volume import DEFAULT_ROOT, DirectVolumes, check_volume_path

DEFAULT_HANDLER_ENDPOINT = "unix:///run/crust/kata-handler.sock"
# Environment defaults, so a driver that runs the command with Kata's flags
# only can still be pointed at a non-default layout.
ENV_DIR = "CRUST_KATA_DIR"
ENV_ENDPOINT = "CRUST_KATA_HANDLER_ENDPOINT"
STATS_TIMEOUT = 10.0
RESIZE_TIMEOUT = 120.0  # an xfs_growfs in a software-emulated guest takes seconds
GONE = handler_pb2.GetSandboxResponse.State.GONE


def default_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_ROOT)


def default_endpoint() -> str:
    return os.environ.get(ENV_ENDPOINT) or DEFAULT_HANDLER_ENDPOINT


def stats_json(rsp: handler_pb2.GetVolumeStatsResponse) -> dict:
    usage = []
    for u in rsp.usage:
        entry = {k: v for k, v in (("available", u.available), ("total", u.total), ("used", u.used),
                                   ("unit", u.unit)) if v}
        usage.append(entry)
    out: dict = {"usage": usage}
    if rsp.HasField("volume_condition"):
        out["volume_condition"] = {"abnormal": rsp.volume_condition.abnormal,
                                   "message": rsp.volume_condition.message}
    return out


class DirectVolumeClient:
    def __init__(self, kata_dir: Path, endpoint: str):
        self.volumes = DirectVolumes(kata_dir)
        self.endpoint = endpoint

    def _stub(self) -> tuple[grpc.Channel, handler_pb2_grpc.HandlerStub]:
        channel = local_channel(self.endpoint)
        return channel, handler_pb2_grpc.HandlerStub(channel)

    def _holder(self, volume_path: str) -> str:
        check_volume_path(volume_path)
        if self.volumes.read(volume_path) is None:
            raise FailedPrecondition(f"{volume_path} is not a direct volume (no mountInfo.json in the layout)")
        sandbox_id = self.volumes.sandbox_of(volume_path)
        if sandbox_id is None:
            raise FailedPrecondition(f"{volume_path} is not in use by any sandbox")
        return sandbox_id

    def add(self, volume_path: str, mount_info: str) -> None:
        self.volumes.add(volume_path, mount_info)

    def remove(self, volume_path: str) -> None:
        check_volume_path(volume_path)
        holder = self.volumes.sandbox_of(volume_path)
        if holder is not None:
            # Removing the description under a running sandbox would orphan
            # its stats and resize; kubelet retries unpublish until it stops.
            channel, stub = self._stub()
            try:
                state = stub.GetSandbox(handler_pb2.GetSandboxRequest(sandbox_id=holder), timeout=STATS_TIMEOUT).state
            except grpc.RpcError:
                # No handler answers: nothing of ours runs the sandbox now. Even
                # if a VM outlived its handler, removing the description takes
                # it nothing but stats and resize; it keeps its device.
                state = GONE
            finally:
                channel.close()
            if state != GONE:
                raise FailedPrecondition(f"{volume_path} is in use by sandbox {holder}; stop it first")
        self.volumes.remove(volume_path)

    def stats(self, volume_path: str) -> dict:
        sandbox_id = self._holder(volume_path)
        channel, stub = self._stub()
        try:
            rsp = stub.GetVolumeStats(handler_pb2.GetVolumeStatsRequest(target_path=volume_path,
                                                                        sandbox_id=sandbox_id),
                                      timeout=STATS_TIMEOUT)
        finally:
            channel.close()
        return stats_json(rsp)

    def resize(self, volume_path: str, size: int) -> int:
        if size <= 0:
            raise InvalidArgument("--size must be a positive number of bytes")
        sandbox_id = self._holder(volume_path)
        channel, stub = self._stub()
        try:
            rsp = stub.ExpandVolume(handler_pb2.ExpandVolumeRequest(
                target_path=volume_path, sandbox_id=sandbox_id,
                capacity_range=csi_pb2.CapacityRange(required_bytes=size)), timeout=RESIZE_TIMEOUT)
        finally:
            channel.close()
        return rsp.capacity_bytes


def main(verb: str, volume_path: str, *, mount_info: str = "", size: int = 0,
         kata_dir: Path | None = None, endpoint: str = "") -> int:
    client = DirectVolumeClient(kata_dir or default_dir(), endpoint or default_endpoint())
    try:
        if verb == "add":
            if not mount_info:
                raise InvalidArgument("--mount-info is required")
            client.add(volume_path, mount_info)
        elif verb == "remove":
            client.remove(volume_path)
        elif verb == "stats":
            print(json.dumps(client.stats(volume_path)))
        elif verb == "resize":
            client.resize(volume_path, size)
        else:
            raise InvalidArgument(f"unknown verb {verb!r}")
    except CrustError as exc:
        print(f"direct-volume {verb}: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"direct-volume {verb}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0
