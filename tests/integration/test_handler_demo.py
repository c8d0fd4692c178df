"""`crust demo` end to end, and its clean-up.

The demo runs as a user runs it (`crust demo --fs ... --json`), its
temporary root made under the test's root (TMPDIR) so that what it leaves
behind is exactly identifiable: every step must succeed, and afterwards no
loop device, mount or sandbox holder of that root may be left. The
clean-up's own rule (kill only the holders with the demo's sandbox-private
mounts, not a namespace that merely copied its host mounts) is checked on
namespaces made with unshare.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from crust.sys import mount as sysmount
from tests.harness.handler_env import holders_under, mountinfo_of
from tests.harness.daemons import loops_left, wait_until

PROJECT = Path(__file__).resolve().parents[2]


# -- the demo ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fs", ["xfs", "ext4"])
def test_demo_runs_every_step_and_leaves_nothing(root, fs):
    """`crust demo` as a user runs it; its temporary root is made under the
    test's root (TMPDIR) so what it leaves behind is exactly identifiable."""
    tmp = root.path / "tmp"
    tmp.mkdir()
    before = set(tmp.glob("crust-demo-*"))
    proc = subprocess.Popen([sys.executable, "-m", "crust", "demo", "--fs", fs, "--json"], cwd=PROJECT,
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # The demo's own root, seen while it runs (it exists for seconds).
        seen = wait_until(lambda: set(tmp.glob("crust-demo-*")) - before or proc.poll() is not None,
                          timeout=30, interval=0.01, what="the demo's temporary root")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, (stdout[-3000:], stderr[-3000:])
    result = json.loads(stdout)
    assert isinstance(seen, set) and len(seen) == 1, "the demo did not make its root in TMPDIR"
    (demo_root,) = seen

    assert result["ok"] is True and result["fs_type"] == fs
    assert result["steps"], "no steps reported"
    assert [s["name"] for s in result["steps"] if not s["ok"]] == []
    names = [s["name"] for s in result["steps"]]
    for step in ("start crust node", "kubelet registers the driver", "NodePublishVolume (deferred)",
                 "run pod sandbox (writes data)", "NodeExpandVolume", "kubelet restart", "stop pod sandbox",
                 "NodePublishVolume (on the host)", "stop crust node"):
        assert step in names
    assert result["host_mounted_during_sandbox"] is False
    assert result["data_verified"] is True
    assert result["size_before"] > 0 and result["size_after"] > result["size_before"]
    assert result["leftovers_cleaned"] == []

    # Nothing left: the root is gone, no loop device is backed by a file
    # below it, nothing is mounted below it, no sandbox holder has it.
    assert set(tmp.glob("crust-demo-*")) == before
    assert not demo_root.exists()
    prefix = str(demo_root) + "/"
    assert loops_left(lambda backing: backing.startswith(prefix)) == {}
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(prefix)] == []
    assert holders_under(demo_root / "state", demo_root / "bundle") == []


def test_the_demo_cleanup_kills_only_its_own_sandbox_holders(root):
    """A namespace copied from the host while the demo runs lists the demo's
    host mounts too; only holders with the demo's sandbox-private mounts are
    the demo's to kill."""
    from crust.demo import _kill_sandboxes

    demo_root = root.path / "crust-demo-x"
    on_host = demo_root / "kubelet" / "target"
    private = demo_root / "state" / "handler" / "run" / "pod-1" / "volumes" / "v"
    on_host.mkdir(parents=True)
    private.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "crust-test", str(on_host)], check=True)
    holders = []
    try:
        for _ in range(2):
            holders.append(subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--",
                                             "sleep", "infinity"], start_new_session=True))
        mine = os.readlink("/proc/self/ns/mnt")
        for h in holders:
            wait_until(lambda: os.readlink(f"/proc/{h.pid}/ns/mnt") != mine, what="the namespace")
        foreign, ours = holders
        subprocess.run(["nsenter", f"--target={ours.pid}", "--mount", "--", "mount", "-t", "tmpfs", "-o",
                        "size=4k", "crust-test", str(private)], check=True)
        assert any(e.mount_point == str(on_host) for e in mountinfo_of(foreign.pid))

        _kill_sandboxes(demo_root)
        assert ours.wait(5) == -signal.SIGKILL
        time.sleep(0.2)
        assert foreign.poll() is None, "the demo killed a sandbox that was not its own"
    finally:
        for h in holders:
            h.kill()
            h.wait()
