"""`crust status --config`: the node as `crust node` runs it.

Three sources, each read on its own so one that is down does not hide the
others: the supervisor's status file (children, pids, restarts), a gRPC
health check on every socket, and the proxy's own view (kubelet's
registration, deferred volumes, handlers).
"""

from __future__ import annotations

import json
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from crust.common.channel import local_channel
from crust.common.formats import NewerFormat, decode
from crust.node.config import NodeConfig
from crust.node.supervisor import NodeStatus
from crust.proxy.status import collect, print_report, unhealthy


def socket_health(path: str) -> str:
    """SERVING, NOT_SERVING or UNREACHABLE (with the reason)."""
    try:
        with local_channel(path) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    except grpc.RpcError as exc:
        return f"UNREACHABLE ({exc.code().name})"


def node_status(config: NodeConfig, as_json: bool, runtime_endpoint: str | None) -> int:
    """Exit 0 when every child runs, every socket serves and the proxy
    reports nothing unhealthy (a refusal by kubelet included)."""
    try:
        supervisor = decode(NodeStatus, config.status_file.read_bytes(), config.status_file)
        supervisor_error = ""
    except NewerFormat as exc:
        supervisor, supervisor_error = None, str(exc)
    except (OSError, ValueError) as exc:
        supervisor, supervisor_error = None, f"no status from `crust node` ({config.status_file}: {exc})"
    sockets = {"proxy (kubelet CSI)": str(config.kubelet_csi_socket), "driver": str(config.driver_socket),
               "shim": str(config.shim_socket), "proxy (runtime)": str(config.runtime_socket)}
    if config.handler.runtime.value != "none":
        sockets[f"handler ({config.handler_name})"] = str(config.handler_socket)
    health = {name: socket_health(path) for name, path in sockets.items()}
    endpoint = runtime_endpoint or f"unix://{config.runtime_socket}"
    try:
        proxy, proxy_error = collect(endpoint), ""
    except grpc.RpcError as exc:
        proxy, proxy_error = None, f"cannot reach the proxy at {endpoint}: {exc.code().name} {exc.details()}"
    if as_json:
        print(json.dumps({
            "node_id": config.node_id,
            "supervisor": supervisor.model_dump() if supervisor else {"error": supervisor_error},
            "sockets": {name: {"path": sockets[name], "health": health[name]} for name in sockets},
            "proxy": proxy if proxy is not None else {"error": proxy_error},
        }, indent=1))
    else:
        print(f"node {config.node_id}")
        if supervisor is None:
            print(f"  {supervisor_error}")
        else:
            print(f"  crust node pid {supervisor.supervisor_pid}, up {time.time() - supervisor.started_at:.0f}s")
            for c in supervisor.children:
                state = f"running pid {c.pid}" if c.running else "NOT RUNNING"
                last = f", last exit: {c.last_exit}" if c.last_exit else ""
                print(f"  {c.name:<8} {state:<20} restarts {c.restarts}{last}")
        print("sockets:")
        for name, path in sockets.items():
            print(f"  {name:<24} {health[name]:<12} {path}")
        if proxy is None:
            print(f"crust status: {proxy_error}")
        else:
            print_report(proxy)
    running = supervisor is not None and all(c.running for c in supervisor.children)
    healthy = all(h == "SERVING" for h in health.values()) and proxy is not None and not unhealthy(proxy)
    return 0 if running and healthy else 1
