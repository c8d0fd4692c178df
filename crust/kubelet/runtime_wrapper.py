"""An OCI runtime wrapper for a private CRI-O on our machines: it adjusts
what CRI-O asks of a container that this kind of machine cannot give, in
the bundle's config.json, before the real runtime runs. Each adjustment
stands in for something a real node has; containerd has a setting for
each (crust.kubelet.containerd), CRI-O has none.

- The OOM score floor (--oom-floor). CRI-O asks for -998 for a pod's infra
  container. Lowering an OOM score below the caller's floor needs
  CAP_SYS_RESOURCE, which a real node's runtime holds and this machine's
  capability bounding set lacks: runc's init fails ("failed to update
  /proc/self/oom_score_adj: Permission denied"). process.oomScoreAdj is
  raised to the wrapper's own current value, which the runtime's init may
  always keep (containerd: restrict_oom_score_adj).
- Huge page limits without a hugetlb cgroup (--no-hugepage-limits).
  Kubelet gives every container a zero limit for each huge page size of
  the machine. Here the kernel has the hugetlb controller, bound to the
  cgroup2 hierarchy of a hybrid layout, and no cgroup v1 hierarchy of it:
  CRI-O sees the controller (/proc/cgroups) and passes the limits on, and
  runc's cgroup v1 manager fails ("cannot set hugetlb limit: container
  could not join or create cgroup"). linux.resources.hugepageLimits are
  dropped (containerd: tolerate_missing_hugetlb_controller).

Only `create` is touched; every other call goes straight to the runtime.
It runs as `python -I runtime_wrapper.py [FLAGS] REAL_RUNTIME ARGS...`
and reads runc's command line as crust-runc does (crust.oci_runtime.main,
which imports little); write_wrapper() writes the executable a runtime
handler names.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

from crust.oci_runtime.main import CREATE_VALUE_FLAGS, command_options, split_command_line

OOM_FLOOR = "--oom-floor"
NO_HUGEPAGE_LIMITS = "--no-hugepage-limits"
MOUNTINFO = Path("/proc/self/mountinfo")


def bundle_of_create(args: list[str]) -> Path | None:
    """The bundle of a `create` call (runc's command line), None for any
    other call; without --bundle the runtime takes its working directory."""
    _flags, command, rest = split_command_line(args)
    if command != "create":
        return None
    options, _container_id = command_options(rest, CREATE_VALUE_FLAGS)
    return Path(options.get("--bundle") or options.get("-b") or Path.cwd())


def hugetlb_cgroup_mounted(mountinfo: Path = MOUNTINFO) -> bool:
    """Whether runc can set huge page limits here: a cgroup v1 hierarchy
    with the hugetlb controller, or a cgroup2-only layout (then the
    controller's presence is cgroup2's business, not this wrapper's)."""
    for line in mountinfo.read_text().splitlines():
        fields = line.split(" - ", 1)
        if len(fields) != 2:
            continue
        mount_point = fields[0].split()[4]
        fstype, _, options = (fields[1].split() + ["", "", ""])[:3]
        if fstype == "cgroup" and "hugetlb" in options.split(","):
            return True
        if fstype == "cgroup2" and mount_point == "/sys/fs/cgroup":
            return True
    return False


def own_oom_score_adj() -> int:
    return int(Path("/proc/self/oom_score_adj").read_text())


def adjust(spec: dict, oom_floor: int | None, drop_hugepage_limits: bool) -> bool:
    """The adjustments, in place; whether anything changed."""
    changed = False
    process = spec.get("process") or {}
    wanted = process.get("oomScoreAdj")
    if oom_floor is not None and wanted is not None and wanted < oom_floor:
        process["oomScoreAdj"] = oom_floor
        changed = True
    resources = (spec.get("linux") or {}).get("resources") or {}
    if drop_hugepage_limits and resources.get("hugepageLimits"):
        del resources["hugepageLimits"]
        changed = True
    return changed


def adjust_bundle(bundle: Path, oom_floor: int | None, drop_hugepage_limits: bool) -> bool:
    """adjust() on the bundle's config.json, rewritten whole (a temporary
    file renamed over it, its mode kept) only when something changed."""
    path = bundle / "config.json"
    spec = json.loads(path.read_text())
    if not adjust(spec, oom_floor, drop_hugepage_limits):
        return False
    handle, temporary = tempfile.mkstemp(dir=bundle, prefix=".config.json.")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(spec, out)
        os.chmod(temporary, path.stat().st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


def main(argv: list[str]) -> None:
    flags = {OOM_FLOOR: False, NO_HUGEPAGE_LIMITS: False}
    args = argv[1:]
    while args and args[0] in flags:
        flags[args.pop(0)] = True
    if not args:
        sys.exit(f"usage: runtime_wrapper.py [{OOM_FLOOR}] [{NO_HUGEPAGE_LIMITS}] REAL_RUNTIME [ARGS...]")
    runtime, args = args[0], args[1:]
    bundle = bundle_of_create(args)
    if bundle is not None:
        adjust_bundle(bundle, own_oom_score_adj() if flags[OOM_FLOOR] else None, flags[NO_HUGEPAGE_LIMITS])
    os.execv(runtime, [runtime, *args])


def write_wrapper(path: Path, runtime: str, oom_floor: bool, drop_hugepage_limits: bool,
                  python: str = sys.executable) -> Path:
    """An executable at path that runs `runtime` through this wrapper."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = [flag for flag, on in ((OOM_FLOOR, oom_floor), (NO_HUGEPAGE_LIMITS, drop_hugepage_limits)) if on]
    command = " ".join(shlex.quote(part) for part in
                       (python, "-I", str(Path(__file__).resolve()), *flags, runtime))
    path.write_text(f"#!/bin/sh\nexec {command} \"$@\"\n")
    path.chmod(0o755)
    return path


if __name__ == "__main__":
    main(sys.argv)
