"""Fifty microVM pod lives one after another through CRI, beside a pod that
runs all along, leave the node as they found it and grow neither the
handler nor the node's shim (tests/harness/churn.py
says what a life is; bench/runtime/pod_churn.py runs the long series)."""

from __future__ import annotations

import pytest

from tests.harness import churn
from tests.harness.cri import cri_microvm_node
from tests.harness.template_log import wait_for_template

pytestmark = pytest.mark.slow

LIVES = 50
EARLY = range(5, 15)   # the lives the last ones are held against (the first few fill caches)


def test_fifty_pod_lives_leave_nothing_and_grow_nothing(root):
    with cri_microvm_node(root, pod_network=True, handler_extra=("--vm-template",)) as node:
        wait_for_template(node.env.handler)
        pv = node.pv("pv-churn", "ext4", size=64 * 1024**2)
        lives = churn.Lives(node, pv, node.image.name)
        lived = [lives.live(n) for n in range(LIVES)]
        assert {life.kind for life in lived} == {"plain", "restarted", "killed"}
        assert lives.left_once_settled() == {}
        lives.end_anchor()
        assert lives.left_once_settled() == {}
        for field in ("handler_rss_kib", "handler_fds", "shim_rss_kib", "shim_fds"):
            early, last = churn.growth(lived, EARLY, field)
            assert last <= early * churn.GROWTH_ALLOWED, \
                f"{field}: {early} in lives {EARLY.start}-{EARLY.stop - 1}, {last} in the last ones; each life's: " \
                f"{[getattr(x, field) for x in lived]}"
