"""/proc/self/mountinfo as crust reads it (crust.sys.mount)."""

from __future__ import annotations

from crust.sys import mount as sysmount

MOUNTINFO = "\n".join([
    r"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro",
    r"36 35 98:0 /mnt1 /mnt/with\040space rw,noatime master:1 propagate_from:2 - ext3 /dev/root rw,errors=continue",
    r"40 22 7:3 / /var/lib/k/a\040b\011c\134d rw,relatime - xfs /dev/loop3 rw,attr2,inode64",
    r"41 22 0:6 /loop3 /tmp/t/block ro,nosuid shared:7 - devtmpfs devtmpfs rw,size=100k",
    r"50 22 0:45 / /srv/x\040-\040y rw - tmpfs my\040tmpfs rw",
    "",
    "garbage line",
])


def test_parse_mountinfo():
    entries = sysmount.parse_mountinfo(MOUNTINFO)
    assert [e.mount_id for e in entries] == [22, 36, 40, 41, 50]
    root, spaced, loop, block, dashed = entries
    assert (root.major, root.minor, root.root, root.mount_point) == (8, 1, "/", "/")
    assert root.fs_type == "ext4" and root.source == "/dev/sda1"
    assert root.options == ("rw", "relatime") and root.super_options == ("rw", "errors=remount-ro")
    # Two optional fields before the separator.
    assert spaced.mount_point == "/mnt/with space"
    assert spaced.root == "/mnt1"
    assert (spaced.major, spaced.minor) == (98, 0)
    assert spaced.options == ("rw", "noatime")
    assert spaced.fs_type == "ext3" and spaced.source == "/dev/root"
    assert spaced.super_options == ("rw", "errors=continue")
    # No optional field at all; tab and backslash escapes.
    assert loop.mount_point == "/var/lib/k/a b\tc\\d"
    assert (loop.major, loop.minor, loop.fs_type, loop.source) == (7, 3, "xfs", "/dev/loop3")
    assert not loop.readonly
    assert block.readonly and block.root == "/loop3" and block.fs_type == "devtmpfs"
    # An escaped " - " in a mount point is not the separator.
    assert dashed.mount_point == "/srv/x - y"
    assert dashed.fs_type == "tmpfs" and dashed.source == "my tmpfs"
