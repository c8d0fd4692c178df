"""Removal of a VM template's saved state (crust.kata.supply.template)."""

from __future__ import annotations


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
