"""Which QEMU accelerator the microVM handler uses: `kvm`, `tcg` or `auto`.

KVM is what a node should use: guests run at native speed. But a /dev/kvm
that exists is no proof that KVM works. On nested or paravirtualised hosts
the vCPU may abort, hang or triple-fault at boot. So `auto` boots one probe VM from the real guest image under KVM:
if its agent answers, the handler uses kvm, otherwise tcg (software
emulation), and it logs why.

The verdict is kept in `<image cache>/accel-probe.json`, keyed by what
decides it (the host kernel, the QEMU binary, the guest kernel, /dev/kvm).
A handler restart on an unchanged node does not probe again. A probe that
only timed out (KVM hangs on some hosts; a very busy one might just be slow)
is kept for a few hours, then tried again. Delete the file to probe at the
next start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from crust.common.atomicfile import write_atomic
from crust.common.formats import NewerFormat, decode, encode
from crust.common.private import make_dirs
from crust.kata.vmm.qemu import GuestSilent, Vm, VmConfig, VmError, VmHung, is_qemu_under, qemu_pids_under
from crust.sys import proc

log = logging.getLogger(__name__)

CHOICES = ("auto", "kvm", "tcg")
KVM_DEVICE = Path("/dev/kvm")
# A guest boots to its agent in about a second under KVM; far slower means
# something is wrong, and the handler must not wait long to start.
PROBE_TIMEOUT = 10.0
TIMEOUT_VERDICT_SECONDS = 6 * 3600
RECORD_NAME = "accel-probe.json"


class ProbeRecord(BaseModel):
    """The kept verdict of one probe (accel-probe.json)."""

    key: str            # digest of what decides the verdict (probe_key)
    accel: Literal["kvm", "tcg"]
    reason: str
    probed_at: float    # seconds since the epoch
    expires_at: float | None = None   # set when the probe only timed out


def probe_key(config: VmConfig) -> str:
    """A digest of everything that decides whether KVM works here."""
    qemu = shutil.which(config.qemu_binary) or config.qemu_binary
    facts = [os.uname().release, os.uname().version, str(KVM_DEVICE.exists())]
    for path in (qemu, str(config.kernel)):
        try:
            st = os.stat(path)
            facts.append(f"{path}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            facts.append(f"{path}:missing")
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()


def read_record(path: Path) -> ProbeRecord | None:
    try:
        return decode(ProbeRecord, path.read_bytes(), path)
    except (OSError, ValueError):
        return None   # missing or unreadable: probe again
    except NewerFormat as exc:
        # A verdict kept by a newer crust: probe again rather than guess.
        log.warning("accelerator verdict of a newer format not used", extra={"fields": {"error": str(exc)}})
        return None


async def probe_kvm(config: VmConfig, workdir: Path, timeout: float = PROBE_TIMEOUT) -> tuple[bool, str, bool]:
    """Boot one VM under KVM. Returns (works, reason, definite): definite is
    False when only the time ran out (worth trying again later)."""
    vm = Vm(f"crust-accel-probe-{os.getpid()}", workdir, VmConfig(
        kernel=config.kernel, initrd=config.initrd, accel="kvm", memory_mib=config.memory_mib,
        cpus=1, cmdline=config.cmdline, qemu_binary=config.qemu_binary))
    try:
        seconds = await vm.start(ready_timeout=timeout)
    except (GuestSilent, VmHung):
        await vm.kill()
        return False, f"a probe VM under KVM did not answer within {timeout:.0f}s", False
    except VmError as exc:
        await vm.kill()
        return False, f"a probe VM under KVM failed: {exc}", True
    except ConnectionError as exc:
        # The VM died while its agent's socket was being read (how a KVM
        # that aborts on start shows on a busy machine, rather than as an
        # exit seen first).
        await vm.kill()
        return False, f"a probe VM under KVM failed: its agent's connection broke ({exc.strerror or exc})", True
    except Exception as exc:  # noqa: BLE001 - a probe must never keep the handler from starting
        await vm.kill()
        log.exception("accelerator probe failed unexpectedly")
        return False, f"the probe under KVM failed unexpectedly: {type(exc).__name__}: {exc}", False
    try:
        await vm.stop(timeout=10)
    finally:
        await vm.kill()
    return True, f"a probe VM booted under KVM in {seconds:.2f}s", True


def reap_leftover_probes(workdir: Path) -> list[int]:
    """Kill probe VMs a killed handler left behind (QEMU runs in its own
    session, so it outlives its handler): the QEMUs whose command line
    names this handler's probe directory, and nothing else."""
    # Checked again once each one's pidfd is open: a probe that exited
    # since the scan, its pid reused, is not the process signalled.
    return [pid for pid in qemu_pids_under(workdir)
            if proc.signal_if(pid, lambda pid=pid: is_qemu_under(pid, workdir), signal.SIGKILL)]


async def choose(requested: str, config: VmConfig, cache: Path, workdir: Path) -> tuple[str, str]:
    """The accelerator to use and why. `kvm` and `tcg` are taken as given."""
    if requested not in CHOICES:
        raise ValueError(f"accelerator {requested!r}: one of {', '.join(CHOICES)}")
    leftovers = reap_leftover_probes(workdir)
    if leftovers:
        log.warning("killed probe VMs an earlier handler left", extra={"fields": {"pids": leftovers}})
    if requested != "auto":
        return requested, "chosen by --accel"
    if not KVM_DEVICE.exists():
        return "tcg", f"{KVM_DEVICE} does not exist"
    record_path = cache / RECORD_NAME
    key = probe_key(config)
    kept = read_record(record_path)
    if kept is not None and kept.key == key and (kept.expires_at is None or kept.expires_at > time.time()):
        return kept.accel, f"{kept.reason} (probed {time.strftime('%Y-%m-%d %H:%M', time.gmtime(kept.probed_at))} UTC)"
    started = time.monotonic()
    try:
        works, reason, definite = await probe_kvm(config, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    accel = "kvm" if works else "tcg"
    log.info("accelerator probe", extra={"fields": {"accel": accel, "reason": reason,
                                                      "probe_s": round(time.monotonic() - started, 2)}})
    now = time.time()
    record = ProbeRecord(key=key, accel=accel, reason=reason, probed_at=now,
                         expires_at=None if definite else now + TIMEOUT_VERDICT_SECONDS)
    make_dirs(cache)
    write_atomic(record_path, encode(record, indent=None), mode=0o644)
    return accel, reason
