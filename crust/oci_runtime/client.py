"""The runtime's side of the handler's ContainerVolumes service, without gRPC.

crust-oci-runtime runs for one call and exits: importing grpc and the
generated messages would be most of its start (python -X importtime),
more than the handler's work. So it speaks the same service
over the handler's second socket, `<endpoint>.json` beside the gRPC one:
one connection per call, one JSON object per line each way, the messages
in protobuf's JSON mapping of specs/handler.proto (lowerCamelCase names):

    -> {"method": "PrepareContainer", "request": {"containerId": "...", ...}}
    <- {"response": {"mounts": [{"destination": "/data", "device": "/dev/loop3", ...}]}}
    <- {"error": {"code": "FAILED_PRECONDITION", "message": "..."}}

(specs/handler.proto, service ContainerVolumes; docs/protocol.md). Only
the standard library is imported here.
"""

from __future__ import annotations

import json
import os
import socket

# A claim goes through the proxy's registry; a deferred entry kubelet just
# published may take the handler a few seconds to see.
PREPARE_TIMEOUT = 60.0
CALL_TIMEOUT = 30.0
MAX_REPLY = 16 << 20
JSON_SUFFIX = ".json"


class RuntimeFailure(Exception):
    pass


def json_socket_path(endpoint: str) -> str:
    """The handler's JSON socket for its gRPC endpoint unix://PATH: PATH.json."""
    if not endpoint.startswith("unix://"):
        raise RuntimeFailure(f"the crust handler's endpoint {endpoint!r} is not a unix socket (unix://PATH)")
    return endpoint[len("unix://"):] + JSON_SUFFIX


class DeferredMount:
    """A bind the handler claimed for the pod: runc mounts device instead.
    (A plain class: dataclasses would import inspect at every start.)"""

    __slots__ = ("destination", "target_path", "device", "fs_type", "options")

    def __init__(self, destination: str, target_path: str, device: str, fs_type: str, options: tuple[str, ...]):
        self.destination, self.target_path, self.device = destination, target_path, device
        self.fs_type, self.options = fs_type, options


class HandlerClient:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.path = json_socket_path(endpoint)

    def close(self) -> None:
        pass   # one connection per call

    def _call(self, method: str, request: dict, timeout: float = CALL_TIMEOUT) -> dict:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        try:
            try:
                sock.connect(self.path)
            except OSError as exc:
                raise RuntimeFailure(f"the crust handler at {self.endpoint} is unreachable ({self.path}: "
                                     f"{exc.strerror or exc}): deferred volumes cannot be mounted without it") from None
            sock.sendall(json.dumps({"method": method, "request": request}, separators=(",", ":")).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
                if len(reply) > MAX_REPLY:
                    raise RuntimeFailure(f"crust handler: {method}: a reply larger than {MAX_REPLY} bytes")
        except socket.timeout:
            raise RuntimeFailure(f"crust handler: {method}: no answer within {timeout:g} s") from None
        except OSError as exc:
            raise RuntimeFailure(f"crust handler: {method}: {exc}") from None
        finally:
            sock.close()
        try:
            answer = json.loads(reply)
        except ValueError:
            raise RuntimeFailure(f"crust handler: {method}: the connection ended without an answer") from None
        if "error" in answer:
            error = answer["error"]
            raise RuntimeFailure(f"crust handler: {error.get('code', 'UNKNOWN')}: {error.get('message', '')}")
        return answer.get("response") or {}

    def prepare(self, container_id: str, sandbox_id: str, bundle: str, mounts: list[dict]) -> list[DeferredMount]:
        request = {"containerId": container_id, "sandboxId": sandbox_id, "bundle": bundle, "runtimePid": os.getpid(),
                   "mounts": [{"destination": m.get("destination", ""), "type": m.get("type", ""),
                               "source": m.get("source", ""), "options": m.get("options") or []} for m in mounts]}
        answer = self._call("PrepareContainer", request, PREPARE_TIMEOUT)
        return [DeferredMount(m.get("destination", ""), m.get("targetPath", ""), m.get("device", ""),
                              m.get("fsType", ""), tuple(m.get("options") or ()))
                for m in answer.get("mounts") or []]

    def created(self, container_id: str, pid: int) -> None:
        self._call("ContainerCreated", {"containerId": container_id, "pid": pid})

    def release(self, container_id: str) -> None:
        self._call("ReleaseContainer", {"containerId": container_id})
