"""`crust sandbox run|delete|list`: drive the handler's sandboxes over its socket."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
from google.protobuf import json_format

from crust.api import handler_pb2, handler_pb2_grpc
from crust.common.channel import local_channel

State = handler_pb2.GetSandboxResponse.State


def _stub(endpoint: str) -> tuple[grpc.Channel, handler_pb2_grpc.SandboxControlStub]:
    channel = local_channel(endpoint)
    return channel, handler_pb2_grpc.SandboxControlStub(channel)


def _print(info: handler_pb2.SandboxInfo) -> None:
    state = State.Name(info.state).lower()
    process = f"exited {info.exit_code}" if info.exited else f"process {info.process_pid}"
    print(f"{info.sandbox_id:<24} {state:<8} pid {info.pid:<8} {process}")
    for v in info.volumes:
        views = ", ".join(f"{d}{' (' + s + ')' if s else ''}" for d, s in zip(v.destinations, v.subpaths))
        print(f"  {v.fs_type:<5} {v.device:<12} -> {views}   [{v.target_path}]")


def main(action: str, endpoint: str, bundle: Path | None = None, sandbox_id: str = "", as_json: bool = False) -> int:
    channel, stub = _stub(endpoint)
    try:
        if action == "run":
            info = stub.RunSandbox(handler_pb2.RunSandboxRequest(bundle=str(bundle.absolute()),
                                                                 sandbox_id=sandbox_id), timeout=120).sandbox
            infos = [info]
        elif action == "delete":
            stub.DeleteSandbox(handler_pb2.DeleteSandboxRequest(sandbox_id=sandbox_id), timeout=120)
            infos = []
        else:
            infos = list(stub.ListSandboxes(handler_pb2.ListSandboxesRequest(), timeout=30).sandboxes)
    except grpc.RpcError as exc:
        print(f"crust sandbox {action}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        channel.close()
    if as_json:
        print(json.dumps([json_format.MessageToDict(i, preserving_proto_field_name=True) for i in infos], indent=1))
    else:
        for info in infos:
            _print(info)
    return 0
