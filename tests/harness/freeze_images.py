"""What a snapshot of a written volume holds, read on the host without
replaying any journal: the file system's own state (ext4's needs_recovery
flag, e2fsck -n; the records left in xfs's log, xfs_repair -n) and the
numbered records a pod wrote (the image mounted read-only with journal
replay off).

The pod's writer appends fixed-size numbered records, each fsync'd, to one
file per volume (all volumes in lockstep: record i to each, then i+1)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

from crust.api import csi_pb2
from tests.harness.handler_env import SIZE

FREEZE = "crust.dev/freeze"
RECORD = 32
# Runs in the pod (the host's python3, bound read-only into a light
# sandbox; the guest's in a microVM): python3 -S -c WRITER FILE... It
# prints "REC <n>" every 32 records, for a host that cannot read the files.
WRITER = ("import os, sys\n"
          "fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for p in sys.argv[1:]]\n"
          "i = 0\n"
          "while True:\n"
          "    for fd in fds:\n"
          "        os.write(fd, b\"%031d\\n\" % i)\n"
          "        os.fsync(fd)\n"
          "    if i % 32 == 0:\n"
          "        print(\"REC\", i, flush=True)\n"
          "    i += 1\n")


def writer_script(*files: str) -> str:
    """The pod's shell command: the writer on each of files (paths in the pod)."""
    return ("P=$(command -v python3 || command -v python3.11) && "
            f"exec $P -S -c '{WRITER}' " + " ".join(files))


def ext4_needs_recovery(image: Path) -> bool:
    out = subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, text=True, check=True).stdout
    features = next(line for line in out.splitlines() if line.startswith("Filesystem features:"))
    return "needs_recovery" in features.split()


def ext4_fsck_clean(image: Path) -> tuple[bool, str]:
    run = subprocess.run(["e2fsck", "-n", "-f", str(image)], capture_output=True, text=True)
    return run.returncode == 0, run.stdout + run.stderr


def xfs_log_items(image: Path) -> list[str]:
    """The kinds of the items xfs's log holds that a mount would replay
    (xfs_logprint's transactional view): a frozen xfs leaves only the
    superblock records that cover its log."""
    out = subprocess.run(["xfs_logprint", "-t", str(image)], capture_output=True, text=True).stdout
    items = []
    for line in out.splitlines():
        m = re.match(r"\s*(INODE|BUF|EFI|EFD|RUI|RUD|CUI|CUD|BUI|BUD|ICREATE|QUOTAOFF|DQUOT|ATTRI|ATTRD)\b", line)
        if m:
            items.append(m.group(1))
        if "Buffer:" in line and items and items[-1] == "BUF":
            items[-1] = "BUF " + line.strip()
    return [i for i in items if i != "BUF"]


def xfs_log_covered(image: Path) -> bool:
    items = xfs_log_items(image)
    return all(i == "BUF SUPER Block Buffer:" for i in items)


# What xfs_repair -n reports of a frozen xfs: only the superblock's lazy
# counters, which the covering records in the log hold.
_LAZY_COUNTERS = re.compile(r"^sb_(fdblocks|ifree|icount) \d+, counted \d+$")
_BOILERPLATE = ("Phase ", "        - ", "Cannot get host filesystem geometry", "Repair may fail if there is",
                "the image and the host filesystem", "No modify flag set", "ALERT: The filesystem has valuable",
                "ignored because the -n option", "which may be resolved by first mounting")


def xfs_repair_findings(image: Path) -> list[str]:
    run = subprocess.run(["xfs_repair", "-n", "-f", str(image)], capture_output=True, text=True)
    return [line for line in (run.stdout + run.stderr).splitlines()
            if line.strip() and not line.startswith(_BOILERPLATE) and not _LAZY_COUNTERS.match(line.strip())]


def records_in(image: Path, fs_type: str, name: str = "records") -> bytes:
    """The record file as the image holds it, with no journal replayed."""
    options = "ro,noload" if fs_type == "ext4" else "ro,norecovery,nouuid"
    with tempfile.TemporaryDirectory(prefix="crust-img-") as mnt:
        subprocess.run(["mount", "-o", f"loop,{options}", str(image), mnt], check=True)
        try:
            return (Path(mnt) / name).read_bytes()
        finally:
            subprocess.run(["umount", "-d", mnt], check=True)


def last_record(data: bytes) -> int:
    """The number of the last record; AssertionError unless the data is
    whole, consecutive records from 0."""
    assert len(data) % RECORD == 0, f"the record file ends inside a record ({len(data)} bytes)"
    count = len(data) // RECORD
    for i in (0, count // 2, count - 1):
        assert data[i * RECORD:(i + 1) * RECORD] == b"%031d\n" % i, f"record {i} is not whole"
    return count - 1


def volume_image(data_dir: Path, volume_id: str, node: str = "node-a") -> Path:
    return data_dir / "pools" / node / "volumes" / f"{volume_id}.img"


def records_written(path: str | os.PathLike) -> int:
    try:
        return os.stat(path).st_size // RECORD
    except FileNotFoundError:
        return 0


def progress(output: str) -> int:
    """The last record number the writer printed (-1: none yet)."""
    found = re.findall(r"^REC (\d+)$", output, re.M)
    return int(found[-1]) if found else -1


# -- snapshots through the shim of a test stack (tests/handler_env.py's Env) ---------------

def snapshot(env, name: str, volume_id: str, mode: str | None = None, timeout: float = 120) -> csi_pb2.Snapshot:
    params = {FREEZE: mode} if mode else {}
    return env.shim.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
        name=name, source_volume_id=volume_id, parameters=params), timeout=timeout).snapshot


def restored_image(env, name: str, snapshot_id: str, fs: str):
    cap = csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs),
                                   access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
    vol = env.shim.controller.CreateVolume(csi_pb2.CreateVolumeRequest(
        name=name, capacity_range=csi_pb2.CapacityRange(required_bytes=SIZE[fs]), volume_capabilities=[cap],
        volume_content_source=csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id))), timeout=120).volume
    return volume_image(env.driver.data_dir, vol.volume_id)


def assert_consistent(image, fs: str) -> int:
    if fs == "ext4":
        assert not ext4_needs_recovery(image), "a frozen ext4's image needs journal recovery"
        clean, out = ext4_fsck_clean(image)
        assert clean, out
    else:
        assert xfs_log_covered(image), xfs_log_items(image)
        assert xfs_repair_findings(image) == []
    return last_record(records_in(image, fs))


def assert_crash_consistent(image, fs: str) -> None:
    if fs == "ext4":
        assert ext4_needs_recovery(image), "an unfrozen, written ext4's image shows no journal to recover"
    else:
        assert "INODE" in xfs_log_items(image), xfs_log_items(image)
