"""The servers bench/csi/proxy_bench.py puts around the proxy, so that it
measures the proxy's own cost.

- FakePlugin: a CSI plugin that defers every publish and does nothing else
  (behind the proxy in part 3);
- FixedHandler: a runtime handler whose sandbox always reports the same
  usage (registered with the proxy in part 2);
- the runtime-cli scripts of part 2, printing the same numbers
  (runtime_cli_sh(), runtime_cli_python());
- serve() runs one of the servers (proxy_bench.py --serve KIND, a hidden
  option), ServerProcess starts it in a process of its own, so that it
  does not share the timing client's GIL.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc

from bench.lib.stack import start_daemon, stop_process, wait_until
from crust.api import csi_pb2, csi_pb2_grpc, handler_pb2, handler_pb2_grpc, runtime_pb2
from tests.harness.daemons import GIB

# The script whose hidden --serve option runs serve().
SERVING_SCRIPT = Path(__file__).resolve().with_name("proxy_bench.py")

NodeRPC = csi_pb2.NodeServiceCapability.RPC
Usage = csi_pb2.VolumeUsage

# The fixed numbers every stats path of part 2 answers.
STATS_TOTAL, STATS_USED = 10 * GIB, 3 * GIB
INODES_TOTAL, INODES_USED = 655360, 1234
STATS_MESSAGE = "fixed numbers from the benchmark"


def fixed_stats() -> runtime_pb2.RuntimeGetVolumeStatsResponse:
    """The fixed numbers as the proxy answers RuntimeGetVolumeStats."""
    return runtime_pb2.RuntimeGetVolumeStatsResponse(
        usage=[Usage(unit=Usage.BYTES, total=STATS_TOTAL, used=STATS_USED, available=STATS_TOTAL - STATS_USED),
               Usage(unit=Usage.INODES, total=INODES_TOTAL, used=INODES_USED,
                     available=INODES_TOTAL - INODES_USED)],
        volume_condition=csi_pb2.VolumeCondition(abnormal=False, message=STATS_MESSAGE))


def stats_json() -> str:
    """The fixed numbers as a runtime-cli prints them."""
    return json.dumps({
        "usage": [{"unit": "BYTES", "total": STATS_TOTAL, "used": STATS_USED,
                   "available": STATS_TOTAL - STATS_USED},
                  {"unit": "INODES", "total": INODES_TOTAL, "used": INODES_USED,
                   "available": INODES_TOTAL - INODES_USED}],
        "volume_condition": {"abnormal": False, "message": STATS_MESSAGE},
    })


def runtime_cli_sh() -> str:
    """The fixed numbers as JSON from a shell printf (the runtime-cli of part 2 (b))."""
    return "#!/bin/sh\n# Called as: <this> crust stats <target>\nprintf '%s\\n' '" + stats_json() + "'\n"


def runtime_cli_python() -> str:
    """The same from a Python script without site (part 2 (c), for scale only)."""
    return f"#!{sys.executable} -S\n# Called as: <this> crust stats <target>\nprint({stats_json()!r})\n"



# -- the servers -----------------------------------------------------------------------------


class FakePlugin(csi_pb2_grpc.IdentityServicer, csi_pb2_grpc.NodeServicer):
    """A CSI plugin that defers everything and does nothing: only the proxy's cost is left."""

    def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name="fake.bench.crust.dev", vendor_version="0")

    def Probe(self, request, context):
        return csi_pb2.ProbeResponse()

    def GetPluginCapabilities(self, request, context):
        return csi_pb2.GetPluginCapabilitiesResponse()

    def NodeGetCapabilities(self, request, context):
        return csi_pb2.NodeGetCapabilitiesResponse(capabilities=[
            csi_pb2.NodeServiceCapability(rpc=NodeRPC(type=t))
            for t in (NodeRPC.STAGE_UNSTAGE_VOLUME, NodeRPC.DEFER_FS_OPS,
                      NodeRPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP,
                      NodeRPC.DEFER_FS_OPS_WITH_SUPPLEMENTAL_GROUP_CHANGE_POLICY)])

    def NodeGetInfo(self, request, context):
        return csi_pb2.NodeGetInfoResponse(node_id="bench-node")

    def NodePublishVolume(self, request, context):
        if not request.defer_fs_ops:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the fake plugin only defers")
        mount = request.volume_capability.mount
        return csi_pb2.NodePublishVolumeResponse(deferred_mount=csi_pb2.DeferredMount(
            volume_type="block", device="/dev/fake", fs_type="ext4", mount_options=["noatime"],
            readonly=request.readonly, volume_supplemental_group=mount.volume_supplemental_group,
            volume_supplemental_group_change_policy=mount.volume_supplemental_group_change_policy,
            volume_id=request.volume_id, capacity_bytes=GIB, device_major=7, device_minor=0,
            volume_context=dict(request.volume_context)))

    def NodeUnpublishVolume(self, request, context):
        return csi_pb2.NodeUnpublishVolumeResponse()


class FixedHandler(handler_pb2_grpc.HandlerServicer):
    """A runtime handler whose sandbox always reports the same usage."""

    def GetVolumeStats(self, request, context):
        fixed = fixed_stats()
        return handler_pb2.GetVolumeStatsResponse(usage=fixed.usage, volume_condition=fixed.volume_condition)

    def ExpandVolume(self, request, context):
        return handler_pb2.ExpandVolumeResponse(capacity_bytes=request.capacity_range.required_bytes)

    def GetSandbox(self, request, context):
        return handler_pb2.GetSandboxResponse(state=handler_pb2.GetSandboxResponse.RUNNING)


def serve(kind: str, socket: str) -> int:
    """Serve the fake plugin (kind "plugin") or the fixed handler on a unix socket until SIGTERM or SIGINT."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    if kind == "plugin":
        plugin = FakePlugin()
        csi_pb2_grpc.add_IdentityServicer_to_server(plugin, server)
        csi_pb2_grpc.add_NodeServicer_to_server(plugin, server)
    else:
        handler_pb2_grpc.add_HandlerServicer_to_server(FixedHandler(), server)
    old = os.umask(0o077)
    try:
        server.add_insecure_port(f"unix://{socket}")
    finally:
        os.umask(old)
    server.start()
    stop = False

    def on_signal(signum, frame):
        nonlocal stop
        stop = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not stop:
        time.sleep(0.2)
    server.stop(0).wait()
    try:
        os.unlink(socket)
    except FileNotFoundError:
        pass
    return 0


class ServerProcess:
    """SERVING_SCRIPT run with --serve KIND: the fake plugin or the fixed handler."""

    def __init__(self, kind: str, socket: Path):
        self.kind = kind
        self.socket = socket
        self.log_path = socket.with_suffix(".log")
        self.proc = None

    def start(self, timeout: float = 15.0) -> ServerProcess:
        argv = [sys.executable, str(SERVING_SCRIPT), "--serve", self.kind, "--socket", str(self.socket)]
        self.proc = start_daemon(argv, self.log_path)
        wait_until(self.proc, self._answers, timeout,
                   lambda: RuntimeError(f"{self.kind} server exited with {self.proc.returncode}: "
                                        f"{self.log_path.read_text(errors='replace')[-2000:]}"),
                   lambda: TimeoutError(f"{self.kind} server not ready"))
        return self

    def _answers(self) -> bool:
        if not self.socket.exists():
            return False
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            try:
                if self.kind == "plugin":
                    csi_pb2_grpc.IdentityStub(channel).GetPluginInfo(csi_pb2.GetPluginInfoRequest(), timeout=2)
                else:
                    handler_pb2_grpc.HandlerStub(channel).GetSandbox(handler_pb2.GetSandboxRequest(), timeout=2)
                return True
            except grpc.RpcError:
                return False

    def stop(self) -> None:
        stop_process(self.proc, 10)
        self.proc = None
