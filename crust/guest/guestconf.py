"""The pod's hostname and sysctls, set in the guest's own namespaces
(ConfigureGuest): the VM is the pod, so its network, IPC and UTS
namespaces are the guest's."""

from __future__ import annotations

import os
import re
import socket

from crust.common import ttrpc
from crust.guest.errors import AgentError

# A sysctl's dotted (or slashed) name: no ".." and nothing that leaves /proc/sys.
SYSCTL_KEY = re.compile(r"[A-Za-z0-9_-]+([./][A-Za-z0-9_-]+)*")
# The host's check of a pod's hostname (crust.kata.pod.container_spec), within the kernel's 64 bytes.
HOSTNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,62}")


def sysctl_path(key: str) -> str:
    return "/proc/sys/" + (key if "/" in key else key.replace(".", "/"))


def configure(hostname: str, sysctls: list[tuple[str, str]], proc_sys: str = "/proc/sys") -> None:
    """Apply sysctls in order, then the hostname; INVALID_ARGUMENT names the
    first one refused (those before it stay applied)."""
    for index, (key, value) in enumerate(sysctls):
        where = f"sysctls[{index}] {key}"
        if not SYSCTL_KEY.fullmatch(key):
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{where}: not a sysctl name")
        path = proc_sys + sysctl_path(key)[len("/proc/sys"):]
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)   # never made: a key is the kernel's
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{where}: no such key") from None
        except OSError as exc:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"{where}: {exc.strerror}") from None
    if hostname:
        if not HOSTNAME.fullmatch(hostname):
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"hostname: {hostname!r} is no host name")
        try:
            socket.sethostname(hostname)
        except OSError as exc:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"hostname: {exc.strerror}") from None
