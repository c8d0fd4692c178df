"""The pod's network on the VM's NIC (crust/guest/network.py,
ConfigureInterface): the agent run on the host in a network namespace of
its own whose NIC (a veth with the pod's MAC address) it finds,
renames, gives the pod's MTU, addresses and routes; what the kernel then
has is read with iproute2 from outside."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.kata.agent.client import AgentClient
from tests.harness.guest_container import REPO, code_of, stop, wait_listening

MAC = "02:c0:ff:ee:00:07"


def _in_netns(pid: int, *args: str) -> str:
    return subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", *args], capture_output=True, text=True,
                          timeout=30, check=True).stdout


def test_the_pods_interface_gets_exactly_its_addresses_routes_and_mtu(tmp_path):
    sock, log = tmp_path / "agent.sock", tmp_path / "agent.log"
    script = (f"mount -t sysfs none /sys && ip link add nic7 address {MAC} type veth peer name peer7 && ip link set peer7 up && "
              f"ip addr add 192.168.9.9/24 dev nic7 && "
              f"exec {sys.executable} -m crust.guest --listen {sock} --run-dir {tmp_path / 'run'}")
    with open(log, "wb") as out:
        proc = subprocess.Popen(["unshare", "--net", "--mount", "--propagation", "private", "sh", "-c", script],
                                cwd=REPO, stderr=out)
    request = agent_pb2.ConfigureInterfaceRequest(
        mac=MAC, mtu=1400,
        addresses=[agent_pb2.IPAddress(address="10.250.3.7", prefix_length=24),
                   agent_pb2.IPAddress(address="fd00:3::7", prefix_length=64)],
        routes=[agent_pb2.Route(gateway="10.250.3.1"),
                agent_pb2.Route(destination="10.96.0.0/12", gateway="10.250.3.1"),
                agent_pb2.Route(destination="10.250.4.0/24")])

    async def main():
        client = await AgentClient.connect(str(sock))
        try:
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            first = await client.call("ConfigureInterface", request, timeout=30)
            again = await client.call("ConfigureInterface", request, timeout=30)
            unreachable = agent_pb2.ConfigureInterfaceRequest()
            unreachable.CopyFrom(request)
            unreachable.routes.append(agent_pb2.Route(destination="10.0.0.0/8", gateway="192.0.2.1"))
            refused = await code_of(client.call("ConfigureInterface", unreachable, timeout=30))
            bad = await code_of(client.call("ConfigureInterface", agent_pb2.ConfigureInterfaceRequest(
                mac=MAC, mtu=1400, routes=[agent_pb2.Route(gateway="")]), timeout=30))
            absent = await code_of(client.call("ConfigureInterface", agent_pb2.ConfigureInterfaceRequest(
                mac="02:00:00:00:00:99", mtu=1500), timeout=2))
            return details, first, again, refused, bad, absent
        finally:
            await client.close()

    try:
        wait_listening(proc, sock, log, 60)
        details, first, again, refused, bad, absent = asyncio.run(main())
        link = _in_netns(proc.pid, "-o", "link", "show", "eth0")
        addresses = sorted(line.split()[3] for line in _in_netns(proc.pid, "-o", "addr", "show", "dev", "eth0")
                           .splitlines() if " scope link" not in line)
        routes = [r.strip() for r in _in_netns(proc.pid, "-4", "route", "show").splitlines()]
    finally:
        stop(proc)
    assert "network.interface" in details.capabilities
    assert (first.found_as, again.found_as) == ("nic7", "eth0")
    assert "mtu 1400" in link and "UP" in link.split(">")[0], link
    assert addresses == ["10.250.3.7/24", "fd00:3::7/64"], addresses   # 192.168.9.9 removed
    assert "default via 10.250.3.1 dev eth0" in routes and "10.96.0.0/12 via 10.250.3.1 dev eth0" in routes, routes
    assert any(r.startswith("10.250.4.0/24 dev eth0") for r in routes), routes
    assert refused[0] == ttrpc.FAILED_PRECONDITION and refused[1].startswith("routes[3]: "), refused
    assert bad == (ttrpc.INVALID_ARGUMENT, "routes[0]: a default route needs a gateway"), bad
    assert absent[0] == ttrpc.DEADLINE_EXCEEDED and "02:00:00:00:00:99" in absent[1], absent
