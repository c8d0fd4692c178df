"""Hostile requests for tests/integration/test_hostile_input.py (and
test_trust.py): hostile values (integers at the edges, odd Unicode, malformed
ids and paths), the places hostile paths point to (symlinks planted below the
test root that lead out of it, to a scratch directory and to /etc), requests
built from protobuf descriptors, nearly valid requests mutated from a live
one, and the explicit attacks every RPC gets.

Nothing here touches the host except what the test planted: the symlinks
below the test root and the scratch directory outside it (`outside`).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory
from hypothesis import strategies as st



FD = _descriptor.FieldDescriptor

INT64 = (0, 1, -1, 2**63 - 1, -(2**63), 2**63 - 2, 2**62, 2**32, 2**31, 4096, 1024**2, 64 * 1024**2, 1024**3,
         100 * 1024**3)
UINT64 = (0, 1, 2**64 - 1, 2**63, 2**63 - 1, 2**32, 4096, 64 * 1024**2)
INT32 = (0, 1, -1, 2**31 - 1, -(2**31), 7, 1000)
UINT32 = (0, 1, 2**32 - 1, 2**31, 7, 2**20 - 1, 2**20)
BAD_ENUMS = (99, -1, 2**31 - 1, -(2**31), 1000)

# Characters a file name or an id should not trip over.
ODD = ("\x00", "a\x00b", "\u202e", "\ufeff", "\u00e9", "\U0001f600", "\n", "\t", " ", "\\", "%s%n", "${HOME}",
       "' OR 1=1 --", "ext4,exec", "a,b", "\x7f", "\u0085", "\u2028", "\u0301", "\uffff", "\U0010ffff", "~", "*",
       "-rf", "--help", "-o", "=", ":", "..", ".", "mountInfo.json")
SHORT_IDS = ("a", "x", "vol-1", "snap-1", "group-1", "node-a", "mountns", "0", "-1", "null", "None", "undefined",
             "x" * 128, "x" * 129, "x" * 255, "x" * 256)
LONG = ("a" * 256, "\u00e9" * 128, "\U0001f600" * 64, "b" * 300, "c" * 4097, "d" * 5000)


def odd_text() -> st.SearchStrategy[str]:
    """Any Unicode text protobuf can carry (valid UTF-8: no surrogates)."""
    return st.text(st.characters(exclude_categories=("Cs",)), max_size=24)


@dataclass
class Place:
    """Where hostile paths point. Every generated path lies (as text) below
    `root`, or reaches `outside` through '..' or a symlink, or reaches /etc
    only through the /etc symlink and only to entries named `token*`."""

    root: Path
    outside: Path
    token: str = field(default_factory=lambda: f"crust-hostile-{uuid.uuid4().hex[:10]}")
    real_paths: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)
    real_ids: dict[str, list[str]] = field(default_factory=dict)

    @property
    def kubelet(self) -> Path:
        return self.root / "kubelet"

    # -- the planted symlinks -------------------------------------------------------

    def links_to_outside(self) -> list[Path]:
        return [self.root / "out-link", self.kubelet / "out-link", self.kubelet / "pods" / "out-link",
                self.kubelet / "plugins" / "out-link"]

    def links_to_etc(self) -> list[Path]:
        return [self.root / "etc-link", self.kubelet / "pods" / "etc-link"]

    def dangling_links(self) -> list[Path]:
        return [self.kubelet / "pods" / "dangling"]

    def file_links(self) -> list[Path]:
        return [self.kubelet / "pods" / "file-link"]

    def plant(self) -> None:
        """(Re)create the symlinks, bundles and the outside directory's
        content; a daemon that unlinked or replaced one gets it back for the
        next example. Best effort: a volume mounted over a planted place
        (below the root) keeps it from being planted again."""
        try:
            self._plant()
        except OSError:
            pass

    def _plant(self) -> None:
        self.outside.mkdir(parents=True, exist_ok=True)
        (self.outside / "dir").mkdir(exist_ok=True)
        if not (self.outside / "dir" / "keep").exists():
            (self.outside / "dir" / "keep").write_text("outside, must survive\n")
        if not (self.outside / "file").exists():
            (self.outside / "file").write_text("outside, must survive\n")
        # Bundles a handler must refuse cleanly: config.json not UTF-8, a
        # directory, a symlink out of the root; a bundle that is a file.
        bundles = self.root / "bundles"
        (bundles / "binary").mkdir(parents=True, exist_ok=True)
        (bundles / "binary" / "config.json").write_bytes(b'{"process": {"args": ["\xff\xfe"]}}')
        (bundles / "dir-config" / "config.json").mkdir(parents=True, exist_ok=True)
        (bundles / "link-config").mkdir(exist_ok=True)
        if not (bundles / "file").exists():
            (bundles / "file").write_text("not a bundle\n")
        wanted = [(p, self.outside) for p in self.links_to_outside()] + \
                 [(bundles / "link-config" / "config.json", self.outside / "file")] + \
                 [(p, Path("/etc")) for p in self.links_to_etc()] + \
                 [(p, self.outside / "gone") for p in self.dangling_links()] + \
                 [(p, self.outside / "file") for p in self.file_links()]
        for link, to in wanted:
            try:
                self._plant_link(link, to)
            except OSError:
                continue

    @staticmethod
    def _plant_link(link: Path, to: Path) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            if os.readlink(link) == str(to):
                return
            link.unlink()
        elif link.exists():
            if link.is_dir() and not os.path.ismount(link):
                link.rmdir()  # a daemon made a directory where the link was (OSError: not empty)
            elif not link.is_dir():
                link.unlink()
            else:
                return
        os.symlink(to, link)

    def outside_listing(self) -> set[str]:
        found = set()
        for dirpath, dirnames, filenames in os.walk(self.outside):
            rel = os.path.relpath(dirpath, self.outside)
            for name in dirnames + filenames:
                found.add(os.path.join(rel, name))
        return found

    def etc_entries(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir("/etc") if n.startswith(self.token))
        except OSError:
            return []

    # -- strategies ---------------------------------------------------------------------

    def component(self) -> st.SearchStrategy[str]:
        """One path component: never '.', '..' or with a '/' (those come from
        segments(), which never climbs above where it starts)."""
        plain = st.sampled_from(["a", "mount", "globalmount", "x y", "-", "\u00e9", "\U0001f600", "\u202e",
                                 "a\nb", "a\\b", "mountInfo.json", "lost+found", "...", " ",
                                 # str.splitlines() breaks lines at these; the kernel does not escape them
                                 "a\x85b", "a\u2028b", "a\x1cb", "a\rb", "a\x0bb"])
        longs = st.sampled_from(["l" * 255, "l" * 256, "\u00e9" * 128, "\U0001f600" * 64, "m" * 1000])
        nul = st.sampled_from(["a\x00b", "\x00", "a\x00"])
        return st.one_of(plain, longs, nul,
                         odd_text().filter(lambda s: s and "/" not in s and s not in (".", "..")))

    def segments(self, max_size: int = 4, climb: bool = True) -> st.SearchStrategy[str]:
        """'/a/b', '/a/./b', '/a//b', '/a/x/../b', '/a/': text that, however
        a daemon reads it, stays below where it starts. climb=False (after a
        symlink) only plain components."""
        one = self.component()
        if climb:
            one = st.one_of(one, one, st.just("."), st.just(""), st.builds(lambda c: c + "/..", self.component()))
        return st.builds(lambda parts, slash: "".join("/" + p for p in parts) + slash,
                         st.lists(one, max_size=max_size), st.sampled_from(["", "", "/"]) if climb else st.just(""))

    def paths(self) -> st.SearchStrategy[str]:
        root, kubelet = str(self.root), str(self.kubelet)
        bases = st.sampled_from([root, kubelet, kubelet + "/pods", kubelet + "/plugins",
                                 kubelet + "/pods/p1/volumes/kubernetes.io~csi/pv1/mount",
                                 kubelet + "/plugins/kubernetes.io/csi/staging/pv1/globalmount"])
        # At least one component below a base: a mount over the test root
        # or the kubelet root would hide the daemons' own sockets and state.
        under = st.builds(lambda b, first, rest: b + "/" + first + rest, bases, self.component(), self.segments())
        real = st.deferred(lambda: st.sampled_from(self.real_paths) if self.real_paths else st.just(root))
        real_plus = st.builds(lambda b, rest: b + rest, real, self.segments(max_size=2))
        via_outside = st.builds(lambda link, rest: str(link) + rest,
                                st.sampled_from(self.links_to_outside() + self.dangling_links() + self.file_links()),
                                self.segments(max_size=3, climb=False))
        via_etc = st.builds(lambda link, suffix, rest: f"{link}/{self.token}{suffix}{rest}",
                            st.sampled_from(self.links_to_etc()),
                            st.sampled_from(["", "-a", "-" + "e" * 250, "-\u00e9", "-x y"]),
                            self.segments(max_size=2, climb=False))
        # Text that climbs out of the root into the outside directory.
        dotdot = st.builds(lambda b, rest: b + "/../" + self.outside.name + rest,
                           st.sampled_from([root, kubelet + "/..", kubelet + "/pods/../..", root + "/."]),
                           self.segments(max_size=2, climb=False))
        too_long = st.builds(lambda b, n: b + ("/" + "d" * 200) * n, bases, st.sampled_from([20, 21, 30]))
        relative = st.sampled_from(["relative/path", "kubelet/pods", ".", "..", "./x", "~/x"])
        return st.one_of(real, real, under, real_plus, via_outside, via_etc, dotdot, too_long, relative)

    def hostile_paths(self) -> st.SearchStrategy[str]:
        """Paths that are not the set-up's own: mostly through symlinks."""
        kubelet = str(self.kubelet)
        pods = kubelet + "/pods"
        via_outside = st.builds(lambda link, rest: str(link) + rest,
                                st.sampled_from(self.links_to_outside() + self.dangling_links() + self.file_links()),
                                self.segments(max_size=2, climb=False))
        via_etc = st.builds(lambda link, suffix, rest: f"{link}/{self.token}{suffix}{rest}",
                            st.sampled_from(self.links_to_etc()), st.sampled_from(["", "-a", "-" + "e" * 250]),
                            self.segments(max_size=2, climb=False))
        return st.one_of(via_outside, via_etc, st.sampled_from(self.attack_paths()),
                         st.builds(lambda first, rest: pods + "/" + first + rest, self.component(), self.segments()))

    def attack_paths(self) -> list[str]:
        k, pods = str(self.kubelet), str(self.kubelet / "pods")
        csi = pods + "/p3/volumes/kubernetes.io~csi"
        return [
            pods + "/out-link", pods + "/out-link/x", str(self.root / "out-link") + "/mount",
            str(self.kubelet / "plugins" / "out-link") + "/globalmount",
            f"{pods}/etc-link/{self.token}", f"{pods}/etc-link/{self.token}/x", pods + "/dangling",
            pods + "/file-link", pods + "/file-link/x",
            f"{csi}/{'l' * 256}/mount", f"{csi}/{chr(0xe9) * 128}/mount", csi + "/pv3" + "/d" * 2100,
            f"{pods}/../../../{self.outside.name}/x", f"{k}/../../{self.outside.name}/y",
            f"{pods}/a\x00b", f"{csi}/\u202e/mount", f"{pods}/x/../y", f"{pods}//y", f"{pods}/y/", f"{pods}/./y",
            f"{csi}/a\x85b/mount", f"{csi}/a\u2028b/mount", f"{csi}/a\rb/mount", f"{csi}/a\nb/mount",
            f"{csi}/a b\\c/mount", str(self.root / "bundles" / "binary"), str(self.root / "bundles" / "dir-config"),
            str(self.root / "bundles" / "link-config"), str(self.root / "bundles" / "file"),
            "relative/x", "",
        ]

    def ids(self, kind: str) -> st.SearchStrategy[str]:
        return st.deferred(lambda: st.sampled_from(self.real_ids.get(kind) or ["none"]))

    def all_ids(self) -> st.SearchStrategy[str]:
        return st.deferred(lambda: st.sampled_from(sorted({i for v in self.real_ids.values() for i in v}) or ["none"]))

    def text(self) -> st.SearchStrategy[str]:
        """The generic mix every string field draws from."""
        return st.one_of(
            st.just(""),
            st.sampled_from(SHORT_IDS),
            self.all_ids(),
            st.sampled_from(ODD),
            st.sampled_from(LONG),
            odd_text().map(lambda s: s.replace("/", "_")),  # never an absolute path outside the root
            self.paths(),
            st.builds(lambda i, s: i + s, self.all_ids(), st.sampled_from(ODD + ("/../x", "/", " "))),
        )

    def string_for(self, name: str) -> st.SearchStrategy[str]:
        """Field-aware strings: a path field mostly gets paths, an id field
        mostly real ids, and every field sometimes anything."""
        n = name.lower()
        specific = None
        if n in ("volume_backing_path", "device"):
            specific = st.one_of(st.deferred(lambda: st.sampled_from(self.devices or ["/dev/null"])), self.paths())
        elif "path" in n or n in ("bundle", "target", "device", "mount_point", "destinations", "subpaths"):
            specific = self.paths()
        elif n == "endpoint":
            specific = st.one_of(st.builds(lambda p: "unix://" + p, self.paths()),
                                 st.sampled_from(["unix://", "tcp://127.0.0.1:1", "unix:relative", "unix:///dev/null",
                                                  "unix://" + str(self.root / "csi.sock"), "dns:///x", "\x00"]))
        elif "snapshot_id" in n:
            specific = st.one_of(self.ids("snapshot"), self.ids("group_snapshot"))
        elif "volume_id" in n:
            specific = self.ids("volume")
        elif n == "node_id":
            specific = st.sampled_from(["node-a", "node-b", "node-a\x00", "node-a/..", "../node-a"])
        elif n == "sandbox_id":
            specific = self.ids("sandbox")
        elif n in ("handler", "name"):
            specific = st.one_of(self.ids("name"), st.sampled_from(["mountns", "kata", "mountns\x00", "../mountns"]))
        elif n in ("fs_type", "filesystems"):
            specific = st.sampled_from(["ext4", "xfs", "btrfs", "ext4,ro", "", "EXT4", "ext4\x00", "ntfs"])
        elif n in ("starting_token", "lease_id"):
            specific = st.sampled_from(["", "0", "1", "-1", "2", "99999999999999999999", "1e3", "0x10", " 1"])
        elif n in ("mount_flags", "options"):
            specific = st.sampled_from(["ro", "rw", "noexec", "exec", "suid", "dev", "loop", "x-mount.mkdir",
                                        "bind", "remount", "uid=0", "ro,exec", "context=x", "errors=panic", "-o", ""])
        elif "group" in n:
            specific = st.sampled_from(["0", "1000", "4294967295", "4294967296", "-1", "99999999999", "abc",
                                        "Always", "OnRootMismatch", "always", ""])
        if specific is None:
            return self.text()
        return st.one_of(specific, specific, self.text())

    def map_entries(self, name: str) -> st.SearchStrategy[dict]:
        n = name.lower()
        keys = st.one_of(self.text(), st.sampled_from([
            "fsType", "provisioning", "topology.loop.csi.crust.dev/node", "csi.storage.k8s.io/pod.name",
            "csi.storage.k8s.io/pod.namespace", "crust.dev/defer", "crust.dev/fs-group", "fsGroup"]))
        values = st.one_of(self.string_for(n), st.sampled_from(["ext4", "xfs", "thin", "thick", "node-a", "true"]))
        return st.one_of(
            st.dictionaries(keys, values, max_size=3),
            st.builds(lambda n, v: {f"k{i}": v for i in range(n)}, st.sampled_from([300, 1000]),
                      st.sampled_from(["", "v", "x" * 64])),
        )


# -- requests from descriptors ------------------------------------------------------------


def is_map(f: FD) -> bool:
    return f.type == FD.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def message_class(desc):
    return message_factory.GetMessageClass(desc)


def scalar(f: FD, place: Place) -> st.SearchStrategy:
    t = f.type
    if t == FD.TYPE_STRING:
        return place.string_for(f.name)
    if t == FD.TYPE_BYTES:
        return st.one_of(st.binary(max_size=32), st.just(b"\x00" * 300))
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(INT64), st.integers(-(2**63), 2**63 - 1))
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return st.one_of(st.sampled_from(UINT64), st.integers(0, 2**64 - 1))
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.one_of(st.sampled_from(INT32), st.integers(-(2**31), 2**31 - 1))
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.one_of(st.sampled_from(UINT32), st.integers(0, 2**32 - 1))
    if t == FD.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == FD.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if t == FD.TYPE_ENUM:
        valid = [v.number for v in f.enum_type.values]
        return st.one_of(st.sampled_from(valid), st.sampled_from(BAD_ENUMS + (max(valid) + 1,)))
    raise TypeError(f"no strategy for {f.full_name} (type {t})")


def value_for(f: FD, place: Place, depth: int) -> st.SearchStrategy:
    """A value for field f: a scalar, a message, a list or a dict."""
    if is_map(f):
        value_field = f.message_type.fields_by_name["value"]
        if value_field.type == FD.TYPE_MESSAGE:
            return st.dictionaries(place.string_for(f.name), message(value_field.message_type, place, depth + 1),
                                   max_size=2)
        return place.map_entries(f.name)
    one = message(f.message_type, place, depth + 1) if f.type == FD.TYPE_MESSAGE else scalar(f, place)
    if f.is_repeated:
        return st.one_of(st.lists(one, max_size=3), st.lists(one, min_size=20, max_size=40)) \
            if f.type != FD.TYPE_MESSAGE else st.lists(one, max_size=3)
    return one


def assign(msg, f: FD, value) -> None:
    if is_map(f):
        target = getattr(msg, f.name)
        target.clear()
        value_field = f.message_type.fields_by_name["value"]
        for k, v in value.items():
            if value_field.type == FD.TYPE_MESSAGE:
                target[k].CopyFrom(v)
            else:
                target[k] = v
    elif f.is_repeated:
        target = getattr(msg, f.name)
        del target[:]
        if f.type == FD.TYPE_MESSAGE:
            for v in value:
                target.add().CopyFrom(v)
        else:
            target.extend(value)
    elif f.type == FD.TYPE_MESSAGE:
        getattr(msg, f.name).CopyFrom(value)
    else:
        setattr(msg, f.name, value)


MAX_DEPTH = 4


def message(desc, place: Place, depth: int = 0) -> st.SearchStrategy:
    """A message of type desc with any subset of its fields set (at most one
    per oneof), recursively up to MAX_DEPTH."""
    cls = message_class(desc)
    if depth >= MAX_DEPTH:
        return st.just(cls())
    plain = [f for f in desc.fields if f.containing_oneof is None]
    optional = {f.name: st.deferred(lambda f=f: value_for(f, place, depth)) for f in plain}
    oneofs = [st.one_of(st.none(), st.sampled_from(list(o.fields)).flatmap(
        lambda f: st.tuples(st.just(f.name), value_for(f, place, depth)))) for o in desc.oneofs]

    def build(values: dict, chosen: tuple):
        msg = cls()
        for name, value in values.items():
            assign(msg, desc.fields_by_name[name], value)
        for choice in chosen:
            if choice is not None:
                name, value = choice
                assign(msg, desc.fields_by_name[name], value)
        return msg

    return st.builds(build, st.fixed_dictionaries({}, optional=optional), st.tuples(*oneofs))


def leaves(desc, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Field paths a nearly valid request mutates: tuples of
    FieldDescriptors, with 0 after a repeated message field (its first
    element, when the template has one)."""
    found = []
    for f in desc.fields:
        path = prefix + (f,)
        found.append(path)
        if f.type == FD.TYPE_MESSAGE and not is_map(f) and depth < 2:
            found.extend(leaves(f.message_type, path + ((0,) if f.is_repeated else ()), depth + 1))
    return found


def holder_of(msg, path: tuple):
    """The message holding the last field of path (None: a repeated field on
    the way is empty)."""
    holder = msg
    for step in path[:-1]:
        if isinstance(step, int):
            if len(holder) <= step:
                return None
            holder = holder[step]
        else:
            holder = getattr(holder, step.name)
    return holder


def is_path_field(f: FD) -> bool:
    return f.type == FD.TYPE_STRING and ("path" in f.name or f.name == "bundle")


def is_number_field(f: FD) -> bool:
    return f.type not in (FD.TYPE_STRING, FD.TYPE_BYTES, FD.TYPE_MESSAGE, FD.TYPE_BOOL) and not f.is_repeated


def mutated(template: Callable[[], object], desc, place: Place) -> st.SearchStrategy:
    """A valid request of the live set-up with one or two fields replaced by
    hostile values (or cleared), or left as it is. Path fields are picked
    most often and get hostile paths (symlinks out, '..', long names), then
    enums and integers."""
    paths = leaves(desc)
    path_fields = [p for p in paths if is_path_field(p[-1])]
    numbers = [p for p in paths if is_number_field(p[-1])]
    groups = [g for g in (path_fields, path_fields, numbers, paths) if g]

    def mutation(group):
        value = (lambda path: place.hostile_paths()) if group is path_fields else \
            (lambda path: value_for(path[-1], place, len(path)))
        return st.sampled_from(group).flatmap(lambda path: st.tuples(st.just(path), st.integers(0, 7), value(path)))

    def apply(mutations):
        msg = template()
        for path, clear, value in mutations:
            holder = holder_of(msg, path)
            if holder is None:
                continue
            if clear == 0:
                holder.ClearField(path[-1].name)
            else:
                assign(holder, path[-1], value)
        return msg

    return st.builds(apply, st.lists(st.sampled_from(groups).flatmap(mutation), max_size=2))


ATTACK_IDS = ("", "\x00", "a\x00b", "\u202e", "x" * 256, "x" * 129, "..", "../x", "x/../../y", "\U0001f600", "-",
              "mountInfo.json", "c" * 4097)


def explicit_cases(template_messages: list, desc, place: Place) -> list:
    """The attacks every RPC with a template gets, whatever hypothesis draws:
    each path field through each planted symlink and each malformed path;
    each id field with each malformed id; enums 99 and -1; int64 edges."""
    cases = []
    for base in template_messages:
        if base.DESCRIPTOR is not desc:
            continue
        for path in leaves(desc):
            f = path[-1]
            values = []
            if is_path_field(f) and not f.is_repeated:
                values = place.attack_paths()
            elif f.type == FD.TYPE_STRING and not f.is_repeated and (f.name.endswith("_id") or f.name == "name"):
                values = list(ATTACK_IDS)
            elif f.type == FD.TYPE_ENUM and not f.is_repeated:
                values = [99, -1]
            elif f.type in (FD.TYPE_INT64, FD.TYPE_SINT64) and not f.is_repeated:
                values = [2**63 - 1, -(2**63), -1]
            for value in values:
                msg = type(base)()
                msg.CopyFrom(base)
                holder = holder_of(msg, path)
                if holder is None:
                    continue
                setattr(holder, f.name, value)
                cases.append(msg)
    return cases


# -- host-side invariants --------------------------------------------------------------------
