"""`crust status`: kubelet's registration, the health of the proxy and its
plugin, the deferred volumes and the registered handlers, as the proxy sees
them (asked over its runtime socket)."""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf import json_format

from crust.api import registry_pb2, registry_pb2_grpc
from crust.common.channel import local_channel


def as_dict(message) -> dict:
    # Every scalar field, even at its default (lease_expired: false, an
    # empty kata_mirror_error): a script must not have to know proto3's
    # omission rules to read a fresh handler's lease.
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def collect(endpoint: str) -> dict:
    """The proxy's answers as plain data; raises grpc.RpcError when it is unreachable."""
    with local_channel(endpoint) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        volumes = stub.ListVolumes(registry_pb2.ListVolumesRequest(), timeout=10).volumes
        handlers = stub.ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10).handlers
        node = stub.GetNodeStatus(registry_pb2.GetNodeStatusRequest(), timeout=10)
    return {
        "kubelet_registration": as_dict(node.kubelet_registration) if node.HasField("kubelet_registration") else None,
        "components": [as_dict(c) for c in node.components],
        "volumes": [as_dict(v) for v in volumes],
        "handlers": [as_dict(h) for h in handlers],
    }


def print_report(report: dict) -> None:
    r = report["kubelet_registration"]
    if r is None:
        print("kubelet registration: not served by the proxy (node-driver-registrar, or none)")
    else:
        age = f", {r['verdict_age_seconds']:.0f}s ago" if r["verdict_age_seconds"] >= 0 else ""
        print(f"kubelet registration: {r['state']}{age}  driver {r['driver_name']} -> {r['endpoint']}")
        made_again = int(r["socket_recreated"])
        print(f"  socket {r['socket']}" + (f" (made again {made_again}x)" if made_again else ""))
        if r["error"]:
            print(f"  kubelet's last error: {r['error']}")
        if r["info_age_seconds"] < 0:
            print("  kubelet has not asked for the plugin's info yet (is kubelet watching this directory?)")
    print(f"components: {len(report['components'])}")
    for c in report["components"]:
        print(f"  {c['name']:<28} {c['status']:<12} {c['endpoint']}" + (f"  ({c['detail']})" if c["detail"] else ""))
    print(f"deferred volumes: {len(report['volumes'])}")
    for v in report["volumes"]:
        claim = v.get("claim")
        holder = f"{claim['handler']}/{claim['sandbox_id']}" if claim else "-"
        print(f"  {v['state']:<12} {v['fs_type']:<5} {v['device']:<14} {holder:<30} {v['target_path']}")
        if v["kata_mirror_error"]:
            print(f"  {'':12} kata mirror: {v['kata_mirror_error']}")
    print(f"handlers: {len(report['handlers'])}")
    for h in report["handlers"]:
        lease = "expired" if h["lease_expired"] else "fresh"
        by = f"  (uid {h['registered_by_uid']}, pid {h['registered_by_pid']})" \
            if int(h["registered_by_uid"]) >= 0 else ""
        print(f"  {h['name']:<16} lease {lease} ({h['lease_age_seconds']:.1f}s)  "
              f"{','.join(h['filesystems']):<10} {h['endpoint']}{by}")


def unhealthy(report: dict) -> bool:
    r = report["kubelet_registration"]
    return (r is not None and r["state"] == "refused") or any(c["status"] != "SERVING" for c in report["components"])


def status(endpoint: str, as_json: bool) -> int:
    """Exit 0 when the proxy answers and nothing it reports is unhealthy."""
    try:
        report = collect(endpoint)
    except grpc.RpcError as exc:
        print(f"crust status: cannot reach the proxy at {endpoint}: {exc.code().name} {exc.details()}",
              file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        print_report(report)
    return 1 if unhealthy(report) else 0
