"""crust.kubelet.runtime_wrapper, the OCI runtime wrapper a private CRI-O
runs its runtimes through on our machines: what it finds in runc's
command line, what it changes in a bundle and when, and how it tells
whether huge page limits can be set here. No runtime is run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from crust.kubelet import runtime_wrapper

HUGEPAGES = [{"pageSize": "2MB", "limit": 0}]


def _bundle(tmp_path, oom_score_adj: int):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    config = bundle / "config.json"
    config.write_text(json.dumps({"process": {"args": ["/pause"], "oomScoreAdj": oom_score_adj},
                                  "linux": {"resources": {"hugepageLimits": HUGEPAGES}}}))
    config.chmod(0o600)
    return bundle, config


def test_only_a_create_names_a_bundle():
    assert runtime_wrapper.bundle_of_create(["--root", "/r", "--log", "/l", "--log-format", "json", "create",
                                             "--bundle", "/b", "--pid-file", "p", "id"]) == Path("/b")
    assert runtime_wrapper.bundle_of_create(["--root=/r", "--systemd-cgroup", "create", "--bundle=/b", "id"]) \
        == Path("/b")
    assert runtime_wrapper.bundle_of_create(["--root", "/r", "start", "id"]) is None
    assert runtime_wrapper.bundle_of_create(["--root", "create", "state", "id"]) is None  # a root named "create"
    assert runtime_wrapper.bundle_of_create(["features"]) is None


def test_a_bundle_is_changed_only_where_it_asks_too_much(tmp_path):
    bundle, config = _bundle(tmp_path, -998)
    assert runtime_wrapper.adjust_bundle(bundle, 0, drop_hugepage_limits=False)
    spec = json.loads(config.read_text())
    assert spec["process"]["oomScoreAdj"] == 0 and spec["linux"]["resources"]["hugepageLimits"] == HUGEPAGES
    assert config.stat().st_mode & 0o777 == 0o600
    assert not runtime_wrapper.adjust_bundle(bundle, -500, drop_hugepage_limits=False)  # already above
    assert runtime_wrapper.adjust_bundle(bundle, None, drop_hugepage_limits=True)
    assert "hugepageLimits" not in json.loads(config.read_text())["linux"]["resources"]
    assert not runtime_wrapper.adjust_bundle(bundle, None, drop_hugepage_limits=True)
    assert sorted(p.name for p in bundle.iterdir()) == ["config.json"]


def test_the_wrapper_adjusts_a_create_then_becomes_the_runtime(tmp_path):
    """The executable write_wrapper() makes, with a runtime standing in for
    runc that prints what it was given and the bundle it sees."""
    bundle, _ = _bundle(tmp_path, -998)
    runtime = tmp_path / "runtime"
    runtime.write_text('#!/bin/sh\necho "$@"\ncat "$3/config.json"\n')
    runtime.chmod(0o755)
    wrapper = runtime_wrapper.write_wrapper(tmp_path / "wrappers" / "runc", str(runtime), oom_floor=True,
                                            drop_hugepage_limits=True)
    out = subprocess.run([str(wrapper), "create", "--bundle", str(bundle), "id"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    said, seen = out.split("\n", 1)
    assert said == f"create --bundle {bundle} id"
    spec = json.loads(seen)
    floor = int(Path("/proc/self/oom_score_adj").read_text())  # the wrapper inherits ours
    assert spec["process"]["oomScoreAdj"] == max(floor, -998) and "hugepageLimits" not in spec["linux"]["resources"]
    assert sys.executable in wrapper.read_text()


def test_huge_page_limits_are_settable_with_a_hugetlb_hierarchy_or_cgroup2_alone(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    v1 = "30 25 0:26 / /sys/fs/cgroup/{0} rw,nosuid shared:9 - cgroup cgroup rw,{0}\n"
    hybrid = "40 25 0:30 / /sys/fs/cgroup/unified rw shared:8 - cgroup2 cgroup2 rw\n"
    mountinfo.write_text(v1.format("memory") + hybrid)
    assert not runtime_wrapper.hugetlb_cgroup_mounted(mountinfo)
    mountinfo.write_text(v1.format("memory") + v1.format("hugetlb") + hybrid)
    assert runtime_wrapper.hugetlb_cgroup_mounted(mountinfo)
    mountinfo.write_text("40 25 0:30 / /sys/fs/cgroup rw shared:8 - cgroup2 cgroup2 rw\n")
    assert runtime_wrapper.hugetlb_cgroup_mounted(mountinfo)
