"""What a booted guest has before its agent starts: a random generator
seeded as the kernel boots (the guest's CPU offers RDRAND under tcg, the
host's CPU under KVM), so no reader of /dev/urandom (the agent's
interpreter, a container's first process) waits for the kernel to gather
entropy. And a boot that ends before the agent answers: the start fails
at once, saying QEMU exited and quoting the guest's last words."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import pytest

from crust.kata.vmm.qemu import Vm, VmError
from tests.harness.guest_vm import guest, guest_config

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


def test_a_guest_whose_kernel_panics_in_its_boot_fails_the_start_with_qemus_exit_and_the_panic(root):
    """The kernel finds no init (init= names none; the VM reboots on a
    panic, and QEMU, -no-reboot, exits): the start raises at once, well
    within its wait, naming QEMU's exit and the boot and quoting the
    panic's message from the console; no QEMU is left."""
    config = guest_config()
    config = dataclasses.replace(config, cmdline=config.cmdline + " rdinit=/crust-none init=/crust-none")
    vm = Vm("guest-panics", root.path / "vm", config)
    wait = 600.0
    started = time.monotonic()
    with pytest.raises(VmError) as failed:
        asyncio.run(vm.start(ready_timeout=wait))
    took = time.monotonic() - started
    message = str(failed.value)
    assert "QEMU exited" in message and "during boot" in message, message
    assert "Kernel panic - not syncing" in message, message
    assert took < wait / 2, (took, message)
    assert not vm.alive()
