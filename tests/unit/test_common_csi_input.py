"""The checks of CSI request fields (crust.common.csi_input): paths, mount
flags and capacity ranges, each refusal of its exact gRPC code.
"""

from __future__ import annotations

import grpc
import pytest

from crust.api import csi_pb2
from crust.common import csi_input
from crust.common.errors import (
    InvalidArgument,
    OutOfRange,
)
from tests.unit.helpers import GIB, MIB, raises_exactly


# -- csi_input.path ----------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("/", "/"),
    ("/var/lib/kubelet/pods/p/volumes/x/mount", "/var/lib/kubelet/pods/p/volumes/x/mount"),
    ("/a/b/", "/a/b"),  # a trailing slash names the same directory
    ("/with space/and-ünïcode", "/with space/and-ünïcode"),
    ("/a/.hidden/..x", "/a/.hidden/..x"),  # dots inside a name are not components
])
def test_path_accepts_normalised_absolute_paths(value, expected):
    assert csi_input.path(value, "target_path") == expected


@pytest.mark.parametrize("value", [
    "relative/path",
    "./x",
    "..",
    "/a/../b",
    "/a/..",
    "/..",
    "/a/./b",
    "/a//b",
    "//a",  # POSIX normpath keeps a leading '//', the check must not
    "//",
    "/a/b//",
])
def test_path_rejects_relative_and_unnormalised(value):
    err = raises_exactly(InvalidArgument, csi_input.path, value, "staging_target_path")
    assert "staging_target_path" in err.message


def test_path_rejects_empty_nul_and_too_long():
    for value in ("", "/a\x00b", "/" + "x" * csi_input.MAX_PATH):
        err = raises_exactly(InvalidArgument, csi_input.path, value, "target_path")
        assert "target_path" in err.message
    # The limit is in bytes (PATH_MAX), not characters.
    wide = "/" + "é" * (csi_input.MAX_PATH // 2 + 10)
    assert len(wide) < csi_input.MAX_PATH < len(wide.encode())
    err = raises_exactly(InvalidArgument, csi_input.path, wide, "target_path")
    assert "target_path" in err.message
    # Right at the limit is fine.
    # (PATH_MAX counts the terminating NUL: 4095 bytes of text, in
    # components of at most NAME_MAX.)
    longest = ("/" + "x" * 255) * 15 + "/" + "x" * 254
    assert len(longest) == csi_input.MAX_PATH - 1
    assert csi_input.path(longest, "p") == longest
    err = raises_exactly(InvalidArgument, csi_input.path, longest + "x", "p")
    assert "4096 bytes" in err.message
    err = raises_exactly(InvalidArgument, csi_input.path, "/a/" + "x" * 256, "p")
    assert "component of 256 bytes" in err.message


# -- csi_input.mount_flags -------------------------------------------------------------


def test_mount_flags_accepts_single_options():
    flags = ["noatime", "discard", "context=system_u:object_r:container_file_t:s0", "uid=1000"]
    assert csi_input.mount_flags(flags, "volume_capability.mount.mount_flags") == flags


@pytest.mark.parametrize("flag", ["ro,exec", "a,", ",", "x\ny", "x\ty", "x\x00", "x\x1f", "x\x7f", "x\x85"])
def test_mount_flags_rejects_commas_and_control_characters(flag):
    err = raises_exactly(InvalidArgument, csi_input.mount_flags, ["noatime", flag], "cap.mount.mount_flags")
    assert "cap.mount.mount_flags[1]" in err.message


def test_mount_flags_rejects_empty_and_too_long():
    for flag in ("", "x" * (csi_input.MAX_OPTION + 1)):
        err = raises_exactly(InvalidArgument, csi_input.mount_flags, [flag], "f")
        assert "f[0]" in err.message


def test_capability_checks_mount_flags_inside():
    cap = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(mount_flags=["ro,exec"]),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER))
    err = raises_exactly(InvalidArgument, csi_input.capability, cap, "volume_capability", csi_input.SINGLE_NODE_MODES,
                  ("ext4",))
    assert "volume_capability.mount.mount_flags[0]" in err.message


# -- csi_input.capacity ------------------------------------------------------------------


def _capacity(required=0, limit=0, *, default=GIB, minimum=16 * MIB, maximum=100 * GIB, align=MIB, none=False):
    rng = None if none else csi_pb2.CapacityRange(required_bytes=required, limit_bytes=limit)
    return csi_input.capacity(rng, default=default, minimum=minimum, maximum=maximum, align=align)


def test_capacity_defaults_minimum_and_rounding():
    assert _capacity(none=True) == GIB
    assert _capacity() == GIB
    assert _capacity(required=1) == 16 * MIB  # raised to the minimum
    assert _capacity(required=64 * MIB) == 64 * MIB  # exact multiples are honoured
    assert _capacity(required=64 * MIB + 1) == 65 * MIB  # rounded up, never down
    assert _capacity(required=100 * GIB) == 100 * GIB  # the maximum itself is allowed


def test_capacity_within_limit():
    # Only a limit: the default, capped by the limit.
    assert _capacity(limit=32 * MIB) == 32 * MIB
    assert _capacity(limit=4 * GIB) == GIB
    # required == limit, aligned: exactly that.
    assert _capacity(required=48 * MIB, limit=48 * MIB) == 48 * MIB
    # A limit that is not a MiB multiple still admits the aligned size below it.
    assert _capacity(limit=20 * MIB + 5) == 20 * MIB
    assert _capacity(required=17 * MIB, limit=20 * MIB + 5) == 17 * MIB
    assert _capacity(required=17 * MIB + 1, limit=20 * MIB + 5) == 18 * MIB


def test_capacity_out_of_range_versus_invalid_argument():
    # Contradictory or negative requests are the caller's mistake.
    err = raises_exactly(InvalidArgument, _capacity, required=64 * MIB, limit=32 * MIB)
    assert "capacity_range" in err.message
    raises_exactly(InvalidArgument, _capacity, required=-1)
    raises_exactly(InvalidArgument, _capacity, limit=-1)
    # Well-formed ranges this driver cannot satisfy are OUT_OF_RANGE.
    err = raises_exactly(OutOfRange, _capacity, limit=8 * MIB)  # below the minimum
    assert "capacity_range" in err.message
    raises_exactly(OutOfRange, _capacity, required=17 * MIB + 1, limit=17 * MIB + 1000)  # no MiB multiple fits
    raises_exactly(OutOfRange, _capacity, required=100 * GIB + 1)  # above the maximum
    raises_exactly(OutOfRange, _capacity, required=1, maximum=8 * MIB)  # minimum above the maximum
    assert InvalidArgument.code is grpc.StatusCode.INVALID_ARGUMENT
    assert OutOfRange.code is grpc.StatusCode.OUT_OF_RANGE
