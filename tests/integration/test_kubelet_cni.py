"""The pod network of a private containerd or CRI-O (crust.kubelet.cni),
driven by Debian's real CNI plugins as the engines drive them: a pod's ADD,
another pod's interface joining and leaving the bridge, then the first pod's
CHECK, which CRI-O runs right after every ADD."""

from __future__ import annotations

import json
import os
import secrets
import subprocess

import pytest

from crust.kubelet import cni

pytestmark = pytest.mark.skipif(bool(cni.available()), reason=cni.available() or "CNI plugins present")


def address_of(interface: str) -> str:
    with open(f"/sys/class/net/{interface}/address") as f:
        return f.read().strip()


def plugin(network: cni.BridgeNetwork, command: str, netns: str, container_id: str,
           prev_result: dict | None = None) -> subprocess.CompletedProcess:
    """The bridge plugin (with host-local) called as libcni calls it."""
    conflist = network.conflist()
    conf = {"cniVersion": conflist["cniVersion"], "name": conflist["name"], **conflist["plugins"][0]}
    if prev_result is not None:
        conf["prevResult"] = prev_result
    env = {**os.environ, "CNI_COMMAND": command, "CNI_CONTAINERID": container_id,
           "CNI_NETNS": f"/run/netns/{netns}", "CNI_IFNAME": "eth0", "CNI_PATH": str(cni.PLUGIN_DIR)}
    return subprocess.run([str(cni.PLUGIN_DIR / "bridge")], input=json.dumps(conf), env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def network(tmp_path):
    net = cni.BridgeNetwork(tmp_path / "cni", tmp_path / "cni-state").create()
    try:
        yield net
    finally:
        net.remove()


@pytest.fixture
def namespaces():
    made = []

    def new() -> str:
        name = f"crust-t-cni-{secrets.token_hex(4)}"
        subprocess.run(["ip", "netns", "add", name], check=True)
        made.append(name)
        return name

    try:
        yield new
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_a_pods_check_holds_while_other_pods_join_and_leave_the_bridge(network, namespaces):
    assert address_of(network.bridge) == network.address
    pod_a, pod_b = namespaces(), namespaces()
    added = plugin(network, "ADD", pod_a, "pod-a")
    assert added.returncode == 0, added.stdout + added.stderr
    result_a = json.loads(added.stdout)
    recorded = {i["name"]: i.get("mac") for i in result_a["interfaces"]}
    assert recorded[network.bridge] == network.address

    # Another pod comes: its host-side veth joins the bridge, and one with an
    # address below every other port's (which a bridge without an address
    # of its own would take as its own) joins and leaves.
    joined = plugin(network, "ADD", pod_b, "pod-b")
    assert joined.returncode == 0, joined.stdout + joined.stderr
    low = f"crt{secrets.token_hex(4)}"
    subprocess.run(["ip", "link", "add", low, "address", "02:00:00:00:00:01", "type", "veth", "peer", "name",
                    f"{low}p"], check=True)
    try:
        subprocess.run(["ip", "link", "set", low, "master", network.bridge, "up"], check=True)
        assert address_of(network.bridge) == network.address
        checked = plugin(network, "CHECK", pod_a, "pod-a", prev_result=result_a)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    finally:
        subprocess.run(["ip", "link", "del", low], capture_output=True)
    left = plugin(network, "DEL", pod_b, "pod-b")
    assert left.returncode == 0, left.stdout + left.stderr
    checked = plugin(network, "CHECK", pod_a, "pod-a", prev_result=result_a)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert plugin(network, "DEL", pod_a, "pod-a").returncode == 0
    assert address_of(network.bridge) == network.address


def test_two_networks_never_share_a_bridge_address(tmp_path):
    a = cni.BridgeNetwork(tmp_path / "a", tmp_path / "a-state")
    b = cni.BridgeNetwork(tmp_path / "b", tmp_path / "b-state")
    assert a.address != b.address
    first = int(a.address.split(":")[0], 16)
    assert first & 0b10 and not first & 0b01, "locally administered, unicast"
