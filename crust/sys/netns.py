"""A pod sandbox's own network namespace, named and set up with pyroute2.

Like the pod sandboxes of a CRI runtime, each mount-namespace sandbox gets a
named network namespace (/run/netns/<name>, visible to `ip netns`) with
only its loopback interface, up: the container has no route to the host's
network unless an operator adds one. The namespace outlives the handler (as
the sandbox does) and is removed with the sandbox.

Nothing here forks. pyroute2's own `netns.create` and `NetNS` fork a child
that goes on running Python, which breaks the gRPC channels of the asyncio
daemon that forked (its file descriptors are shared). So the sandbox's
holder process makes the namespace (`unshare --net`), pyroute2 binds it to
its name (`attach`, a bind mount), and the loopback is brought up from a
short-lived thread that enters the namespace (setns affects that thread
alone) and opens its netlink socket there.

Names are `crust-<h8>-<h12>`: h8 from the handler's run directory, h12 from
the sandbox's work directory, so a handler recognises exactly its own
namespaces (a sweep at start removes those whose sandbox is gone) and two
handlers never collide.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from pyroute2 import IPRoute, netns

def _h(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def prefix_for(run_dir: Path) -> str:
    """The name prefix of every namespace of the handler whose sandboxes live in run_dir."""
    return f"crust-{_h(str(run_dir), 8)}-"


def name_for(workdir: Path) -> str:
    """The namespace of the sandbox whose work directory is workdir."""
    return prefix_for(workdir.parent) + _h(str(workdir), 12)


def attach(name: str, pid: int) -> None:
    """Name the network namespace of process pid (idempotent) and bring its
    loopback up."""
    if name not in netns.listnetns():
        netns.attach(name, pid)

    def loopback_up(ipr: IPRoute) -> None:
        (lo,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=lo, state="up")

    inside(name, loopback_up)


def interfaces(name: str) -> dict[str, bool]:
    """Interface name -> up, as the namespace holds them."""
    return inside(name, lambda ipr: {link.get_attr("IFLA_IFNAME"): bool(link["flags"] & 1)
                                      for link in ipr.get_links()})


def inside(name: str, work):
    """Run work(IPRoute) on a netlink socket opened inside the namespace (a
    name below /run/netns, or the path of one: containerd's pods), from a
    thread of its own that enters it and ends with it."""
    result: dict = {}

    def run() -> None:
        try:
            netns.setns(name, flags=0, fork=False)
            with IPRoute() as ipr:
                result["value"] = work(ipr)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name=f"netns-{name}", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def is_in(name: str, pid: int) -> bool:
    """Whether process pid is in the named namespace (the same namespace
    inode as the name's bind mount): what the kernel says of the process,
    which no record can say for it."""
    try:
        named = os.stat(os.path.join(netns.NETNS_RUN_DIR, name))
        its = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (its.st_dev, its.st_ino)


def remove(name: str) -> None:
    """Remove the namespace (idempotent); its processes must be gone."""
    if name in netns.listnetns():
        netns.remove(name)


def sweep(run_dir: Path, keep: set[str]) -> list[str]:
    """Remove this handler's namespaces whose sandbox (work dir name in
    keep) is not kept; returns the names removed."""
    prefix = prefix_for(run_dir)
    wanted = {name_for(run_dir / sandbox_id) for sandbox_id in keep}
    removed = [name for name in netns.listnetns() if name.startswith(prefix) and name not in wanted]
    for name in removed:
        netns.remove(name)
    return removed
