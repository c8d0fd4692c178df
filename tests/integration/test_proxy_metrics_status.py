"""What `crust proxy` reports of its deferred volumes: Prometheus metrics and `crust status`.

Real `crust driver` -> `crust shim` -> `crust proxy` processes with a policy
that defers on a storage class parameter (tests.harness.proxy_csi). The
metrics count deferred publishes (not host publishes) and the deferred
volumes by state; `crust status`, as JSON and as text, lists the deferred
volumes with their devices, states and claims and the registered handlers
with their leases, and says so when the proxy cannot be reached.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from tests.harness.daemons import scrape_metrics
from tests.harness.proxy_csi import (  # noqa: F401 - handler: a fixture
    DEFER_PARAM,
    DEFER_POLICY,
    handler,
    loop_of,
    new_volume,
    publish,
    start_stack,
    target_of,
)


# -- metrics ---------------------------------------------------------------------------------------------------


def test_metrics_count_deferred_publishes(root):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    driver, shim, proxy = start_stack(root, DEFER_POLICY, proxy_extra=["--metrics-port", str(port)])

    counter = ("volumes_published_with_deferred_ops_total", ())
    assert scrape_metrics(port)[counter] == 0
    b = new_volume(proxy, "pv-b")
    publish(proxy, b, target_of(proxy, b, "pod-b"), ctx={DEFER_PARAM: "false"})
    after_host = scrape_metrics(port)
    assert after_host[counter] == 0  # a host publish is not counted

    a = new_volume(proxy, "pv-a")
    publish(proxy, a, target_of(proxy, a, "pod-a"), ctx={DEFER_PARAM: "true"})
    after = scrape_metrics(port)
    assert after[counter] == 1
    publish_ok = ("crust_rpc_duration_seconds_count", (("code", "OK"), ("component", "proxy-csi"),
                                                       ("method", "/csi.v1.Node/NodePublishVolume")))
    assert after[publish_ok] == 2
    assert after[("crust_proxy_deferred_volumes", (("state", "unclaimed"),))] == 1


# -- crust status -----------------------------------------------------------------------------------------------


def test_crust_status_lists_deferred_volumes_and_handlers(root, handler):
    driver, shim, proxy = start_stack(root, DEFER_POLICY)
    a, b = new_volume(proxy, "pv-a"), new_volume(proxy, "pv-b")
    target_a, target_b = target_of(proxy, a, "pod-a"), target_of(proxy, b, "pod-b")
    publish(proxy, a, target_a, ctx={DEFER_PARAM: "true"})
    publish(proxy, b, target_b, ctx={DEFER_PARAM: "true"})
    handler.register(proxy.runtime_channel())
    handler.claim(proxy.runtime_channel(), target_b, "sb-status", sandbox_pid=os.getpid())
    endpoint = f"unix://{proxy.runtime_socket}"

    def status(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint", endpoint, *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    data = json.loads(status("--json"))
    volumes = {v["target_path"]: v for v in data["volumes"]}
    assert set(volumes) == {str(target_a), str(target_b)}
    va, vb = volumes[str(target_a)], volumes[str(target_b)]
    assert (va["device"], va["fs_type"], va["state"], va["volume_id"]) == (loop_of(driver, a.id), "ext4",
                                                                           "unclaimed", a.id)
    assert "claim" not in va and va["kata_mirror_error"] == ""
    assert (vb["device"], vb["state"]) == (loop_of(driver, b.id), "claimed")
    assert (vb["claim"]["handler"], vb["claim"]["sandbox_id"]) == ("mountns", "sb-status")
    assert int(vb["claim"]["sandbox_pid"]) == os.getpid()
    assert abs(int(vb["claim"]["claimed_at"]) - time.time()) < 120
    [h] = data["handlers"]
    assert (h["name"], h["endpoint"], h["filesystems"]) == ("mountns", handler.endpoint, ["ext4", "xfs"])
    assert 0 <= h["lease_age_seconds"] < 30
    assert h["lease_expired"] is False

    text = status()
    assert "deferred volumes: 2" in text and "handlers: 1" in text
    line_a = next(line for line in text.splitlines() if line.endswith(str(target_a)))
    line_b = next(line for line in text.splitlines() if line.endswith(str(target_b)))
    assert line_a.split()[:3] == ["unclaimed", "ext4", loop_of(driver, a.id)]
    assert line_b.split()[:4] == ["claimed", "ext4", loop_of(driver, b.id), "mountns/sb-status"]
    handler_line = next(line for line in text.splitlines() if line.strip().startswith("mountns "))
    assert "lease fresh" in handler_line and handler.endpoint in handler_line

    # Unreachable proxy: a message and exit status 1.
    proxy.stop()
    done = subprocess.run([sys.executable, "-m", "crust", "status", "--runtime-endpoint", endpoint],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot reach the proxy" in done.stderr
