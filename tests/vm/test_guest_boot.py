"""What a booted guest has before its agent starts: a random generator
seeded as the kernel boots (the guest's CPU offers RDRAND under tcg, the
host's CPU under KVM), so no reader of /dev/urandom (the agent's
interpreter, a container's first process) waits for the kernel to gather
entropy."""

from __future__ import annotations

import re

from tests.harness.guest_vm import guest

CRNG_DONE = re.compile(r"^\[\s*(\d+\.\d+)\] random: crng init done$", re.M)
INIT_RUN = re.compile(r"^\[\s*(\d+\.\d+)\] Run /init as init process$", re.M)


def test_the_guests_random_generator_is_ready_before_its_init_runs(root):
    """The kernel's log: the generator's `crng init done` comes before
    /init runs; the CPU says rdrand; reading /dev/urandom's first bytes
    waits for nothing."""

    async def check(g):
        return await g.sh("dmesg; grep -m1 -o -w rdrand /proc/cpuinfo; head -c 16 /dev/urandom | wc -c")

    code, out = guest(root, check)
    assert code == 0, out
    done, init = CRNG_DONE.search(out), INIT_RUN.search(out)
    assert init is not None, out
    assert done is not None and float(done.group(1)) < float(init.group(1)), out
    assert out.split()[-2:] == ["rdrand", "16"], out
