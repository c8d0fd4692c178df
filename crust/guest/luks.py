"""A pod's encrypted volumes in the guest: crust's LUKS2 volume on a disk
opened, grown and closed by the guest alone.

The disk's owner (whoever can write the host's device) is not trusted: it
may write any header, and rewrite it while the guest reads it. So the
guest formats only a disk that is positively blank, opens only a header of
crust's one shape (crust.guest.luks_shape), checked on a copy in its own
memory, and opens that copy, never the disk's header (a disk rewritten
after the check changes nothing); then it reads the kernel's mapping table
back (never cryptsetup's status, which describes the header) and closes
again anything but crust's cipher on that disk.

The passphrase reaches cryptsetup on its standard input only (never a
command line, a file or a log line), and the agent overwrites its own
copy once done. cryptsetup runs with --disable-keyring: the volume key
stays in the kernel's table, so a resize needs no passphrase.
"""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from crust.api import agent_pb2
from crust.common import agent_capabilities as caps
from crust.common import ttrpc
from crust.guest import luks_shape
from crust.guest.disks import check_disk
from crust.guest.errors import AgentError
from crust.guest.volumes import ENCRYPTED_NAME, Volumes, wait_for
from crust.sys import fs
from crust.sys import mount as sysmount
from crust.sys.run import CommandError, run

log = logging.getLogger(__name__)

HEADER_COPY_BYTES = 1 << 20        # the metadata and crust's key slot area fit in the first MiB
HEADER_BYTES = 16 << 20            # the header's full size, as cryptsetup wants the copy
MAGIC_LUKS2 = b"LUKS\xba\xbe\x00\x02"
MAGIC_LUKS1 = b"LUKS\xba\xbe\x00\x01"
MOST_PASSPHRASE = 512
WRONG_PASSPHRASE = 2               # cryptsetup's exit: no key slot opens with this passphrase
FS_TYPES = ("ext4", "xfs")
MKFS = {"ext4": ["/sbin/mke2fs", "-t", "ext4", "-q", "-F"], "xfs": ["/sbin/mkfs.xfs", "-q"]}
LONGEST = 3600.0
DEADLINE_MARGIN = 0.5              # a command ends this much before the call's deadline, to answer in our words
_WORDS = re.compile(r"\s+")


@dataclass(frozen=True)
class Mapping:
    """What the kernel's table says of a mapping crust opened."""
    device: str          # dm-N
    disk: str            # major:minor of the disk below it
    integrity: bool


def _one_line(text: str, most: int = 300) -> str:
    return _WORDS.sub(" ", text).strip()[-most:]


def _failed(message: str) -> AgentError:
    return AgentError(ttrpc.FAILED_PRECONDITION, message)


def _kernel_name(path: str) -> str:
    """The kernel's name of a block device node (dm-3): without udev,
    /dev/mapper holds nodes, not links to them."""
    return os.path.basename(os.path.realpath(f"/sys/dev/block/{_major_minor(path)}"))


def _major_minor(path: str) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


async def probe(device: str) -> str:
    """"blank", or "luks2" for a LUKS header that is not on a partition
    table; anything else is refused, naming what the probe found (the host
    keeps the same rule before it formats: crust.sys.fs.probe)."""
    try:
        found = await fs.probe(device)
    except OSError as exc:
        raise _failed(f"disk: {device} cannot be read ({exc.strerror or exc}): not treated as blank") from None
    except CommandError as exc:
        raise _failed(f"disk: {device}: blkid -p exited {exc.returncode} ({_one_line(exc.stderr)}): not blank, "
                      f"refusing to format over it") from None
    if found.state == fs.ProbeState.BLANK:
        return "blank"
    if found.fs_type == "crypto_LUKS":
        return "luks2"
    raise _failed(f"disk: {device} holds {found.fs_type}: not blank and not LUKS2, refusing to format over it")


def _read_header(device: str) -> bytes:
    """The device's first MiB as it is on the disk now (O_DIRECT: no page
    of the guest's cache stands in for it)."""
    fd = os.open(device, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        with mmap.mmap(-1, HEADER_COPY_BYTES) as buffer:   # page-aligned, as O_DIRECT needs
            got = os.preadv(fd, [buffer], 0)
            if got != HEADER_COPY_BYTES:
                raise OSError(f"read {got} of {HEADER_COPY_BYTES} bytes")
            return bytes(buffer)
    finally:
        os.close(fd)


async def check_header_copy(device: str, copy: Path, integrity: bool) -> None:
    """Copy the device's header to copy (a sparse file of the header's
    size, in the guest's memory) and check the copy is crust's shape;
    FAILED_PRECONDITION naming what differs. The copy is removed on any
    refusal."""
    try:
        try:
            head = await asyncio.to_thread(_read_header, device)
        except OSError as exc:
            raise _failed(f"disk: cannot read the LUKS2 header of {device}: {exc.strerror or exc}") from None
        if head[:8] == MAGIC_LUKS1:
            raise _failed(f"disk: {device} has a LUKS1 header: crust makes and opens LUKS2 only")
        if head[:8] != MAGIC_LUKS2:
            raise _failed(f"disk: {device} has no LUKS2 header at its start (found {head[:8].hex()}): refusing "
                          f"to open it")
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            f.truncate(HEADER_BYTES)
        try:
            dump = await run(["cryptsetup", "luksDump", "--dump-json-metadata", str(copy)], timeout=60)
        except CommandError as exc:
            raise _failed(f"disk: the LUKS2 header of {device} does not read: {_one_line(exc.stderr)}") from None
        try:
            metadata = json.loads(dump.stdout)
        except ValueError as exc:
            raise _failed(f"disk: the LUKS2 metadata of {device} does not parse: {exc}") from None
        wrong = luks_shape.differences(metadata, integrity)
        if wrong:
            raise _failed(f"disk: the LUKS2 header of {device} is not one crust makes, refusing to open it: {wrong}")
    except BaseException:
        copy.unlink(missing_ok=True)
        raise


async def _table(name: str) -> list[str] | None:
    try:
        return (await run(["dmsetup", "table", name], timeout=30)).stdout.split()
    except CommandError:
        return None


async def opened_as_made(name: str, disk: str) -> Mapping | None:
    """The mapping, when the kernel's table of it is the one crust makes
    on that disk (major:minor); None otherwise."""
    table = await _table(name)
    # start length crypt cipher key(hex) iv_offset device offset [count options...]
    if table is None or len(table) < 8 or table[0] != "0" or table[2] != "crypt" or table[5] != "0":
        return None
    device = _kernel_name(f"/dev/mapper/{name}")
    offset = str(luks_shape.SEGMENT_OFFSET_SECTORS)
    if len(table) == 8:
        plain = table[3] == luks_shape.CIPHER and len(table[4]) == 128 and table[6:] == [disk, offset]
        return Mapping(device, disk, False) if plain else None
    if not (len(table) == 11 and table[3] == luks_shape.INTEGRITY_CIPHER and len(table[4]) == 192 and
            table[7:] == ["0", "2", "integrity:32:aead", "sector_size:4096"]):
        return None
    try:
        below = _major_minor(f"/dev/mapper/{name}_dif")
    except OSError:
        return None
    tags = await _table(f"{name}_dif")
    # start length integrity device offset tag_size mode ...
    if table[6] != below or tags is None or len(tags) < 7 or tags[2:7] != ["integrity", disk, offset, "32", "J"]:
        return None
    return Mapping(device, disk, True)


class EncryptedVolumes:
    def __init__(self, volumes: Volumes, run_dir: str):
        self.volumes = volumes
        self.headers = Path(run_dir) / "luks"
        self._locks: dict[str, asyncio.Lock] = {}

    @property
    def capabilities(self) -> list[str]:
        """luks2 with the tools and dm-crypt (built in or a module the
        image lists), luks2.integrity with dm-integrity too."""
        if not (shutil.which("cryptsetup") and shutil.which("dmsetup") and self._has("dm_crypt", "crypt")):
            return []
        return [caps.LUKS2, *([caps.LUKS2_INTEGRITY] if self._has("dm_integrity", "integrity") else [])]

    def _has(self, module: str, listed: str) -> bool:
        return os.path.isdir(f"/sys/module/{module}") or os.path.isfile(f"{self.volumes.modules_dir}/{listed}")

    def _copy(self, name: str) -> Path:
        return self.headers / f"{name}.header"

    @staticmethod
    def _check_name(name: str) -> None:
        if not ENCRYPTED_NAME.fullmatch(name):
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"name: {name!r} is not crypt- then [a-z0-9-]")

    async def open(self, request: agent_pb2.OpenEncryptedRequest, call) -> agent_pb2.OpenEncryptedResponse:
        passphrase = bytearray(request.passphrase)
        try:
            return await self._open(request, passphrase, call)
        finally:
            passphrase[:] = bytes(len(passphrase))

    async def _open(self, request, passphrase: bytearray, call) -> agent_pb2.OpenEncryptedResponse:
        deadline = None if getattr(call, "timeout", None) is None else time.monotonic() + call.timeout
        self._check_name(request.name)
        check_disk("disk", request.disk)
        if not 1 <= len(passphrase) <= MOST_PASSPHRASE:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"passphrase: {len(passphrase)} bytes, 1..{MOST_PASSPHRASE} "
                                                    f"are taken")
        if request.fs_type not in FS_TYPES:
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"fs_type: {request.fs_type!r} is not one of "
                                                    f"{', '.join(FS_TYPES)}")
        integrity = request.integrity == agent_pb2.OpenEncryptedRequest.HMAC_SHA256
        if request.integrity not in agent_pb2.OpenEncryptedRequest.Integrity.values():
            raise AgentError(ttrpc.INVALID_ARGUMENT, f"integrity: {request.integrity} is none of the values")
        async with self._locks.setdefault(request.name, asyncio.Lock()):
            name = await self.volumes.disks.wait_present("disk", request.disk, wait_for(call))
            device = f"{self.volumes.disks.dev}/{name}"
            disk = _major_minor(device)
            if os.path.exists(f"/dev/mapper/{request.name}"):
                made = await opened_as_made(request.name, disk)
                if made is None:
                    raise AgentError(ttrpc.ALREADY_EXISTS, f"name: {request.name} is open, not on disk {name} as "
                                                          f"crust opens it")
                return agent_pb2.OpenEncryptedResponse(formatted=False, device=made.device, cipher=luks_shape.CIPHER)
            self.volumes.load_modules("crypt", "name")
            if integrity:
                self.volumes.load_modules("integrity", "integrity")
                if not os.path.isdir("/sys/module/dm_integrity"):
                    raise _failed("integrity: this guest's kernel has no dm-integrity")
            self.volumes.load_modules(request.fs_type, "fs_type")
            fresh = await probe(device) == "blank"
            if fresh:
                if not request.format_if_blank:
                    raise _failed(f"disk: {name} is blank and format_if_blank is not set")
                await self._format(device, integrity, passphrase, deadline)
            made = await self._open_checked(request.name, device, disk, integrity, passphrase, deadline)
            if fresh:
                try:
                    await run([*MKFS[request.fs_type], f"/dev/mapper/{request.name}"], timeout=_left(deadline))
                except CommandError as exc:
                    await self._close(request.name)
                    raise _failed(f"fs_type: mkfs.{request.fs_type} inside the LUKS2 volume on {name} failed: "
                                  f"{_one_line(exc.stderr)}") from None
            log.info("encrypted volume %s: opened on %s (formatted %s, integrity %s)", request.name, name, fresh,
                     integrity)
            cipher = luks_shape.INTEGRITY_CIPHER if integrity else luks_shape.CIPHER
            return agent_pb2.OpenEncryptedResponse(formatted=fresh, device=made.device, cipher=cipher)

    @staticmethod
    async def _format(device: str, integrity: bool, passphrase: bytearray, deadline: float | None) -> None:
        try:
            await run(["cryptsetup", "luksFormat", "--batch-mode", *luks_shape.format_options(integrity),
                       "--key-file=-", device], input=passphrase, timeout=_left(deadline))
        except CommandError as exc:
            raise _failed(f"disk: luksFormat of {device} failed: {_one_line(exc.stderr)}") from None

    async def _open_checked(self, name: str, device: str, disk: str, integrity: bool, passphrase: bytearray,
                            deadline: float | None) -> Mapping:
        self.headers.mkdir(mode=0o700, parents=True, exist_ok=True)
        copy = self._copy(name)
        await check_header_copy(device, copy, integrity)
        try:
            await run(["cryptsetup", "open", "--type", "luks2", "--header", str(copy), "--disable-keyring",
                       "--key-file=-", device, name], input=passphrase, timeout=_left(deadline))
        except CommandError as exc:
            copy.unlink(missing_ok=True)
            if exc.returncode == WRONG_PASSPHRASE:
                raise AgentError(ttrpc.PERMISSION_DENIED, f"passphrase: no key slot of the LUKS2 header on "
                                                         f"{device} opens with it") from None
            raise _failed(f"disk: cannot open the LUKS2 volume on {device}: {_one_line(exc.stderr)}") from None
        made = await opened_as_made(name, disk)
        if made is None or made.integrity != integrity:
            await self._close(name)
            raise _failed(f"disk: the mapping of {device} is not the cipher crust makes: closed again")
        return made

    async def _close(self, name: str) -> None:
        try:
            await run(["cryptsetup", "close", name], timeout=60)
        except CommandError as exc:
            raise _failed(f"name: cryptsetup close {name}: {_one_line(exc.stderr)}") from None
        finally:
            if not os.path.exists(f"/dev/mapper/{name}"):
                self._copy(name).unlink(missing_ok=True)

    async def resize(self, name: str) -> agent_pb2.ResizeEncryptedResponse:
        self._check_name(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            if not os.path.exists(f"/dev/mapper/{name}"):
                raise AgentError(ttrpc.NOT_FOUND, f"name: {name} is not open")
            table = await _table(name)
            if table is not None and len(table) > 3 and table[3] == luks_shape.INTEGRITY_CIPHER:
                raise _failed(f"name: {name} is integrity-protected: cryptsetup resizes no dm-integrity device, "
                              f"the volume cannot grow")
            device = _kernel_name(f"/dev/mapper/{name}")
            _rescan_disks_below(device)
            copy = self._copy(name)
            if not copy.exists():
                raise _failed(f"name: {name} was not opened by this agent (no checked header copy)")
            try:
                # The checked copy, never the disk's header (rewritable by the disk's owner since).
                await run(["cryptsetup", "resize", "--header", str(copy), name], timeout=60)
            except CommandError as exc:
                raise _failed(f"name: cryptsetup resize {name}: {_one_line(exc.stderr)}") from None
            return agent_pb2.ResizeEncryptedResponse(size_bytes=_size_bytes(device))

    async def close(self, name: str) -> agent_pb2.CloseEncryptedResponse:
        self._check_name(name)
        async with self._locks.setdefault(name, asyncio.Lock()):
            path = f"/dev/mapper/{name}"
            if not os.path.exists(path):
                self._copy(name).unlink(missing_ok=True)
                return agent_pb2.CloseEncryptedResponse()
            await asyncio.to_thread(_unmount_views, name, path)
            await self._close(name)
            log.info("encrypted volume %s: closed", name)
            return agent_pb2.CloseEncryptedResponse()


def _unmount_views(name: str, path: str) -> None:
    """What is left mounted of the mapping in the agent's namespace (a
    sandbox process's bind of the volume), newest first, never lazily:
    FAILED_PRECONDITION naming a view that stays busy."""
    st = os.stat(path)
    for entry in reversed(sysmount.of_device(os.major(st.st_rdev), os.minor(st.st_rdev))):
        try:
            sysmount.unmount_at(entry.mount_point)
        except OSError as exc:
            raise _failed(f"name: {name} is mounted at {entry.mount_point}, which stays: {exc.strerror}") from None


def _rescan_disks_below(device: str) -> None:
    """A SCSI disk's new capacity is read when asked (QEMU's notice of it
    is handled in the background and must not be raced)."""
    for below in _disks_below(device):
        rescan = f"/sys/block/{below}/device/rescan"
        if os.path.exists(rescan):
            with open(rescan, "w") as f:
                f.write("1")


def _size_bytes(device: str) -> int:
    with open(f"/sys/block/{device}/size") as f:
        return int(f.read()) * 512


def _disks_below(device: str) -> list[str]:
    """The disks under a mapping (through its dm-integrity mapping too)."""
    found, todo = [], [device]
    while todo:
        name = todo.pop()
        try:
            slaves = os.listdir(f"/sys/block/{name}/slaves")
        except OSError:
            slaves = []
        if not slaves and name != device:
            found.append(name)
        todo += slaves
    return found


def _left(deadline: float | None) -> float:
    """What is left of the call's deadline for a command: a format with
    integrity writes every sector's tag, so without a deadline a command
    has LONGEST."""
    return LONGEST if deadline is None else max(deadline - time.monotonic() - DEADLINE_MARGIN, 0.1)
