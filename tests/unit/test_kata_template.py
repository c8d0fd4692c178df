"""A VM template's saved state removed, and built(): the end of a making
of the template as its waiters learn it (crust.kata.supply.template)."""

from __future__ import annotations

import asyncio
import time

import pytest

from crust.kata.vmm.devices import GuestSilent


def test_a_handler_without_a_template_removes_only_what_a_template_left(tmp_path):
    """remove_saved: the saved state, its record, a build's leftovers and
    the directory go; a file that is no template's stays, and with it the
    directory. Nothing there: nothing done."""
    from crust.kata.supply.template import BUILD_DIR, RECORD_FILE, STATE_FILE, remove_saved

    directory = tmp_path / "template"
    assert remove_saved(directory) == [] and not directory.exists()
    (directory / BUILD_DIR).mkdir(parents=True)
    (directory / BUILD_DIR / "console.log").write_text("a build's\n")
    template_files = [STATE_FILE, STATE_FILE + ".ram", RECORD_FILE, STATE_FILE + ".partial",
                      STATE_FILE + ".partial.ram"]
    for name in template_files:
        (directory / name).write_bytes(b"x")
    (directory / "notes.txt").write_text("an operator's\n")
    assert sorted(remove_saved(directory)) == sorted(template_files)
    assert sorted(p.name for p in directory.iterdir()) == ["notes.txt"]
    (directory / "notes.txt").unlink()
    (directory / STATE_FILE).write_bytes(b"x")
    assert remove_saved(directory) == [STATE_FILE] and not directory.exists()


class SilentVm:
    """A template build's VM whose guest's agent never answers, its console
    telling why (a fake of crust.kata.vmm.qemu.Vm: what _build uses of it)."""

    CONSOLE = "Kernel panic - not syncing: IO-APIC + timer doesn't work!"

    def __init__(self, name, workdir, config):
        self.name = name
        self.killed = False
        made.append(self)

    async def start(self, timeout):
        raise GuestSilent(f"vm {self.name}: its guest's agent did not answer on its port within {timeout:.0f} s")

    def console_tail(self, lines=20):
        return self.CONSOLE

    async def kill(self):
        self.killed = True


class BootingVm(SilentVm):
    """One whose boot goes on until it is cancelled."""

    async def start(self, timeout):
        await asyncio.Event().wait()


made: list[SilentVm] = []


@pytest.fixture
def template(tmp_path, monkeypatch):
    """A VmTemplate over tmp_path whose config's key is "k", trying again
    after 10 ms; VmTemplate.Vm is the test's to set."""
    from crust.kata.supply import template as module
    from crust.kata.vmm.config import VmConfig

    async def key(config):
        return "k"

    made.clear()
    monkeypatch.setattr(module, "template_key", key)
    monkeypatch.setattr(module, "RETRY_FIRST", 0.01)
    return module.VmTemplate(tmp_path / "template", VmConfig(kernel=tmp_path / "vmlinuz", initrd=tmp_path / "initrd"))


def test_built_is_a_kept_template_that_fits_without_a_build(template, monkeypatch):
    """A template saved before for the same key: built() returns its state
    file at once, as saved() does from then on; no VM is made."""
    from crust.common.formats import encode
    from crust.kata.supply import template as module
    from crust.kata.vmm.saved_ram import MIB

    monkeypatch.setattr(module, "Vm", SilentVm)
    template.directory.mkdir()
    template.state.write_bytes(b"state")
    with open(template.ram, "wb") as f:
        f.truncate(template.config.memory_mib * MIB)
    template.record_path.write_bytes(encode(module.TemplateRecord(key="k", saved_bytes=5, boot_s=1.0,
                                                                  saved_at=time.time())))

    async def scenario():
        await template.start()
        try:
            return await template.built(), template.saved()
        finally:
            await template.stop()

    assert asyncio.run(scenario()) == (template.state, template.state)
    assert made == [] and template.builds == 0


def test_built_raises_the_error_that_ended_a_build_with_its_guests_console(template, monkeypatch):
    """A build whose guest never answers: built() raises TemplateNotMade
    naming the VM's error and its console's last lines (read before the
    build's directory goes), the VM killed and nothing saved. The keeper
    tries again, and built() then tells how that try ended."""
    from crust.kata.supply import template as module

    monkeypatch.setattr(module, "Vm", SilentVm)

    async def scenario():
        await template.start()
        try:
            with pytest.raises(module.TemplateNotMade) as failed:
                await template.built()
            assert template.saved() is None
            while len(made) < 2:
                await asyncio.sleep(0.005)
            with pytest.raises(module.TemplateNotMade) as again:
                await template.built()
            return failed.value, again.value
        finally:
            await template.stop()

    failed, again = asyncio.run(scenario())
    assert str(failed) == (f"vm {made[0].name}: its guest's agent did not answer on its port within "
                           f"{module.NICE_BOOT_TIMEOUT:.0f} s; console: {SilentVm.CONSOLE}")
    assert failed.console == SilentVm.CONSOLE and isinstance(failed.__cause__, GuestSilent)
    assert again is not failed and any(str(again).startswith(f"vm {vm.name}: ") for vm in made[1:])
    assert all(vm.killed for vm in made)
    assert not (template.directory / module.BUILD_DIR).exists() and not template.state.exists()


def test_a_build_stopped_ends_its_waiters_with_the_stop(template, monkeypatch):
    """stop() while the template's VM boots: a caller waiting in built()
    gets TemplateNotMade saying so, rather than waiting on forever; the
    VM is killed."""
    from crust.kata.supply import template as module

    monkeypatch.setattr(module, "Vm", BootingVm)

    async def scenario():
        await template.start()
        waiter = asyncio.create_task(template.built())
        while not made:
            await asyncio.sleep(0.005)
        await template.stop()
        with pytest.raises(module.TemplateNotMade) as stopped:
            await waiter
        return stopped.value

    assert str(asyncio.run(scenario())) == "the VM template's making was stopped"
    assert [vm.killed for vm in made] == [True]
