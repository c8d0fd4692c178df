"""`crust status`: the deferred volumes and the registered handlers, as the
proxy sees them (asked over its runtime socket)."""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf import json_format

from crust.api import registry_pb2, registry_pb2_grpc
from crust.common.channel import local_channel


def status(endpoint: str, as_json: bool) -> int:
    try:
        with local_channel(endpoint) as channel:
            stub = registry_pb2_grpc.RegistryStub(channel)
            volumes = stub.ListVolumes(registry_pb2.ListVolumesRequest(), timeout=10).volumes
            handlers = stub.ListHandlers(registry_pb2.ListHandlersRequest(), timeout=10).handlers
    except grpc.RpcError as exc:
        print(f"crust status: cannot reach the proxy at {endpoint}: {exc.code().name} {exc.details()}",
              file=sys.stderr)
        return 1
    if as_json:
        # Every scalar field, even at its default (lease_expired: false, an
        # empty kata_mirror_error): a script must not have to know proto3's
        # omission rules to read a fresh handler's lease.
        def as_dict(message):
            return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                             always_print_fields_with_no_presence=True)

        print(json.dumps({
            "volumes": [as_dict(v) for v in volumes],
            "handlers": [as_dict(h) for h in handlers],
        }, indent=1))
        return 0
    print(f"deferred volumes: {len(volumes)}")
    for v in volumes:
        holder = f"{v.claim.handler}/{v.claim.sandbox_id}" if v.HasField("claim") else "-"
        print(f"  {v.state:<12} {v.fs_type:<5} {v.device:<14} {holder:<30} {v.target_path}")
        if v.kata_mirror_error:
            print(f"  {'':12} kata mirror: {v.kata_mirror_error}")
    print(f"handlers: {len(handlers)}")
    for h in handlers:
        lease = "expired" if h.lease_expired else "fresh"
        print(f"  {h.name:<16} lease {lease} ({h.lease_age_seconds:.1f}s)  {','.join(h.filesystems):<10} {h.endpoint}")
    return 0
