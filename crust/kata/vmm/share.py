"""A pod's shared directories: what its microVM sees of the host, through virtio-fs.

Two per pod, each served by a virtiofsd of the pod's VM
(crust.kata.vmm.virtiofsd) and mounted once by the guest:

- the share (tag crust, at GUEST_SHARE, virtiofsd cache=always,
  revalidated after a second; crust.kata.vmm.virtiofsd): container
  roots, commands, and what only the pod's containers change, kubelet's
  directory of the pod (emptyDir, subPaths, /etc/hosts; cached_in_guest);
- the live share (tag crust-live, at GUEST_LIVE, cache=none): what the
  host changes, so the guest sees each change at once: hostPath,
  containerd's files, and the volumes kubelet's atomic writer updates
  (configMap, secret, projected, downward API; is_atomic_writer_volume),
  which the guest's agent copies into guest memory and switches to each
  new version the writer's way (agent `mirror`: a walk through virtio-fs is
  slow enough for the writer to remove the version it started in).

Both have the same layout (the live one holds binds only). Only crust
writes into them, on the host; the guest sees them read-only except where
a mount says otherwise:

    <workdir>/share.rw/                 crust's side (a mount of its own)
        <container id>/rootfs           bind of the bundle's rootfs (containerd's snapshot)
        .binds/<key>                    bind of a host path some container of the pod binds, ro
                                        where it says ro: one per path and mode for the whole pod
        <container id>/run/<name>.sh    the guest's command for one process (any size the kernel takes)
        <container id>/io/<name>.in     a process's standard input as the host received it (the live
                                        share's: the guest reads each append at once); <name>.in.closed
                                        once it ended
    <workdir>/share/                    what virtiofsd serves: a read-only bind of share.rw

The files crust writes under share.rw (scripts, standard input) are the
same files under share and in virtiofsd's namespace (binds of one
directory); share itself is read-only, so the guest cannot write a script
or a directory of crust's, while a container's rootfs and read-write
volumes, mounts of their own, keep their mode. The rootfs and .binds
entries are mount points in virtiofsd's namespace only: on the host they
are empty directories (or files).

A host path is bound once per pod (and mode), whatever number of its
containers bind it: the guest then has one inode per file for all of them,
so its own locking and its idea of a file's size hold between them (an
O_APPEND write of one container lands after the other's, as on a host; two
binds would be two inodes to the guest, each appending at the end it last
saw). The binds stay until the pod goes (a restarted container binds the
same paths again).

Every bind is a copy made with open_tree, and it is made inside the mount
namespace of the virtiofsd that serves the share (crust.sys.mountns), not
the host's: only the file server needs to see it, and it goes with the
server. A copy in the host's namespace would pin what it copied there: the
host could not remove a directory below a host path while a pod holds a
copy of a mount on it (rmdir fails with EBUSY on a mount point of the
caller's namespace; the copies other namespaces hold are detached), and
the host's mount table would carry every pod's binds. On the host the
share's directories stay plain directories (the mount points, a
container's scripts and standard input); its two own mounts are the only
ones there.

kubelet's and containerd's directories are shared mounts on most hosts,
and a copy left in their peer group would carry their later mounts into
the guest, and our unmounts back to them. So a copy is private, unless the
container asked for the host's later mounts (rslave or rshared,
Kubernetes' HostToContainer and Bidirectional): then it is a slave of the
source, receiving them and sending nothing back (propagation crosses
namespaces). A CRI mount is recursive (rbind): the mounts below a host
path come along, as runc binds them, read-only only at the top for a
read-only mount; those of a CSI volume's path (a deferred volume's
placeholder, another pod's volume) are taken out of the copy. A mount the
host makes later below a followed host path comes through unfiltered.

Unmounts are lazy (detach): virtiofsd holds the files the guest looked up
until the guest forgets them, and a busy mount must still leave the tree.
Nothing is ever deleted through a mount: a directory is removed only once
no mount is left below it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crust.common.private import make_dirs
from crust.sys import mount, mountns, proc

log = logging.getLogger(__name__)

GUEST_SHARE = "/run/crust/share"
GUEST_LIVE = "/run/crust/live"
SHARE_TAG = "crust"
LIVE_TAG = "crust-live"


def tag_of(name: str) -> str:
    """The virtio-fs tag of a pod's shared directory (share or live)."""
    return SHARE_TAG if name == "share" else LIVE_TAG


# kubelet's volume plugins whose volumes its atomic writer fills and updates
# (pkg/volume/util/atomic_writer.go; crust/kubelet/volumes.py replays it).
# The pod's host-path binds, beside its containers' directories (a name no
# container id has: ids start with a letter or a digit).
BINDS = ".binds"
# kubelet's directory of a pod's CSI volumes (pods/<uid>/volumes/kubernetes.io~csi).
CSI_PLUGIN_DIR = "kubernetes.io~csi"
ATOMIC_WRITER_PLUGINS = ("kubernetes.io~configmap", "kubernetes.io~secret", "kubernetes.io~projected",
                         "kubernetes.io~downward-api")
# What kubelet keeps in its directory of a pod (pkg/kubelet/kubelet_getters.go).
KUBELET_POD_ENTRIES = ("volumes", "volume-subpaths", "containers", "plugins", "etc-hosts")


def _kubelet_pod_dir_index(parts: list[str]) -> int | None:
    """The index of the uid in a path below kubelet's directory of a pod
    (.../pods/<uid>/volumes|volume-subpaths|containers|etc-hosts|plugins...)."""
    for i in range(1, len(parts) - 1):
        if parts[i - 1] == "pods" and parts[i + 1] in KUBELET_POD_ENTRIES:
            return i
    return None


def cached_in_guest(source: str) -> bool:
    """Whether the guest may keep a lookup for a second and a file's pages
    until its attributes change (the share): only what nobody but the pod's own
    containers changes, kubelet's directory of the pod (emptyDir, subPaths,
    its /etc/hosts, termination logs). The host's paths (hostPath,
    containerd's files) and the volumes kubelet's atomic writer updates go
    to the live share (cache=none), where the host's changes are seen at
    once, as a runc container sees them."""
    parts = os.path.normpath(source).split("/")
    return _kubelet_pod_dir_index(parts) is not None and not is_atomic_writer_volume(source)


def is_atomic_writer_volume_root(source: str) -> bool:
    """Whether source is such a volume itself (pods/<uid>/volumes/<plugin>/<name>),
    laid out with its ..data link: what the guest's agent mirrors."""
    parts = os.path.normpath(source).split("/")
    return (is_atomic_writer_volume(source) and len(parts) >= 5 and parts[-5] == "pods" and parts[-3] == "volumes"
            and parts[-2] in ATOMIC_WRITER_PLUGINS)


def is_atomic_writer_volume(source: str) -> bool:
    """Whether source is, or lies in, a volume kubelet's atomic writer
    updates: pods/<uid>/volumes/<one of those plugins>/<name>[/...]. A
    subPath of one is a bind kubelet made once (volume-subpaths/) and is
    never updated, as in Kubernetes."""
    parts = os.path.normpath(source).split("/")
    return any(parts[i - 1] == "pods" and len(parts) > i + 3 and parts[i + 1] == "volumes"
               and parts[i + 2] in ATOMIC_WRITER_PLUGINS for i in range(1, len(parts)))


class ShareError(Exception):
    pass


# How long a just-started virtiofsd may take to enter the directory it serves.
SERVER_READY_WAIT = 10.0


class PodShare:
    """One shared directory of a pod: name is share or live; server is the
    virtiofsd serving it (binds are made in its mount namespace), None
    when it has none (its VM is gone: only what is on the host is left)."""

    def __init__(self, workdir: Path, name: str = "share", server: proc.ProcessId | None = None):
        if name not in ("share", "live"):
            raise ValueError(f"a pod's shared directory is share or live, not {name!r}")
        self.server = server
        self.writable = workdir / f"{name}.rw"
        self.served = workdir / name
        self.guest = GUEST_SHARE if name == "share" else GUEST_LIVE
        self.tag = tag_of(name)
        self.cache = "always" if name == "share" else "none"   # virtiofsd's cache mode for it

    # -- paths -------------------------------------------------------------------------

    def guest_rootfs(self, container_id: str) -> str:
        return f"{self.guest}/{container_id}/rootfs"

    def guest_bind(self, key: str) -> str:
        return f"{self.guest}/{BINDS}/{key}"

    def _container_dir(self, container_id: str) -> Path:
        if not container_id or "/" in container_id or container_id.startswith("."):
            raise ShareError(f"container id {container_id!r} cannot name a directory")
        return self.writable / container_id

    # -- the pod -----------------------------------------------------------------------

    def set_up(self) -> Path:
        """The two mounts (again after a crash half way); returns what virtiofsd serves."""
        make_dirs(self.writable)
        make_dirs(self.served)
        if mount.at(str(self.writable)) is None:
            mount.mount_path(str(self.writable), str(self.writable), "bind", ["bind"])
            # Out of whatever peer group the directory's file system is in,
            # then a group of its own that share joins.
            mount.set_propagation(str(self.writable), mount.MS_PRIVATE)
            mount.set_propagation(str(self.writable), mount.MS_SHARED)
        if mount.at(str(self.served)) is None:
            mount.mount_path(str(self.writable), str(self.served), "bind", ["bind"])
            mount.remount_bind_readonly(str(self.served))
        return self.served

    def tear_down(self) -> None:
        """Every container's binds and the pod's, then the two mounts, then the directories.
        Runs again after any failure."""
        if self.writable.is_dir():
            for entry in sorted(os.listdir(self.writable)):
                if entry == BINDS:
                    self._detach_served(BINDS)
                    _detach_all(self.writable / BINDS)   # a pod's binds made on the host by an earlier release
                    _remove_tree(self.writable / BINDS)
                else:
                    self.remove_container(entry)
        for path in (self.served, self.writable):
            if path.exists():
                _detach_all(path)
        for path in (self.served, self.writable):
            _remove_tree(path)

    # -- the file server's mount namespace -----------------------------------------------

    def _serving(self) -> bool:
        return self.server is not None and proc.alive(self.server)

    @contextlib.contextmanager
    def _namespace(self) -> Iterator[int]:
        """The server's mount namespace, open, once the server serves from
        it; ShareError when the share has no running server."""
        server = self.server
        if server is None:
            raise ShareError(f"{self.served} has no file server (the pod's VM is not running)")
        try:
            fd = os.open(f"/proc/{server.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, ProcessLookupError):
            raise ShareError(f"the file server of {self.served} ({server}) is gone") from None
        try:
            # Checked after the open: the descriptor is that process's namespace.
            if not proc.alive(server):
                raise ShareError(f"the file server of {self.served} ({server}) is gone")
            self._wait_until_served(server)
            yield fd
        finally:
            os.close(fd)

    def _wait_until_served(self, server: proc.ProcessId) -> None:
        """virtiofsd listens before it pivots into the directory it serves:
        a bind made before would land in the host's tree of its namespace."""
        want = os.stat(self.served)
        deadline = time.monotonic() + SERVER_READY_WAIT
        while True:
            try:
                root = os.stat(f"/proc/{server.pid}/root")
            except OSError:
                root = None
            if root is not None and (root.st_dev, root.st_ino) == (want.st_dev, want.st_ino):
                return
            if time.monotonic() > deadline or not proc.alive(server):
                raise ShareError(f"the file server of {self.served} ({server}) does not serve it")
            time.sleep(0.02)

    def _served_mounts_below(self, relative: str) -> list[str]:
        """Mount points at or below relative (a path in the share) in the
        server's namespace, as paths from its root (the share), deepest
        first. The table is the server's, read from the host."""
        top = "/" + relative.strip("/")
        points = [e.mount_point for e in mount.mounts(f"/proc/{self.server.pid}/mountinfo")
                  if e.mount_point == top or e.mount_point.startswith(top + "/")]
        return sorted(set(points), key=lambda p: (-p.count("/"), p))

    def _detach_served(self, relative: str) -> None:
        """Every mount at or below relative in the server's namespace (none
        without a running server: its namespace went with it)."""
        if not self._serving():
            return
        try:
            with self._namespace() as ns:
                points = self._served_mounts_below(relative)
                if points:
                    mountns.run_inside(ns, lambda: _detach_points(points))
        except ShareError:
            if self._serving():
                raise

    def _bind(self, source: str, parent: str, name: str, *, readonly: bool, directory: bool,
              recursive: bool = False, follow: bool = False) -> list[str]:
        """A copy of source at parent/name of the share (made a directory or
        an empty file on the host first) in the server's namespace, private
        unless it follows the source; nothing when it is bound there
        already. A recursive copy loses the mounts it brought along of a
        CSI volume's path (a deferred volume's placeholder or another pod's
        volume reaches a guest only as the volume, through its claim).
        Returns the mount points below the copy (paths in the share)."""
        relative = f"{parent}/{name}"
        target = self.writable / parent / name
        with self._namespace() as ns:
            if "/" + relative not in self._served_mounts_below(relative):
                if directory:
                    make_dirs(target)
                elif not target.exists():
                    os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     0o600))
                # The source is what kubelet or containerd named (links
                # followed, as runc follows them), cloned in the host's
                # namespace; the target is opened in the server's, without
                # following any link.
                source_fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
                try:
                    if os.path.isdir(f"/proc/self/fd/{source_fd}") != directory:
                        raise ShareError(f"{source} changed between its look and its bind")
                    tree = mount.clone_tree(source_fd, readonly=readonly, private=not follow, slave=follow,
                                            recursive=recursive)
                finally:
                    os.close(source_fd)
                try:
                    mountns.run_inside(ns, lambda: _attach_at(tree, parent, name))
                finally:
                    os.close(tree)
                if recursive:
                    csi = [p for p in self._served_mounts_below(relative) if CSI_PLUGIN_DIR in p.split("/")]
                    if csi:
                        mountns.run_inside(ns, lambda: _detach_points(csi))
            return [p for p in self._served_mounts_below(relative) if p != "/" + relative]

    # -- containers --------------------------------------------------------------------

    def add_rootfs(self, container_id: str, rootfs: Path) -> str:
        """The container's root file system, where the guest finds it."""
        top = self._container_dir(container_id)
        make_dirs(top / "rootfs")
        self._bind(str(rootfs), top.name, "rootfs", readonly=False, directory=True)
        return self.guest_rootfs(container_id)

    def add_bind(self, source: str, readonly: bool, recursive: bool = False, follow: bool = False) -> SharedBind:
        """A host path a container of the pod binds, where the guest finds
        it: bound once per pod and mode (the same bind for every container).
        recursive: with the mounts below it (a CRI mount's rbind), those of
        CSI volumes' paths taken out; follow: a slave of the source, so the
        host's later mounts below it appear (HostToContainer propagation)."""
        make_dirs(self.writable / BINDS)
        mode = f"{'ro' if readonly else 'rw'},{'rbind' if recursive else 'bind'},{'rslave' if follow else 'rprivate'}"
        key = hashlib.sha256(f"{mode}\0{source}".encode()).hexdigest()[:32]
        submounts = self._bind(source, BINDS, key, readonly=readonly, directory=os.path.isdir(source),
                               recursive=recursive, follow=follow)
        return SharedBind(self.guest_bind(key), tuple(self.guest + point for point in submounts))

    def remove_container(self, container_id: str) -> None:
        """Its binds detached, its directory removed; again after any failure."""
        top = self._container_dir(container_id)
        if not top.exists():
            return
        self._detach_served(top.name)
        _detach_all(top)   # binds made on the host by an earlier release
        _remove_tree(top)


@dataclass(frozen=True)
class SharedBind:
    guest: str                     # where the guest finds it
    below: tuple[str, ...] = ()    # where the guest finds the mounts below it (a recursive bind's)

    @property
    def submounts(self) -> bool:
        """Mounts below it came along (a recursive bind of a tree that has some)."""
        return bool(self.below)


def _attach_at(tree: int, parent: str, name: str) -> None:
    """In the server's namespace (its root the share): tree onto parent/name."""
    parent_fd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        target_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        try:
            mount.attach_tree(tree, target_fd)
        finally:
            os.close(target_fd)
    finally:
        os.close(parent_fd)


def _detach_each(points: list[str], detach) -> None:
    """Each mount point of points (deepest first), every mount stacked
    there, by detach(the parent directory's descriptor, the name)."""
    for point in points:
        parent, name = os.path.split(point)
        try:
            fd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            while detach(fd, name):
                pass   # stacked mounts: each one
        finally:
            os.close(fd)


def _detach_points(points: list[str]) -> None:
    """In the server's namespace (no /proc there: the parent is reached as
    the thread's working directory)."""
    def detach_here(fd: int, name: str) -> bool:
        os.fchdir(fd)
        return mount.detach_in_cwd(name)

    _detach_each(points, detach_here)
    os.chdir("/")


def _mounts_below(path: Path) -> list[str]:
    """Mount points at or below path, deepest first (the whole table is
    read: a filtered read would miss a path the table escapes)."""
    top = os.path.normpath(str(path))
    points = [e.mount_point for e in mount.mounts()
              if e.mount_point == top or e.mount_point.startswith(top + "/")]
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def _detach_all(path: Path) -> None:
    _detach_each(_mounts_below(path), mount.detach_beneath)


def _remove_tree(path: Path) -> None:
    left = _mounts_below(path)
    if left:
        raise ShareError(f"{path} still has mounts below it ({', '.join(left[:3])}): not removed")
    if path.exists():
        shutil.rmtree(path)
