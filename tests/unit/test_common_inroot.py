"""Mount points made inside a root whatever links it holds (crust.common.inroot)."""

from __future__ import annotations

import errno
import os

import pytest


def test_mount_points_are_made_inside_the_root_whatever_links_the_image_holds(tmp_path):
    from crust.common.inroot import make_mount_point

    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "run").mkdir()
    os.symlink("/run/crust", root / "data")            # absolute, dangling: resolved from the root
    os.symlink("../../../outside", root / "run" / "up")   # .. stops at the root
    os.symlink("loop", root / "loop")
    (root / "file").write_text("x")
    make_mount_point(str(root), "/data/out", "dir")
    assert (root / "run" / "crust" / "out").is_dir() and not (tmp_path / "run").exists()
    make_mount_point(str(root), "/run/up/hosts", "file")
    assert (root / "outside" / "hosts").is_file() and list(outside.iterdir()) == []
    make_mount_point(str(root), "/a/b/c", "parents")
    assert (root / "a" / "b").is_dir() and not (root / "a" / "b" / "c").exists()
    make_mount_point(str(root), "/data/out", "dir")   # again: nothing to make
    make_mount_point(str(root), "/", "dir")
    with pytest.raises(OSError) as too_many:
        make_mount_point(str(root), "/loop/x", "dir")
    assert too_many.value.errno == errno.ELOOP
    with pytest.raises(OSError) as not_dir:
        make_mount_point(str(root), "/file/x", "dir")
    assert not_dir.value.errno == errno.ENOTDIR
    with pytest.raises(ValueError):
        make_mount_point(str(root), "/x", "socket")
