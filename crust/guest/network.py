"""The pod's network on the VM's NIC (ConfigureInterface): the NIC the host
plugged, found by its MAC address (waited for on the kernel's device
events: a NIC hot-plugged a moment ago may still be probed), renamed, its
MTU, exactly the pod's addresses (others removed, except the kernel's
IPv6 link-local one), up, and the pod's routes, each replaced if present.

The host read all of it from the pod's network namespace
(crust/sys/podnet.py); the guest's `ip` applies it. Every value is
checked here first, so that `ip` is only ever given a MAC address, a
number, an interface name and IP addresses.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.errors import AgentError
from crust.guest.uevents import DeviceEvents

SYS_NET = "/sys/class/net"
DEFAULT_NAME = "eth0"
MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
IP = "ip"


def _address(field: str, a: agent_pb2.IPAddress) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    try:
        return ipaddress.ip_interface(f"{ipaddress.ip_address(a.address)}/{a.prefix_length}")
    except ValueError as exc:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {exc}") from None


def _route(field: str, r: agent_pb2.Route) -> tuple[str, str, int]:
    """(destination or "default", gateway or "", family 4 or 6)."""
    try:
        gateway = str(ipaddress.ip_address(r.gateway)) if r.gateway else ""
        destination = str(ipaddress.ip_network(r.destination, strict=True)) if r.destination else "default"
    except ValueError as exc:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: {exc}") from None
    if destination == "default" and not gateway:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: a default route needs a gateway")
    version = ipaddress.ip_address(gateway).version if gateway else ipaddress.ip_network(destination).version
    if gateway and destination != "default" and ipaddress.ip_network(destination).version != version:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"{field}: destination and gateway of two families")
    return destination, gateway, version


def check(request: agent_pb2.ConfigureInterfaceRequest):
    if not MAC.fullmatch(request.mac):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"mac: {request.mac!r} is not aa:bb:cc:dd:ee:ff (lowercase)")
    name = request.name or DEFAULT_NAME
    if not NAME.fullmatch(name):
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"name: {name!r} is not 1..15 characters of [A-Za-z0-9_.-]")
    if not 68 <= request.mtu <= 65535:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"mtu: {request.mtu} is not 68..65535")
    addresses = [_address(f"addresses[{i}]", a) for i, a in enumerate(request.addresses)]
    routes = [_route(f"routes[{i}]", r) for i, r in enumerate(request.routes)]
    return name, addresses, routes


def find(mac: str, sys_net: str = SYS_NET) -> str | None:
    """The kernel's name of the NIC with that MAC address, if it has one now."""
    try:
        names = os.listdir(sys_net)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(sys_net, name, "address")) as f:
                if f.read().strip() == mac:
                    return name
        except OSError:
            continue
    return None


async def _ip(field: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(IP, *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    if proc.returncode != 0:
        words = err.decode(errors="replace").strip().splitlines()
        raise AgentError(ttrpc.FAILED_PRECONDITION, f"{field}: {words[-1] if words else f'ip exit {proc.returncode}'}")
    return out.decode(errors="replace")


def _present(listing: str) -> set[str]:
    """The addresses `ip addr show` lists, as "address/prefix", without the
    IPv6 link-local ones (the kernel's own)."""
    found = set()
    for line in listing.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("inet", "inet6"):
            interface = ipaddress.ip_interface(words[1])
            if not (interface.version == 6 and interface.ip.is_link_local):
                found.add(str(interface))
    return found


async def configure(request: agent_pb2.ConfigureInterfaceRequest, events: DeviceEvents, timeout: float,
                    sys_net: str = SYS_NET) -> agent_pb2.ConfigureInterfaceResponse:
    name, addresses, routes = check(request)
    found = await events.wait_until(lambda: find(request.mac, sys_net), timeout)
    if found is None:
        raise AgentError(ttrpc.DEADLINE_EXCEEDED, f"mac: no network interface with MAC address {request.mac} "
                                                 f"(virtio-net not plugged?)")
    if found != name:
        await _ip("name", "link", "set", "dev", found, "down")
        await _ip("name", "link", "set", "dev", found, "name", name)
    await _ip("mtu", "link", "set", "dev", name, "mtu", str(request.mtu))
    wanted = {str(a) for a in addresses}
    present = _present(await _ip("addresses", "addr", "show", "dev", name))
    for stale in sorted(present - wanted):
        await _ip("addresses", "addr", "del", stale, "dev", name)
    for i, a in enumerate(addresses):
        if str(a) not in present:
            await _ip(f"addresses[{i}]", "addr", "add", str(a), "dev", name)
    await _ip("name", "link", "set", "dev", name, "up")
    for i, (destination, gateway, version) in enumerate(routes):
        via = ["via", gateway] if gateway else []
        await _ip(f"routes[{i}]", f"-{version}", "route", "replace", destination, *via, "dev", name)
    return agent_pb2.ConfigureInterfaceResponse(found_as=found)
