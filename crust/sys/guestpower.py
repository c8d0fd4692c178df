"""What a guest's agent does to the machine itself: set its wall clock,
credit entropy to its kernel and reseed the random generator, and power
it off. Only ever called inside a VM's guest."""

from __future__ import annotations

import ctypes
import fcntl
import os
import struct
import time

# <linux/random.h>: _IOW('R', 0x03, int[2]) and _IO('R', 0x07).
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
# <linux/reboot.h>: LINUX_REBOOT_CMD_POWER_OFF, as reboot(2)'s glibc wrapper takes it.
RB_POWER_OFF = 0x4321FEDC
RANDOM_DEVICE = "/dev/urandom"

_libc = ctypes.CDLL(None, use_errno=True)


def set_clock(unix_ns: int) -> int:
    """The wall clock set to unix_ns; how far it moved (new minus old)."""
    before = time.clock_gettime_ns(time.CLOCK_REALTIME)
    time.clock_settime_ns(time.CLOCK_REALTIME, unix_ns)
    return unix_ns - before


def credit_and_reseed(seed: bytes, device: str = RANDOM_DEVICE) -> int:
    """seed added to the kernel's input pool with every bit credited, then
    the generator rekeyed from it at once; the bits credited."""
    bits = 8 * len(seed)
    fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", bits, len(seed)) + seed)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)
    return bits


def power_off() -> None:
    """The machine off now (the caller synced what it needs); returns only
    on failure, raising OSError."""
    if _libc.reboot(ctypes.c_int(RB_POWER_OFF)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"reboot(POWER_OFF): {os.strerror(err)}")
