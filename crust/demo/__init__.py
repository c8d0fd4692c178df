"""`crust demo`: a deferred volume, end to end, on the embedded defaults.

Runs `crust node` (driver, shim, proxy and a runtime handler, from one
config file) in a temporary root and plays kubelet with crust.kubelet:
kubelet finds the driver through the proxy's registration socket, and uses
its paths, call order and retries. The story: create a volume, stage it,
publish it for a pod with an fsGroup (deferred by the proxy's policy from a
StorageClass parameter), run the pod sandbox whose process writes data into
the volume, stats and expansion answered from inside the sandbox, a kubelet
restart (its volumes reconstructed and published again, nothing changed),
stop the sandbox, unpublish, publish again WITHOUT deferral and read the
data back on the host. Every step checks what it claims (mounts in
/proc/self/mountinfo, files on disk, sizes, groups); the host's mount table
is watched during the sandbox's life. Whatever happens, including Ctrl-C,
everything under the root is released.

Where each variant is:

- run_demo() here: the entry (`crust demo`), its report (text or --json)
  and the release of everything under the root;
- csi.py: the story every variant plays, over CSI, with the default pod: a
  sandbox of the mount-namespace handler run with `crust sandbox`;
- cri.py: --cri, the pod started by a private containerd or CRI-O
  (crio.py) through CRI;
- microvm.py: --runtime kata, what the microVM handler changes (alone or
  with --cri);
- node.py: `crust node` as a child process; pod.py: what the pod's process
  does in the volume; steps.py: each step timed, checked and printed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from crust.demo.csi import Demo
from crust.demo.steps import StepFailed, Timeline
from crust.sys import netns
from crust.sys.sweep import StillMounted, release_under


def run_demo(fs_type: str = "xfs", runtime: str = "mountns", as_json: bool = False, keep: bool = False,
             cri: str = "") -> int:
    if os.geteuid() != 0:
        print("crust demo: needs root (loop devices, mounts, namespaces)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="crust-demo-"))
    timeline = Timeline(as_json)
    demo = Demo(root, fs_type, runtime, timeline, cri=cri)
    ok = False
    if not as_json:
        where = (f"a real pod started by {demo.cri_name} through CRI (RuntimeClass {demo.runtime_class})" if cri
                 else f"a {runtime} sandbox")
        print(f"crust demo: a deferred {fs_type} volume, mounted only inside {where}, in {root}\n")
    try:
        demo.play()
        ok = all(s.ok for s in timeline.steps) and demo.data_verified and demo.stats_match_df \
            and not demo.host_mounted_during_sandbox
    except StepFailed:
        ok = False
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
    finally:
        if not ok:
            demo.abort()
        cri_version = demo.cri_version
        try:
            demo.close_cri()
        except StillMounted:
            pass   # the release under the root below meets the same mount, says so and keeps the root
        _kill_sandboxes(root)
        netns.sweep(demo.handler_state / "run", keep=set())
        try:
            leftovers = release_under(root)
        except StillMounted as exc:
            # Never removed through a mount: the file system there is not the demo's to delete.
            print(f"demo: {exc}; {root} is left in place", file=sys.stderr)
            leftovers, keep, ok = [], True, False
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps({
            "steps": [{"name": s.name, "ms": s.ms, "ok": s.ok, "detail": s.detail} for s in timeline.steps],
            "root": str(root),
            "runtime": runtime,
            "fs_type": fs_type,
            "host_mounted_during_sandbox": demo.host_mounted_during_sandbox,
            "data_verified": demo.data_verified,
            "size_before": demo.size_before,
            "size_after": demo.size_after,
            "guest_df": demo.guest_df,
            "stats": demo.stats_seen,
            "stats_match_df": demo.stats_match_df,
            "leftovers_cleaned": leftovers,
            "ok": ok,
            **({"cri": {"runtime": cri_version, "runtime_handler": demo.runtime_handler,
                        "runtime_class": demo.runtime_class,
                        "pod_sandbox_id": demo.pod_sandbox_id,
                        "container_exit_code": demo.container_exit_code}} if cri else {}),
        }, indent=1))
    else:
        total = sum(s.ms for s in timeline.steps)
        print(f"\n{'every step held' if ok else 'FAILED'}: {len(timeline.steps)} steps in {total / 1e3:.2f} s; "
              f"host mounted the file system during the sandbox: {'YES' if demo.host_mounted_during_sandbox else 'no'}; "
              f"data verified: {'yes' if demo.data_verified else 'NO'}"
              + (f"; cleaned up after a failure: {', '.join(leftovers)}" if leftovers else ""))
    return 0 if ok else 1


def _kill_sandboxes(root: Path) -> None:
    """Sandboxes of this demo that outlived their handler: mount-namespace
    holders with mounts under the demo's handler state, and QEMU processes
    whose sockets live under the root."""
    own = str(root) + "/state/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv[:2] == [b"sleep", b"infinity"]:
                mine = any(line.split(" ")[4].startswith(own) for line in (entry / "mountinfo").read_text().splitlines()
                           if len(line.split(" ")) > 4)
            else:
                mine = argv[0].endswith(b"qemu-system-x86_64") and own.encode() in b" ".join(argv)
            if mine:
                os.kill(int(entry.name), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
