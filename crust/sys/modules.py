"""Kernel modules loaded from their files (finit_module), without insmod:
the guest's agent loads a file system's modules on its first mount."""

from __future__ import annotations

import ctypes
import errno
import os

# finit_module's number by machine (the guest runs the host's architecture).
_SYS_FINIT_MODULE = {"x86_64": 313, "aarch64": 273}
_libc = ctypes.CDLL(None, use_errno=True)


def loaded(name: str) -> bool:
    """Whether a module of this name (as in its file name, "-" or "_") is loaded."""
    return os.path.isdir(f"/sys/module/{name.replace('-', '_')}")


def load(path: str) -> bool:
    """Load the module in file path; False when it was loaded already."""
    number = _SYS_FINIT_MODULE.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"finit_module: unknown on {os.uname().machine}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.syscall(number, fd, b"", 0) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            return False
        raise OSError(err, f"finit_module {path}: {os.strerror(err)}")
    finally:
        os.close(fd)
