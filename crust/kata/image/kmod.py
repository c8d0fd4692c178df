"""Which kernel modules the guest loads, and in which order.

The kernel package leaves modules.dep to depmod at install time, and the
host may have no kmod at all, so the dependencies are read straight from each
module's `.modinfo` ELF section (`depends=`, `softdep=pre:`). Modules built
into the kernel (modules.builtin) are skipped. The result is a list of paths
in load order, which the guest's /init feeds to busybox insmod: no depmod,
nothing resolved at boot. The few modules the guest's kernel may ask for by
itself get a modules.dep of their own (modules_dep), for busybox modprobe.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path


def modinfo(path: Path) -> list[str]:
    """The `key=value` strings of a module's .modinfo section."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a little-endian ELF64 kernel module")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]
    for name_off, _type, _flags, _addr, offset, size in sections:
        start = strtab + name_off
        if data[start:data.index(b"\0", start)] == b".modinfo":
            return [s.decode(errors="replace") for s in data[offset:offset + size].split(b"\0") if s]
    return []


def _name(filename: str) -> str:
    """Module name from a file name: crc32c-intel.ko -> crc32c_intel."""
    return filename.split(".ko")[0].replace("-", "_")


@dataclass
class Resolution:
    order: list[Path] = field(default_factory=list)     # module files, load order
    builtin: list[str] = field(default_factory=list)    # asked for, but built in
    unresolved: list[str] = field(default_factory=list)  # soft dependencies not found


class ModuleTree:
    """The modules of one extracted kernel (lib/modules/<release>)."""

    def __init__(self, root: Path):
        self.root = root
        self.files: dict[str, Path] = {}
        for dirpath, _dirs, files in os.walk(root / "kernel"):
            for f in files:
                if ".ko" in f:
                    self.files[_name(f)] = Path(dirpath) / f
        builtin = root / "modules.builtin"
        self.builtin = {_name(os.path.basename(line)) for line in builtin.read_text().split()} \
            if builtin.exists() else set()

    def _soft_candidates(self, alias: str) -> list[str]:
        # Soft dependencies name an alias ("crc32c", "crypto-crc32c"), not a
        # module. The generic C implementation is the one that works on any
        # emulated CPU (crc32c-intel needs SSE4.2, which TCG's default CPU lacks).
        base = alias.replace("-", "_").removeprefix("crypto_")
        return [base, f"{base}_generic"]

    def resolve(self, wanted: list[str]) -> Resolution:
        res = Resolution()
        done: set[str] = set()

        def visit(name: str, soft: bool = False) -> None:
            name = name.replace("-", "_")
            if name in done:
                return
            if name in self.builtin:
                done.add(name)
                if not soft:
                    res.builtin.append(name)
                return
            if name not in self.files:
                if soft:
                    for candidate in self._soft_candidates(name):
                        if candidate in self.builtin or candidate in self.files:
                            return visit(candidate, soft=True)
                    res.unresolved.append(name)
                    return
                raise LookupError(f"kernel module {name} is neither built in nor in {self.root}")
            done.add(name)
            info = modinfo(self.files[name])
            for item in info:
                key, _, value = item.partition("=")
                if key == "softdep":
                    # "pre: a b post: c": load the pre ones first.
                    words, pre = value.split(), False
                    for w in words:
                        if w.endswith(":"):
                            pre = w == "pre:"
                        elif pre:
                            visit(w, soft=True)
                elif key == "depends":
                    for dep in filter(None, value.split(",")):
                        visit(dep)
            res.order.append(self.files[name])

        for name in wanted:
            visit(name)
        return res

    def modules_dep(self, modules: list[Path]) -> str:
        """modules.dep (kmod's format: `path: dependencies`, paths relative
        to the release's directory) for these modules, in load order: each
        line names the modules of the list that its module depends on."""
        lines = []
        for path in modules:
            needs = set()
            for item in modinfo(path):
                key, _, value = item.partition("=")
                if key == "depends":
                    needs.update(filter(None, (d.replace("-", "_") for d in value.split(","))))
            deps = [self.files[n] for n in self._closure(needs) if n in self.files]
            lines.append(f"{path.relative_to(self.root)}: " + " ".join(str(d.relative_to(self.root)) for d in deps))
        return "".join(line.rstrip() + "\n" for line in lines)

    def _closure(self, names: set[str]) -> list[str]:
        """names and everything they depend on, dependencies first (the
        order modprobe loads them in, from the end of the line)."""
        order: list[str] = []

        def visit(name: str) -> None:
            if name in order or name not in self.files:
                return
            for item in modinfo(self.files[name]):
                key, _, value = item.partition("=")
                if key == "depends":
                    for dep in filter(None, value.split(",")):
                        visit(dep.replace("-", "_"))
            order.append(name)

        for name in sorted(names):
            visit(name)
        return list(reversed(order))
