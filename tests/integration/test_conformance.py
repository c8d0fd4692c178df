"""The upstream conformance suite and the upstream CSI sidecars, on every run.

- csi-sanity (kubernetes-csi/csi-test), in mount and block access, against
  `crust driver`, `crust shim` in front of it, the whole `crust proxy` ->
  shim -> driver chain, and the shim in front of the reference driver
  (hostpathplugin, a driver crust did not write): every run ends with 0
  failures and exactly the pass, pending and skip counts docs/conformance.md
  states, so a spec that stops running is seen as surely as one that fails;
  and what the run made (mounts, loop devices) is gone once csi-sanity has
  cleaned up through the plugin, before any forced cleanup.
- the upstream node-driver-registrar in front of `crust proxy`: kubelet's
  plugin watcher (crust.kubelet.csi) registers the driver through it, at
  the proxy's socket, and the registrar's /healthz answers.
- the upstream livenessprobe in front of `crust proxy`, as the DaemonSet
  runs it: /healthz is 200 while the chain answers Probe, 500 once the
  driver behind it is gone.

None of these programs is part of crust: each is found on PATH or by its
variable (tests/harness/upstream.py: CSI_SANITY, HOSTPATHPLUGIN,
NODE_DRIVER_REGISTRAR, LIVENESSPROBE); a test whose program is absent is
skipped, naming it, in CI too.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from crust.api import csi_pb2
from crust.kubelet import Kubelet
from crust.sys import loop as sysloop
from crust.sys import mount as sysmount
from tests.harness import upstream
from tests.harness.csi_sanity import (MUTABLE_YAML, TARGETS, failed_specs, sanity_argv, skipped_specs, start_target,
                              stated_counts, summary_counts, volume_size)
from tests.harness.daemons import stop_child
from tests.harness.upstream import CSI_SANITY, HOSTPATHPLUGIN, LIVENESSPROBE, NODE_DRIVER_REGISTRAR

DRIVER = "loop.csi.crust.dev"
RUNS = [(target, access) for target in ("driver", "shim", "proxy", "shim-hostpath") for access in ("mount", "block")]
# One suite takes 2 to 6 s here; a wedged daemon must not hold CI for long.
SANITY_TIMEOUT = 90



@functools.cache
def stated():
    return stated_counts()


def left_below(root) -> tuple[list[str], list[str]]:
    """Mount points below root and loop devices over a file below it."""
    prefix = str(root.path.resolve()) + "/"
    mounts = [m.mount_point for m in sysmount.mounts() if (m.mount_point + "/").startswith(prefix)]
    loops = [dev for dev, backing in sysloop.attached().items() if backing.startswith(prefix)]
    return mounts, loops


def log_tails(root) -> str:
    return "\n".join(f"--- {log.name} ---\n{log.read_text(errors='replace')[-1500:]}"
                     for log in sorted(root.path.glob("*.sock.log")))


def test_the_doc_states_counts_for_exactly_these_runs():
    assert sorted(stated()) == sorted(RUNS)


@upstream.suite("csi-sanity", CSI_SANITY, HOSTPATHPLUGIN)
@pytest.mark.parametrize(("target", "access"), RUNS, ids=[f"{t}-{a}" for t, a in RUNS])
def test_csi_sanity(request, root, target, access):
    expected = stated()[(target, access)]
    chain = start_target(root, target, hostpath=upstream.path(HOSTPATHPLUGIN))
    kube = root.path / "kubelet"
    kube.mkdir(exist_ok=True)
    mutable = root.path / "mutable.yaml"
    mutable.write_text(MUTABLE_YAML)
    junit = root.path / "junit.xml"
    argv = sanity_argv(upstream.path(CSI_SANITY), chain[-1].socket, kube, mutable, access, volume_size(target),
                       extra=(f"--ginkgo.junit-report={junit}",))
    what = f"csi-sanity against {TARGETS[target]}, {access} access"
    try:
        run = subprocess.run(argv, capture_output=True, text=True, cwd=root.path, timeout=SANITY_TIMEOUT)
    except subprocess.TimeoutExpired as exc:  # csi-sanity was killed
        pytest.fail(f"{what} ran past {SANITY_TIMEOUT} s:\n{(exc.stdout or b'')[-3000:]!r}\n{log_tails(root)}",
                    pytrace=False)
    # The report is on stdout (stderr holds the suite's own klog lines).
    counts = summary_counts(run.stdout)
    if counts is not None:
        upstream.record(request.node, "csi-sanity", f"{target} {access}", counts.get("passed", 0),
                        counts.get("failed", 0), counts.get("skipped", 0))
    if counts is None:
        pytest.fail(f"{what} printed no summary (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-2000:]}",
                    pytrace=False)
    if counts.get("failed", 0) or run.returncode != 0:
        pytest.fail(f"{what}: {counts.get('failed', 0)} failed (exit {run.returncode}):\n  "
                    + "\n  ".join(failed_specs(run.stdout)) + f"\n{run.stdout[-3000:]}\n{log_tails(root)}",
                    pytrace=False)
    got = {k: counts.get(k, 0) for k in expected}
    if got != expected:
        pytest.fail(f"{what}: {got}, but docs/conformance.md states {expected}: a spec stopped running, or a new "
                    f"one runs (change the doc's table only if that is meant); skipped: "
                    f"{skipped_specs(junit) or 'none'}", pytrace=False)
    # csi-sanity deleted every volume it made through the plugin: nothing it
    # mounted or attached is left (a detach may complete a moment later,
    # while udev still holds the device).
    deadline = time.monotonic() + 10
    while any(left := left_below(root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == ([], []), f"{what}: left behind mounts {left[0]} and loop devices {left[1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthz(port: int) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP proxy
    with opener.open(f"http://127.0.0.1:{port}/healthz", timeout=5) as response:
        return response.status, response.read()


@upstream.suite("node-driver-registrar", NODE_DRIVER_REGISTRAR)
def test_node_driver_registrar_registers_the_proxy_with_kubelet(root):
    """The registrar, not the proxy, serves kubelet's plugin registration
    (no --kubelet-registration-dir): kubelet reaches the driver at the
    proxy's socket through it."""
    driver, shim, proxy = root.stack()
    registry = proxy.kubelet_root / "plugins_registry"
    registry.mkdir()
    port = free_port()
    log = root.path / "registrar.log"
    registrar = subprocess.Popen(
        [str(upstream.path(NODE_DRIVER_REGISTRAR)), f"--csi-address={proxy.socket}",
         f"--kubelet-registration-path={proxy.socket}", f"--plugin-registration-path={registry}",
         f"--http-endpoint=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    try:
        reg_socket = registry / f"{DRIVER}-reg.sock"
        deadline = time.monotonic() + 15
        while not reg_socket.is_socket():
            assert registrar.poll() is None, f"the registrar exited {registrar.returncode}: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"no {reg_socket.name} from the registrar: {log.read_text()[-2000:]}"
            time.sleep(0.05)

        kubelet = Kubelet(proxy.kubelet_root, driver.node_id)
        assert kubelet.register() == DRIVER
        assert kubelet.endpoint == str(proxy.socket)
        assert kubelet.log.names() == ["NodeGetInfo"]  # answered through the proxy, shim and driver
        assert kubelet.node("NodeGetInfo", csi_pb2.NodeGetInfoRequest()).node_id == driver.node_id
        assert healthz(port) == (200, b"ok")
        time.sleep(0.2)
        assert registrar.poll() is None, f"kubelet's verdict stopped the registrar: {log.read_text()[-2000:]}"
    finally:
        stop_child(registrar, 15)


def healthz_status(port: int) -> tuple[int, bytes]:
    """/healthz's status and body, a failure's included."""
    try:
        return healthz(port)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@upstream.suite("livenessprobe", LIVENESSPROBE)
def test_livenessprobe_sees_the_chain_healthy_then_not_once_its_driver_is_gone(root):
    """The DaemonSet's livenessprobe asks Probe at the proxy's socket: the
    answer comes through the shim from the driver, so a driver that is gone
    makes the node's /healthz fail (kubelet restarts the container), while
    the proxy itself still listens."""
    driver, shim, proxy = root.stack()
    port = free_port()
    log = root.path / "livenessprobe.log"
    probe = subprocess.Popen(
        [str(upstream.path(LIVENESSPROBE)), f"--csi-address={proxy.socket}", f"--http-endpoint=127.0.0.1:{port}",
         "--probe-timeout=3s"], stdout=subprocess.DEVNULL, stderr=open(log, "ab"))
    try:
        deadline = time.monotonic() + 15
        while True:
            assert probe.poll() is None, f"livenessprobe exited {probe.returncode}: {log.read_text()[-2000:]}"
            try:
                status = healthz_status(port)
                break
            except OSError:  # not listening yet
                assert time.monotonic() < deadline, f"livenessprobe never listened: {log.read_text()[-2000:]}"
                time.sleep(0.05)
        assert status == (200, b"ok"), log.read_text()[-2000:]
        driver.stop()
        code, body = healthz_status(port)
        assert code == 500, (code, body, log.read_text()[-2000:])
        assert proxy.proc.poll() is None, "the proxy went down with its driver"
    finally:
        stop_child(probe, 15)
