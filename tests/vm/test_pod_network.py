"""A pod off the host's network is reachable at its address, whatever runs
it: the same pods under runc (the baseline) and under crust-microvm (the
VM's NIC on a tap in the pod's network namespace, redirected to CNI's veth:
crust.sys.podnet), on a CNI bridge of the private containerd's own
(crust.kubelet.cni), started through CRI as kubelet starts them.

Checked as a Service and its clients would see it: an HTTP server in the
pod answers at the pod's address from the host and from another pod, at a
host port (portmap), and from inside the pod's network namespace at
localhost (what containerd's PortForward dials); its containers share
localhost; its hostname and its interface are the pod's; a privileged
container manages its network (a bridge of its own)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest
from pyroute2 import netns

from crust.api import cri_pb2 as cri
from crust.kubelet import ContainerPort
from tests.harness.pod_http import eventually_get, http_get, serve
from tests.harness.pod_nodes import KEEP_RUNNING, RUNTIME_CLASSES, pod_node

pytestmark = pytest.mark.slow


@pytest.fixture(params=RUNTIME_CLASSES)
def node(request, root):
    """The microVM's pods take VMs booted ahead of them, so their NIC and
    shares are plugged into a running VM (the other suites boot a VM per pod)."""
    with pod_node(request.param, root, pod_network=True, vm_pool=1) as made:
        yield made


def applet(name: str, *args: str) -> list[str]:
    """A busybox applet the test image has no link for (its shell runs it)."""
    return ["/bin/sh", "-c", 'exec "$0" "$@"', name, *args]


def sandbox_of(node, pod) -> cri.PodSandboxStatus:
    sandbox = node.runtime.pod_status(pod).ready_sandbox()
    assert sandbox is not None, f"pod {pod.name} has no ready sandbox"
    return sandbox


def network_namespace(node, sandbox_id: str) -> str:
    """The pod's network namespace, as containerd's verbose status gives it."""
    verbose = node.runtime._call("PodSandboxStatus", cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id,
                                                                                   verbose=True))
    info = json.loads(verbose.info["info"])
    for ns in info["runtimeSpec"]["linux"]["namespaces"]:
        if ns["type"] == "network":
            return ns["path"]
    raise AssertionError(f"sandbox {sandbox_id} has no network namespace: {info['runtimeSpec']['linux']}")


def get_from_namespace(path: str, port: int) -> bytes:
    """GET localhost:port from inside the namespace at path, from a socket
    made there (a thread of its own enters it), as containerd's
    PortForward dials."""
    made: dict = {}

    def connect() -> None:
        try:
            netns.setns(path, flags=0, fork=False)
            made["sock"] = socket.create_connection(("127.0.0.1", port), timeout=5)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            made["error"] = exc

    thread = threading.Thread(target=connect)
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]
    return http_get("127.0.0.1", port, sock=made["sock"])


def test_the_pods_address_answers_from_the_host_another_pod_a_host_port_and_its_own_namespace(node):
    host_port = free_port()
    web = node.pod("web", host_network=False, volumes={}, containers=[
        node.container("server", serve(f"hello-from-{node.runtime_class}"),
                       ports=[ContainerPort(80, host_port=host_port)]),
        node.container("neighbour", KEEP_RUNNING, privileged=True)])
    client = node.pod("client", host_network=False, volumes={}, containers=[node.container("client", KEEP_RUNNING)])
    expected = f"hello-from-{node.runtime_class}\n".encode()
    with node.running(web), node.running(client):
        sandbox = sandbox_of(node, web)
        address = sandbox.network.ip
        assert address.startswith("10.250."), sandbox.network
        # From the host, as a Service's traffic arrives.
        eventually_get(address, 80, expected, f"the web pod at {address}:80 from the host")
        # At its host port (portmap).
        eventually_get("127.0.0.1", host_port, expected, f"host port {host_port} of the web pod")
        # From another pod of the node.
        client_id = node.status(client, "client").id
        assert node.run(client_id, *applet("wget", "-q", "-O", "-", f"http://{address}/")) == expected
        # From the pod's other container, at localhost: one network per pod.
        neighbour = node.status(web, "neighbour").id
        assert node.run(neighbour, *applet("wget", "-q", "-O", "-", "http://127.0.0.1/")) == expected
        # Its interface carries the pod's address; its hostname is the pod's name.
        assert f"inet {address}/24" in node.run(neighbour, *applet("ip", "-o", "-4", "addr", "show", "eth0")).decode()
        assert node.run(neighbour, *applet("hostname")) == b"web\n"
        # A privileged container manages the pod's network: a bridge (the
        # kernel loads its module on demand, in the guest too).
        node.run(neighbour, *applet("brctl", "addbr", "crusttest0"))
        assert b"crusttest0" in node.run(neighbour, *applet("ip", "link", "show", "crusttest0"))
        node.run(neighbour, *applet("brctl", "delbr", "crusttest0"))
        # What containerd's PortForward dials: localhost in the pod's namespace.
        path = network_namespace(node, sandbox.id)
        assert get_from_namespace(path, 80) == expected
        # A port nothing listens on fails there, as under runc (refused;
        # in the microVM the accepted dial is reset).
        with pytest.raises(OSError):
            get_from_namespace(path, 81)
    # Nothing of the pod's network is left: its address answers no more,
    # and containerd removed its namespace.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, 80), timeout=1).close()
        except OSError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"{address}:80 still answers after the pod is gone")
    assert not os.path.exists(path)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
