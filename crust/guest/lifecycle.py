"""The guest's own life: made its own after a restore (Resume), warmed
while it waits for a pod (Warm), powered off (PowerOff).

Resume: every VM restored from one template wakes with the template's
wall clock and the same state of the kernel's random generator; the host
sends its clock and fresh bytes, the guest sets the one and credits the
other, rekeying the generator at once, before any pod's work runs.

Warm: under software emulation QEMU translates guest code the first time
it runs, so a guest's first container start pays for crun's code and the
kernel's paths (namespaces, mounts, cgroups, exec) once more than the
next. A waiting VM runs one throwaway container of a pod's shape (the
image's warm spec: an empty read-only root with the guest's /bin bound in
it); nothing of it stays.

PowerOff: every other process killed, every file system the pods used
unmounted (the last mounted first), synced, answered, then the machine
off. The guest's own mounts below /proc, /sys, /dev, /run and /tmp stay:
the shares are there, and unmounting a virtio-fs submount with a release
in flight is a kernel BUG on Debian 12's 6.1; the power-off ends them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

from crust.api import agent_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc
from crust.guest import spawn
from crust.guest.errors import AgentError
from crust.guest.oci import DEFAULT_PERSONALITY, OciRuntime
from crust.sys import guestpower
from crust.sys import mount as sysmount

log = logging.getLogger(__name__)

WARM_SPEC = "/usr/lib/crust/warm.json"
WARM_SPEC_DIR = "/run/crust/warm"     # the spec's own paths, replaced by the agent's bundle
WARM_ID = "crust-warm"
WARM_OUTPUT = b"warm\n"
SEED_BYTES = (32, 512)
# What stays mounted at a power-off: the guest's own places.
KEPT_TOPS = ("/proc", "/sys", "/dev", "/run", "/tmp")
# The guest root's device (crust/guest/files/mountroot.sh binds its
# directories read-only over the root): nothing of it to write back, and the
# agent runs from it, so its mounts stay too.
ROOT_DEVICE = "/dev/pmem0"
# How long killed processes get to leave before the unmounts.
KILL_SETTLE = 0.2


def check_resume(request: agent_pb2.ResumeRequest) -> None:
    if not 0 <= request.nanos <= 999_999_999:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"nanos: {request.nanos} is not 0..999999999")
    if request.seconds <= 0:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"seconds: {request.seconds} is no wall clock time")
    low, high = SEED_BYTES
    if not low <= len(request.seed) <= high:
        raise AgentError(ttrpc.INVALID_ARGUMENT, f"seed: {len(request.seed)} bytes, {low} to {high} are taken")


def resume(request: agent_pb2.ResumeRequest) -> agent_pb2.ResumeResponse:
    check_resume(request)
    try:
        step = guestpower.set_clock(request.seconds * 1_000_000_000 + request.nanos)
        bits = guestpower.credit_and_reseed(request.seed)
    except OSError as exc:
        raise AgentError(ttrpc.FAILED_PRECONDITION, f"the guest refused: {exc.strerror or exc}") from None
    log.info("resumed: clock moved %.3f s, %d bits of the host's entropy credited", step / 1e9, bits)
    return agent_pb2.ResumeResponse(clock_step_nanos=step)


def _bundle_spec(spec_path: str, bundle: Path) -> dict:
    """The warm spec with its paths in bundle (made: root, dir, file)."""
    with open(spec_path) as f:
        text = f.read()
    spec = json.loads(text.replace(WARM_SPEC_DIR, str(bundle)))
    spec.setdefault("linux", {}).setdefault("personality", dict(DEFAULT_PERSONALITY))
    for name in ("root", "dir"):
        (bundle / name).mkdir(parents=True, exist_ok=True)
    (bundle / "file").touch()
    return spec


class Warmer:
    def __init__(self, runtime: OciRuntime, run_dir: str, spec: str = WARM_SPEC):
        self.runtime = runtime
        self.bundle = Path(run_dir) / "warm"
        self.spec = spec
        self._lock = asyncio.Lock()

    @property
    def capabilities(self) -> list[str]:
        return [caps.WARM] if self.runtime.present and os.path.isfile(self.spec) else []

    async def warm(self) -> agent_pb2.WarmResponse:
        if not self.capabilities:
            raise AgentError(ttrpc.FAILED_PRECONDITION, f"this guest has no OCI runtime or no {self.spec}")
        async with self._lock:
            try:
                shutil.rmtree(self.bundle, ignore_errors=True)
                spec = _bundle_spec(self.spec, self.bundle)
                (self.bundle / "config.json").write_text(json.dumps(spec))
                # At fixed addresses, as a container's crun runs (crust.guest.containers).
                child = await spawn.start(self.runtime.command("run", "--bundle", str(self.bundle), WARM_ID),
                                          stdin=False, cwd="/", env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                                          fixed_addresses=True)
                try:
                    out = await child.stdout.read() + await child.stderr.read()
                    returncode = await spawn.exited(child.popen)
                finally:
                    child.close_pipes()
            except OSError as exc:
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"warm: {exc}") from None
            finally:
                if (Path(self.runtime.root) / WARM_ID).exists():
                    gone = await asyncio.create_subprocess_exec(
                        *self.runtime.command("delete", "--force", WARM_ID), stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
                    await gone.wait()
                shutil.rmtree(self.bundle, ignore_errors=True)
            if returncode != 0 or out != WARM_OUTPUT:
                words = out.decode(errors="replace").strip()[-1000:]
                raise AgentError(ttrpc.FAILED_PRECONDITION, f"the OCI runtime ran no container (exit "
                                                           f"{returncode}): {words}")
            return agent_pb2.WarmResponse()


def _kept(entry: sysmount.MountEntry) -> bool:
    point = entry.mount_point
    return point == "/" or entry.source == ROOT_DEVICE or \
        any(point == top or point.startswith(top + "/") for top in KEPT_TOPS)


def stop_everything() -> agent_pb2.PowerOffResponse:
    """Every other process killed, the pods' file systems unmounted, synced
    (blocking: run in a thread)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)   # all but PID 1 and the agent itself
    time.sleep(KILL_SETTLE)
    os.sync()
    unmounted = failed = 0
    for entry in reversed(sysmount.mounts()):
        if _kept(entry):
            continue
        try:
            sysmount.unmount_at(entry.mount_point)
            unmounted += 1
        except OSError as exc:
            log.warning("power-off: %s stays mounted (%s); detached", entry.mount_point, exc.strerror)
            with contextlib.suppress(OSError):
                sysmount.unmount_all(entry.mount_point)   # a busy one detached
            failed += 1
    os.sync()
    return agent_pb2.PowerOffResponse(unmounted=unmounted, failed=failed)
