"""A pod's network, handed to its microVM: the interface CNI made in the pod's
network namespace, a tap device beside it, and traffic redirected between
the two (Kata's tc-filter model).

containerd runs CNI for a VM pod as for any pod: the pod's network namespace
gets a veth (eth0) with the pod's address and routes. The VM's NIC is a tap
device made in that namespace; two tc filters on the ingress of each
(u32, match everything, mirred egress redirect) pass every frame from the
veth to the tap and back, and the guest gives its NIC the veth's MAC
address, the pod's addresses, routes and MTU (read here). So the pod's
address answers from the guest: the bridge, the host's routes, portmap's
host ports and Services reach it as they reach a runc pod. The
namespace's own stack sees nothing any more (its eth0 keeps the address,
which CNI's teardown reads).

The tap is not persistent: it lives as long as the descriptor that made it,
which QEMU takes (`-netdev tap,fd=N`), so a VM's tap goes with its QEMU.

Port forwarding (CRI PortForward): containerd dials localhost:<port> inside
the pod's namespace, where nothing listens once the pod runs in a VM. A
REDIRECT rule of the namespace's own (nat OUTPUT, chain CRUST-PORTFORWARD)
sends every TCP connection to 127.0.0.1 to one listening socket, made
inside the namespace by the handler; original_destination() tells which
port was asked for, and the handler connects to the pod's address from the
host, as any client of the pod does.

Everything here enters the namespace from a short-lived thread
(crust.sys.netns.inside): setns affects that thread alone.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field

from pyroute2 import IPRoute

from crust.sys import netns
from crust.sys.run import CommandError, run

TUN = "/dev/net/tun"
TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI, IFF_VNET_HDR = 0x0002, 0x1000, 0x4000
ETH_P_ALL = 0x0003
INGRESS = 0xFFFF0000        # the ingress qdisc's handle, ffff:
FLOW = 0x10001              # 1:1, the class the match-everything filter names
SO_ORIGINAL_DST = 80        # linux/netfilter_ipv4.h
CHAIN = "CRUST-PORTFORWARD"
# Links a pod's namespace holds that are not the pod's network.
NOT_THE_POD = ("lo",)


class PodNetworkError(Exception):
    pass


@dataclass(frozen=True)
class Route:
    destination: str        # "default" or a prefix (10.0.0.0/8)
    gateway: str            # "" for a route on the link itself

    def word(self) -> str:
        return f"{self.destination},{self.gateway or '-'}"


@dataclass(frozen=True)
class Interface:
    """The pod's interface in its namespace, as the guest must copy it."""
    name: str
    mac: str
    mtu: int
    addresses: tuple[str, ...]          # "10.250.3.7/24", IPv6 ones too (no link-local)
    routes: tuple[Route, ...] = field(default_factory=tuple)

    @property
    def ipv4(self) -> str:
        """The pod's first IPv4 address (without its prefix), "" if none."""
        for address in self.addresses:
            ip = ipaddress.ip_interface(address).ip
            if ip.version == 4:
                return str(ip)
        return ""


def read_interface(path: str) -> Interface | None:
    """The pod's interface in the namespace at path: the one link that is
    not the loopback, with its addresses and the routes through it; None
    when the namespace has only its loopback (no pod network)."""
    def work(ipr: IPRoute) -> Interface | None:
        links = [link for link in ipr.get_links() if link.get_attr("IFLA_IFNAME") not in NOT_THE_POD]
        if not links:
            return None
        if len(links) > 1:
            names = ", ".join(sorted(link.get_attr("IFLA_IFNAME") for link in links))
            raise PodNetworkError(f"the pod's network namespace has {len(links)} interfaces ({names}); "
                                  f"a microVM pod takes one")
        link = links[0]
        index = link["index"]
        addresses = []
        for addr in ipr.get_addr(index=index):
            ip = ipaddress.ip_interface(f"{addr.get_attr('IFA_ADDRESS')}/{addr['prefixlen']}")
            if not ip.ip.is_link_local:
                addresses.append(str(ip))
        routes = []
        for family in (socket.AF_INET, socket.AF_INET6):
            for route in ipr.get_routes(family=family, table=254):
                if route.get_attr("RTA_OIF") != index:
                    continue
                gateway = route.get_attr("RTA_GATEWAY") or ""
                dst = route.get_attr("RTA_DST")
                if not gateway:
                    continue   # the link's own prefix: the guest gets it with the address
                destination = f"{dst}/{route['dst_len']}" if dst else "default"
                routes.append(Route(destination, gateway))
        return Interface(link.get_attr("IFLA_IFNAME"), link.get_attr("IFLA_ADDRESS"), link.get_attr("IFLA_MTU"),
                         tuple(addresses), tuple(routes))

    return netns.inside(path, work)


def open_tap(path: str, name: str, peer: Interface) -> int:
    """A tap named name in the namespace at path, up, with peer's MTU, and
    every frame redirected between it and peer; returns its descriptor
    (the tap lives as long as it does). Made again from the start when an
    earlier attempt left a redirect behind."""
    if len(name.encode()) > 15:
        raise ValueError(f"interface name {name!r} is longer than 15 bytes")

    def work(ipr: IPRoute) -> int:
        fd = os.open(TUN, os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
            (tap,) = ipr.link_lookup(ifname=name)
            (veth,) = ipr.link_lookup(ifname=peer.name) or [None]
            if veth is None:
                raise PodNetworkError(f"the pod's interface {peer.name} is gone")
            ipr.link("set", index=tap, mtu=peer.mtu, state="up")
            for source, target in ((veth, tap), (tap, veth)):
                _drop_ingress(ipr, source)
                ipr.tc("add", "ingress", index=source)
                ipr.tc("add-filter", "u32", index=source, parent=INGRESS, protocol=ETH_P_ALL, prio=1,
                       target=FLOW, keys=["0x0/0x0+0"],
                       action=[{"kind": "mirred", "direction": "egress", "action": "redirect", "ifindex": target}])
            return fd
        except BaseException:
            os.close(fd)
            raise

    return netns.inside(path, work)


def restore(path: str, peer_name: str) -> None:
    """Undo the redirect on the pod's interface (the tap goes with its QEMU);
    nothing when the namespace or the interface is gone."""
    if not os.path.exists(path):
        return

    def work(ipr: IPRoute) -> None:
        for index in ipr.link_lookup(ifname=peer_name):
            _drop_ingress(ipr, index)

    netns.inside(path, work)


def _drop_ingress(ipr: IPRoute, index: int) -> None:
    try:
        ipr.tc("del", "ingress", index=index)
    except Exception as exc:  # noqa: BLE001 - pyroute2 raises NetlinkError; absent is fine
        if getattr(exc, "code", None) not in (2, 22):   # ENOENT, EINVAL: no ingress qdisc there
            raise


# -- port forwarding -------------------------------------------------------------------


def listen_inside(path: str) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (a port the kernel picks) inside
    the namespace at path; it stays in that namespace whatever thread uses it."""
    def work(_ipr: IPRoute) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)
            sock.setblocking(False)
            return sock
        except BaseException:
            sock.close()
            raise

    return netns.inside(path, work)


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where the connection accepted on sock was going before REDIRECT."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


async def redirect_localhost(path: str, port: int) -> None:
    """Every TCP connection to 127.0.0.1 in the namespace goes to port
    (chain CRUST-PORTFORWARD of its nat table, made afresh)."""
    await _iptables(path, "-N", CHAIN, ok_exists=True)
    await _iptables(path, "-F", CHAIN)
    await _iptables(path, "-A", CHAIN, "-p", "tcp", "-d", "127.0.0.1/32", "!", "--dport", str(port),
                    "-j", "REDIRECT", "--to-ports", str(port))
    if not await _iptables(path, "-C", "OUTPUT", "-j", CHAIN, check=False):
        await _iptables(path, "-A", "OUTPUT", "-j", CHAIN)


async def remove_redirect(path: str) -> None:
    """The namespace's CRUST-PORTFORWARD rules gone (nothing when it is)."""
    if not os.path.exists(path):
        return
    while await _iptables(path, "-D", "OUTPUT", "-j", CHAIN, check=False):
        pass
    if await _iptables(path, "-F", CHAIN, check=False):
        await _iptables(path, "-X", CHAIN, check=False)


async def _iptables(path: str, *args: str, check: bool = True, ok_exists: bool = False) -> bool:
    argv = ["nsenter", f"--net={path}", "iptables", "-w", "5", "-t", "nat", *args]
    try:
        result = await run(argv, check=False, timeout=30)
    except (CommandError, FileNotFoundError) as exc:
        raise PodNetworkError(f"iptables in the pod's network namespace: {exc}") from None
    if result.returncode == 0:
        return True
    if ok_exists and "exists" in result.stderr:
        return True
    if check:
        raise PodNetworkError(f"iptables {' '.join(args)} in {path} exited {result.returncode}: "
                              f"{result.stderr.strip()}")
    return False
