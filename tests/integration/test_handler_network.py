"""A pod sandbox's network namespace under `crust handler`.

Real driver -> shim -> proxy processes and a real handler
(tests.harness.handler_env). A sandbox gets a network namespace of its own, named
in /run/netns, with only the loopback interface, up; the sandbox's process
is in it; deleting the sandbox removes it. After the handler was killed,
the restarted handler removes the namespaces of its sandboxes that died
meanwhile and the orphans it never recorded, and leaves a namespace that is
not its own.
"""

from __future__ import annotations

import os
import signal
import subprocess

from pyroute2.netns import listnetns

from crust.sys import netns
from tests.harness.handler_env import env, kill_container_processes, make_env, short_lease  # noqa: F401 - fixtures
from tests.harness.daemons import wait_until


def test_a_sandbox_has_its_own_network_with_only_loopback(env):
    v = env.volume("pv-net")
    bundle = env.bundle("net", "cat /proc/net/dev && exec sleep 600", [("/data", str(v.target))])
    info = env.run_ok(bundle, "sb-net")
    name = netns.name_for(env.handler.state_dir / "run" / "sb-net")
    assert name in listnetns()
    assert netns.interfaces(name) == {"lo": True}, "only the loopback, and it is up"
    # The pod's process is in that namespace and sees only lo.
    named = os.stat(f"/run/netns/{name}")
    process_ns = os.stat(f"/proc/{info['process_pid']}/ns/net")
    assert (process_ns.st_dev, process_ns.st_ino) == (named.st_dev, named.st_ino)
    assert os.readlink(f"/proc/{info['process_pid']}/ns/net") != os.readlink("/proc/self/ns/net")
    seen = wait_until(lambda: "lo:" in env.process_log("sb-net") and env.process_log("sb-net"),
                      what="the process's /proc/net/dev")
    assert [line.split(":")[0].strip() for line in seen.splitlines() if ":" in line] == ["lo"]
    env.delete("sb-net")
    assert name not in listnetns(), "the sandbox's network namespace outlived it"
    env.unpublish(v)


def test_network_namespaces_are_reconciled_after_the_handler_was_killed(short_lease):
    env = short_lease
    v = env.volume("pv-netgone")
    info = env.run_ok(env.bundle("netgone", "exec sleep 600", [("/data", str(v.target))]), "sb-netgone")
    name = netns.name_for(env.handler.state_dir / "run" / "sb-netgone")
    # A namespace of this handler whose sandbox was never recorded (killed
    # between making it and recording the sandbox).
    stray = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"])
    try:
        wait_until(lambda: os.readlink(f"/proc/{stray.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
                   what="the stray namespace")
        orphan = netns.prefix_for(env.handler.state_dir / "run") + "orphan"
        netns.attach(orphan, stray.pid)
    finally:
        stray.kill()
        stray.wait()
    foreign = "crust-00000000-notours"
    stray = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"])
    try:
        wait_until(lambda: os.readlink(f"/proc/{stray.pid}/ns/net") != os.readlink("/proc/self/ns/net"),
                   what="the foreign namespace")
        netns.attach(foreign, stray.pid)
    finally:
        stray.kill()
        stray.wait()
    try:
        assert {name, orphan, foreign} <= set(listnetns())
        env.kill_handler_until_expired()
        # The sandbox dies while its handler is down.
        os.kill(info["pid"], signal.SIGKILL)
        kill_container_processes(env.path / "bundles")
        env.restart_handler()
        wait_until(lambda: name not in listnetns() and orphan not in listnetns(), timeout=15,
                   what="the dead sandbox's and the orphan's namespaces to be removed")
        assert foreign in listnetns(), "the handler removed a namespace that is not its own"
    finally:
        netns.remove(foreign)
    env.unpublish(v)
