"""VMs restored from a saved one (crust.kata.supply.template), outside any handler
(tests/harness/guest_vm.py): a VmTemplate's saved state and RAM, VMs restored from
it that go on from the save, each with the host's clock and a boot_id and
random bytes of its own, taking shares and disks as a booted VM does; and
40 VMs restored in a row on a busy machine, each mounting its share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.common.errors import CrustError
from crust.kata.agent import calls, volume_calls
from crust.kata.vmm import virtiofsd
from crust.kata.vmm.qemu import SharedDir, qemu_pids_under
from tests.harness.guest_vm import Guest
from tests.harness.daemons import MIB
from tests.harness.kata_env import DISK_BUSES


@pytest.mark.parametrize("bus", DISK_BUSES)
def test_vms_restored_from_a_template_go_on_from_the_save_each_with_its_own_clock_and_numbers(root, bus):
    """VmTemplate boots a VM, warms it, saves it (vm.state, and template.json
    naming what it was made from) and stops it; its build directory and QEMU
    go. Each VM restored from the file goes on from the save instead of
    booting (its guest's uptime is past QEMU's age), with the host's wall
    clock to within half a second although the template is 5 s old (without
    `resume` it would be the template's), and with a boot_id and getrandom
    bytes of its own (what any process in the guest draws); it takes a
    share and a disk on its bus as a booted VM does, through its agent's
    port. Its agent's Resume refuses a seed too short to reseed from. A
    second VmTemplate over the kept files uses them; one for another VM
    size makes its own."""
    from crust.common.formats import decode
    from crust.kata.supply.pool import warm_disk
    from crust.kata.vmm.saved_ram import ram_path
    from crust.kata.supply.template import RECORD_FILE, STATE_FILE, TemplateRecord, VmTemplate
    from tests.harness.guest_vm import guest_config

    directory = root.path / "template"
    config = guest_config(bus)

    template = VmTemplate(directory, config)
    state = asyncio.run(_saved_by(template))
    assert template.builds == 1 and state == directory / STATE_FILE
    record = decode(TemplateRecord, (directory / RECORD_FILE).read_bytes())
    # The state holds the devices; the guest's RAM is apart, its pages of
    # zeros left as holes.
    ram = ram_path(state)
    assert record.saved_bytes == state.stat().st_size < 4 * MIB
    assert ram.stat().st_size == config.memory_mib * MIB
    assert 32 * MIB < record.ram_bytes < config.memory_mib * MIB // 2
    assert sorted(p.name for p in directory.iterdir()) == sorted([STATE_FILE, ram.name, RECORD_FILE])
    assert qemu_pids_under(directory) == []
    while time.time() < record.saved_at + 5:
        time.sleep(0.1)

    share = root.path / "share"
    share.mkdir()
    (share / "from-host").write_text("host\n")
    seen = []
    for n in range(2):
        async def run(g, n=n):
            # A restored VM holds the saved pages, not all of its RAM.
            held = os.stat(f"/proc/{g.vm.pid}/fd/{g.vm.ram_fd}").st_blocks * 512
            assert record.ram_bytes <= held < record.ram_bytes + 16 * MIB, (held, record.ram_bytes)
            await g.vm.plug_shared_dir(SharedDir("crust", share))
            shared = await calls.mount_share(await g.port(), "crust")
            started = time.time()
            code, out = await g.sh(f"cat /proc/uptime; python3.11 -S -c 'import os, time; print(time.time_ns()); "
                                   f"print(os.getrandom(32).hex())'; cat /proc/sys/kernel/random/boot_id; "
                                   f"cat {shared}/from-host; echo {n} > {shared}/from-guest-{n}")
            ended = time.time()
            assert code == 0, out
            uptime, clock, numbers, boot_id, from_host = out.splitlines()
            # No boot: /init never started the agent again (it says so on the
            # console when it does), and the guest's clock since boot goes on.
            assert "crust-init: starting the agent" not in g.vm.console_log.read_text(errors="replace")
            assert float(uptime.split()[0]) > record.guest_uptime_s > 1.0, (uptime, record)
            # Read between the request and its answer (seconds apart on a
            # busy machine): the clock Resume set is the host's, but for
            # the time the call took to reach the guest.
            assert started - 0.5 <= int(clock) / 1e9 <= ended + 0.05, (started, int(clock) / 1e9, ended)
            assert from_host == "host"
            assert volume_calls.serves(g.vm.port, bus, "ext4")
            await warm_disk(g.vm, await g.port(), root.path)
            client = await g.port()
            with pytest.raises(ttrpc.TtrpcError) as caught:
                await client.call("Resume", agent_pb2.ResumeRequest(seconds=int(time.time()), seed=b"short"),
                                  timeout=10)
            assert caught.value.code == ttrpc.INVALID_ARGUMENT and caught.value.message.startswith("seed: ")
            return boot_id, numbers
        kept = Guest(root.path / f"restored-{n}", name=f"restored-{n}", disk_bus=bus, saved=state)
        seen.append(asyncio.run(_run_guest(kept, run)))
        assert (share / f"from-guest-{n}").read_text() == f"{n}\n"
    (first_boot, first_numbers), (second_boot, second_numbers) = seen
    assert first_boot != second_boot and first_numbers != second_numbers and len(first_numbers) == 64

    again = VmTemplate(directory, config)
    assert asyncio.run(_saved_by(again)) == state and again.builds == 0
    bigger = VmTemplate(directory, dataclasses.replace(config, memory_mib=320))
    assert asyncio.run(_saved_by(bigger)) == state and bigger.builds == 1
    assert decode(TemplateRecord, (directory / RECORD_FILE).read_bytes()).key != record.key


async def _run_guest(kept: Guest, body):
    async with kept as g:
        return await body(g)


async def _saved_by(template) -> Path:
    """The state file a VmTemplate saved (made now, or kept from before),
    waited for as long as its making takes (at nice 10 on a busy machine,
    minutes): the making's own bounds end it, and the error of one that
    failed, its guest's console in it, fails the test."""
    await template.start()
    try:
        state = await template.built()
        assert template.saved() == state
        return state
    finally:
        await template.stop()


RESTORES_IN_A_ROW = 40


def test_every_vm_restored_in_a_row_on_a_busy_machine_mounts_its_share(root):
    """A pod's VM restored from the template gets its share hot-plugged at
    once, while the guest's virtio-fs driver may still be probing the
    device: the agent's MountShare waits until the driver has registered
    the tag, however long the probe takes. 40 VMs restored one after the
    other, with a process spinning on one of the host's CPUs all along,
    each mount their share and read through it a file the host wrote for
    that VM; each VM is killed after, and neither a QEMU nor a virtiofsd
    is left."""
    from crust.kata.supply.template import VmTemplate
    from tests.harness.guest_vm import guest_config

    config = guest_config()
    state = asyncio.run(_saved_by(VmTemplate(root.path / "template", config)))
    share = root.path / "share"
    share.mkdir()

    async def restore(n: int) -> str | None:
        """None if VM n mounted its share and read its file through it, or why not."""
        (share / "for-guest").write_text(f"{n}\n")
        g = Guest(root.path / f"restored-{n}", name=f"restored-{n}", saved=state, config=config)
        await g.vm.start(saved=state)
        try:
            await g.vm.plug_shared_dir(SharedDir("crust", share))
            try:
                shared = await calls.mount_share(await g.port(), "crust")
            except CrustError as exc:
                _, kernel = await g.sh("dmesg | grep -e virtio -e fuse | tail -4; "
                                       "cat /sys/bus/virtio/drivers/virtiofs/virtio*/status")
                return f"{exc.message}; guest kernel: {kernel.splitlines()}"
            code, out = await g.sh(f"cat {shared}/for-guest")
            return None if (code, out) == (0, f"{n}\n") else f"read {code} {out!r}"
        finally:
            await g.vm.kill()

    spinner = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    failed = {}
    try:
        for n in range(RESTORES_IN_A_ROW):
            if (why := asyncio.run(restore(n))) is not None:
                failed[n] = why
                if len(failed) == 3:
                    break   # each failure waits out the agent's wait for the tag (a minute)
    finally:
        spinner.kill()
        spinner.wait()
    assert failed == {}, f"{len(failed)} restores failed, up to restore {n + 1} of {RESTORES_IN_A_ROW}: {failed}"
    assert qemu_pids_under(root.path) == [] and virtiofsd.pids_under(root.path) == []
