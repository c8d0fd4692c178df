"""crust.kata.vmm.saved_ram: a guest's RAM saved as its pages that hold
anything, and loaded into a new memfd holding those pages only."""

from __future__ import annotations

import mmap
import os

import pytest

from crust.kata.vmm.saved_ram import PAGE, RamFileError, new_ram, ram_path, save_ram

MIB = 1024 * 1024
SIZE = 8 * MIB


def written_ram() -> tuple[int, dict[int, bytes]]:
    """A memfd as a guest leaves it: pages written here and there, a page
    written with zeros (allocated, nothing in it), the rest never touched."""
    fd = new_ram("test", SIZE)
    pages = {0: b"first page".ljust(PAGE, b"\x01"), 3 * PAGE: os.urandom(PAGE), 4 * PAGE: os.urandom(PAGE),
             SIZE - PAGE: b"\xff" * PAGE}
    for offset, data in pages.items():
        os.pwrite(fd, data, offset)
    os.pwrite(fd, bytes(PAGE), 2 * MIB)
    return fd, pages


def held_bytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def test_saved_ram_holds_the_written_pages_and_leaves_zeros_as_holes(tmp_path):
    fd, pages = written_ram()
    dest = ram_path(tmp_path / "vm.state")
    try:
        written = save_ram(f"/proc/self/fd/{fd}", dest, SIZE)
    finally:
        os.close(fd)
    assert dest.name == "vm.state.ram"
    assert written == len(pages) * PAGE
    assert dest.stat().st_size == SIZE
    data = dest.read_bytes()
    for offset, content in pages.items():
        assert data[offset:offset + PAGE] == content
    assert data.count(0) == SIZE - sum(PAGE - c.count(0) for c in pages.values())
    # The zero page and the untouched RAM are holes: the file holds the written pages only.
    assert dest.stat().st_blocks * 512 <= 16 * PAGE


def test_a_new_vms_ram_holds_the_saved_pages_and_nothing_else(tmp_path):
    fd, pages = written_ram()
    saved = tmp_path / "vm.state.ram"
    try:
        save_ram(f"/proc/self/fd/{fd}", saved, SIZE)
    finally:
        os.close(fd)
    restored = new_ram("restored", SIZE, saved)
    try:
        assert os.fstat(restored).st_size == SIZE
        assert held_bytes(restored) == len(pages) * PAGE
        with mmap.mmap(restored, SIZE, prot=mmap.PROT_READ) as ram:
            for offset, content in pages.items():
                assert ram[offset:offset + PAGE] == content
            assert ram[2 * MIB:2 * MIB + PAGE] == bytes(PAGE)
    finally:
        os.close(restored)


def test_saved_ram_of_another_size_or_missing_is_refused_and_no_memfd_is_left(tmp_path):
    saved = tmp_path / "vm.state.ram"
    with open(saved, "wb") as f:
        f.truncate(SIZE // 2)
    fds_before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(RamFileError, match=f"is {SIZE // 2} bytes, the VM's RAM {SIZE}"):
        new_ram("restored", SIZE, saved)
    with pytest.raises(RamFileError, match="No such file"):
        new_ram("restored", SIZE, tmp_path / "none.ram")
    assert set(os.listdir("/proc/self/fd")) == fds_before


def test_ram_is_not_saved_over_a_file_that_exists(tmp_path):
    fd, _ = written_ram()
    dest = tmp_path / "vm.state.ram"
    dest.write_bytes(b"kept")
    try:
        with pytest.raises(FileExistsError):
            save_ram(f"/proc/self/fd/{fd}", dest, SIZE)
    finally:
        os.close(fd)
    assert dest.read_bytes() == b"kept"
