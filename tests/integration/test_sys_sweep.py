"""What is left of the logic tests that needs root: a release under a
directory, with a tmpfs mounted there and a loop device over a file on it.
The tests that need neither root nor devices are in tests/unit/.
"""

from __future__ import annotations

import os


def test_release_under_detaches_a_loop_device_over_a_file_system_it_unmounts(tmp_path):
    """A loop device whose file lives on a file system mounted under the
    root is detached too: after the unmount sysfs would name its file from
    that file system's own root, outside the root."""
    import subprocess

    from crust.sys import loop as sysloop
    from crust.sys.sweep import release_under

    data = tmp_path / "data"
    data.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(data)], check=True)
    device = None
    try:
        backing = data / "pools" / "vol.img"
        # The device over this file, by either of the names sysfs gives it
        # (after the unmount, from the tmpfs's own root): another test may
        # attach the same /dev/loopN once it is free.
        ours = (str(backing), "/pools/vol.img")
        backing.parent.mkdir(parents=True)
        with open(backing, "wb") as f:
            f.truncate(4 << 20)
        device = subprocess.run(["losetup", "-f", "--show", str(backing)], check=True, capture_output=True,
                                text=True).stdout.strip()
        released = release_under(tmp_path)
        assert device in released and str(data) in released
        assert sysloop.attached().get(device) not in ours, "the device went with its file system"
        assert not os.path.ismount(data)
    finally:
        if device is not None and sysloop.attached().get(device) in ours:
            subprocess.run(["losetup", "-d", device], capture_output=True)
        if os.path.ismount(data):
            subprocess.run(["umount", "-l", str(data)], capture_output=True)
