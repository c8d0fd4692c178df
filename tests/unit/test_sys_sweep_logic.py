"""A release under a directory (crust.sys.sweep) that meets a mount which
will not go: an error naming it and umount's words, never a silent return
that lets the caller remove the directory through the mount."""

from __future__ import annotations

import subprocess

import pytest

from crust.sys import sweep
from crust.sys.mount import MountEntry


def test_a_mount_that_will_not_unmount_is_an_error_naming_it_and_umounts_words(monkeypatch, tmp_path):
    point = str(tmp_path / "volume")
    entry = MountEntry(mount_id=1, major=8, minor=1, root="/", mount_point=point, options=("rw",),
                       fs_type="ext4", source="/dev/sda1", super_options=("rw",))
    tried = []

    def refused(argv, **kw):
        tried.append(argv)
        return subprocess.CompletedProcess(argv, 32, stdout="", stderr=f"umount: {point}: target is busy.")

    monkeypatch.setattr(sweep.loop, "attached", lambda: {})
    monkeypatch.setattr(sweep.mount, "mounts", lambda: [entry])
    monkeypatch.setattr(sweep.subprocess, "run", refused)
    with pytest.raises(sweep.StillMounted) as failed:
        sweep.release_under(tmp_path)
    assert point in str(failed.value) and "target is busy" in str(failed.value), failed.value
    assert len(tried) == 1, "a round that released nothing is not tried again"
