"""A pod network of our own for a private containerd: a bridge, the CNI
plugins of Debian's containernetworking-plugins, and nothing else of the
host's changed.

Pods that do not use the host's network get an address on a /24 of
10.250.0.0/16 that no route of the host covers, on a bridge this module
makes (named from a random suffix, so two networks never share one),
with the host's address on it: the host reaches a pod's address directly,
and `portmap` maps a pod's host ports (also from 127.0.0.1). The bridge is
made here rather than by the bridge plugin because the plugin, asked to be
the gateway, turns on the host's IP forwarding, a setting of the whole
host that nothing here needs: traffic only goes between the host and its
pods.

The bridge gets an address of its own at creation. Without one, Linux
gives a bridge the lowest address of its ports, so another pod's veth
joining or leaving changes it; the bridge plugin's CHECK compares the
bridge's address with the one its ADD recorded, and CRI-O runs CHECK right
after each ADD: a pod started while another came or went would fail
"failed to get network status for pod sandbox".

IPAM state (host-local) lives below our directory. remove() takes the
bridge, our entries of libcni's result cache (and its directories, when
they were made for us and are empty) and our directory's state;
a pod's own rules (portmap's per-pod chains, the veth) go when containerd
tears the pod's network down.
"""

from __future__ import annotations

import ipaddress
import json
import random
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pyroute2 import IPRoute

PLUGIN_DIR = Path("/usr/lib/cni")
PLUGINS = ("bridge", "host-local", "portmap", "loopback")
# libcni's cache of results, one file per network, container and interface.
RESULT_CACHE = Path("/var/lib/cni/results")
POOL = ipaddress.ip_network("10.250.0.0/16")


class NetworkError(Exception):
    pass


def available() -> str:
    """Why the pod network cannot be made here, or "" when it can."""
    missing = [p for p in PLUGINS if not (PLUGIN_DIR / p).exists()]
    if missing:
        return (f"CNI plugins missing in {PLUGIN_DIR}: {', '.join(missing)} "
                "(apt-get install containernetworking-plugins)")
    return ""


def _free_subnet(ipr: IPRoute) -> ipaddress.IPv4Network:
    """A /24 of the pool that no route of the host overlaps."""
    taken = []
    for route in ipr.get_routes(family=2):
        dst = route.get_attr("RTA_DST")
        if dst is not None:
            taken.append(ipaddress.ip_network(f"{dst}/{route['dst_len']}", strict=False))
    candidates = list(POOL.subnets(new_prefix=24))
    random.shuffle(candidates)
    for subnet in candidates:
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise NetworkError(f"no /24 of {POOL} is free of the host's routes")


@dataclass
class BridgeNetwork:
    """The network, its configuration in `conf_dir`, its state in `state_dir`."""

    conf_dir: Path
    state_dir: Path
    suffix: str = field(default_factory=lambda: secrets.token_hex(4))
    subnet: ipaddress.IPv4Network | None = None
    # libcni's cache directories that did not exist before this network:
    # removed at the end if nothing else is in them.
    _new_cache_dirs: list[Path] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"crust-{self.suffix}"

    @property
    def bridge(self) -> str:
        return f"crbr-{self.suffix}"  # 13 characters: an interface name holds 15

    @property
    def address(self) -> str:
        """The bridge's own hardware address: locally administered, unicast,
        from the network's suffix (so two networks never share one)."""
        return "0a:58:" + ":".join(self.suffix[i:i + 2] for i in range(0, 8, 2))

    @property
    def gateway(self) -> str:
        return str(next(self.subnet.hosts()))

    def conflist(self) -> dict:
        return {
            "cniVersion": "0.4.0",
            "name": self.name,
            "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": False, "ipMasq": False, "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(self.state_dir / "ipam"),
                          "ranges": [[{"subnet": str(self.subnet), "gateway": self.gateway}]]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }

    def create(self) -> "BridgeNetwork":
        problem = available()
        if problem:
            raise NetworkError(problem)
        self._new_cache_dirs = [d for d in (RESULT_CACHE, RESULT_CACHE.parent) if not d.exists()]
        with IPRoute() as ipr:
            self.subnet = _free_subnet(ipr)
            ipr.link("add", ifname=self.bridge, kind="bridge", address=self.address)
            (index,) = ipr.link_lookup(ifname=self.bridge)
            ipr.addr("add", index=index, address=self.gateway, prefixlen=24)
            ipr.link("set", index=index, state="up")
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.conf_dir / "10-crust.conflist").write_text(json.dumps(self.conflist(), indent=1))
        return self

    def remove(self) -> list[str]:
        """The bridge and our cached results; returns the results a pod's
        teardown should have removed (none after an orderly end)."""
        removed = []
        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=self.bridge):
                ipr.link("del", index=index)
        if RESULT_CACHE.is_dir():
            for cached in RESULT_CACHE.glob(f"{self.name}-*"):
                cached.unlink(missing_ok=True)
                removed.append(f"CNI result {cached.name[:40]}")
        for directory in self._new_cache_dirs:
            try:
                directory.rmdir()
            except OSError:
                break  # not empty (another network's results) or already gone
        shutil.rmtree(self.state_dir, ignore_errors=True)
        return removed
