"""crun in the microVM's guest, one VM from the handler's image outside any
handler (tests/harness/guest_vm.py): crun started once per call from a binary
nobody can write (CVE-2019-5736's guard without crun's copy of itself),
and the agent's Warm, a container of a pod's shape through crun that a
pooled VM runs while it waits, leaving nothing behind in the guest.
"""

from __future__ import annotations

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from tests.harness.guest_vm import Guest, guest


def test_crun_in_the_guest_starts_once_per_call_from_a_binary_nobody_can_write(root):
    """crun's guard against CVE-2019-5736 (a container rewriting the
    runtime's binary through /proc/self/exe) holds with crun started once:
    its binary is on a read-only mount (the guest root's /sbin, bound from
    the read-only ext4 of its pmem device), so crun runs it as it is instead of copying
    itself into a memfd and re-executing at every call (on a writable
    rootfs it did so twice: three starts per run, exec, state, delete)."""
    async def run(g: Guest):
        code, out = await g.sh("LD_DEBUG=files /sbin/crun --version 2>&1 | grep -c 'initialize program:'")
        assert (code, out.strip()) == (0, "1"), out
        code, out = await g.sh("/sbin/crun --version")
        assert code == 0 and out.startswith("crun version "), out
        # Read-only to everyone in the guest: a write fails, whoever asks.
        code, out = await g.sh("echo overwritten >> /sbin/crun")
        assert code != 0 and "Read-only file system" in out, out
        code, out = await g.sh("awk '$5 == \"/sbin\"' /proc/self/mountinfo")
        fields = out.split()
        assert code == 0 and fields[5].split(",")[0] == "ro" and {"ext4", "/dev/pmem0"} <= set(fields), out
        code, out = await g.sh("head -c 4 /sbin/crun | od -c | head -1")
        assert "E   L   F" in out, out
    guest(root, run)


def test_warm_runs_one_container_through_crun_and_leaves_nothing(root):
    """The agent's Warm, what a pooled VM runs while it waits: crun runs a
    container of a pod's shape from the image's warm spec (the answer only
    once it printed what its spec says), and the guest keeps nothing of it:
    no container in crun's state, no bundle, no cgroup, no mount; again,
    the same. A warm that cannot make its bundle says so, and leaves the
    way clear for the next."""
    leftovers = ("ls /run/crust/crun 2>/dev/null; ls -d /run/crust/warm /sys/fs/cgroup/crust/crust-warm 2>/dev/null;"
                 " grep -e crust-warm -e /run/crust/warm /proc/mounts; true")

    async def run(g):
        client = await g.port()
        assert g.vm.port.has("warm")
        code, before = await g.sh("cat /proc/mounts | wc -l")
        for _ in range(2):
            await client.call("Warm", agent_pb2.WarmRequest(), timeout=120)
            assert await g.sh(leftovers) == (0, "")
        assert await g.sh("cat /proc/mounts | wc -l") == (code, before)
        assert await g.sh(": > /run/crust/warm") == (0, "")
        with pytest.raises(ttrpc.TtrpcError) as refused:
            await client.call("Warm", agent_pb2.WarmRequest(), timeout=120)
        assert refused.value.code == ttrpc.FAILED_PRECONDITION and "/run/crust/warm" in refused.value.message, \
            refused.value
        assert await g.sh("rm /run/crust/warm") == (0, "")
        await client.call("Warm", agent_pb2.WarmRequest(), timeout=120)
        assert await g.sh(leftovers) == (0, "")
    guest(root, run)
