"""The one way crust reaches a path the CO gave it.

Target, staging and volume paths cross directories that pods and other users
can write (a pod's volume directories, a subpath). A daemon running as root
that follows a symlink planted there mounts a volume wherever the link points
(CVE-2021-25741 escaped to the host this way), or unmounts and removes the
wrong thing. So every mount, unmount, mkdir, rmdir, stat and placeholder of
the driver, the shim, the proxy and the handlers goes through CoPath:

1. The text is checked first (crust.common.csi_input.path): absolute,
   normalised, no NUL, no component over NAME_MAX, not over PATH_MAX.
2. The path is walked from "/" one component at a time, each opened with
   O_PATH|O_NOFOLLOW relative to the one before. A component that is a
   symlink is refused (INVALID_ARGUMENT naming the field), wherever it
   points: kubelet never puts a symlink in the paths it hands a plugin.
3. The parent directory stays open while the CoPath lives; the last
   component is created, opened, mounted on, unmounted and removed relative
   to that descriptor, never through the path string again, so nothing can
   swap the path between the check and the act.
4. A mount lands on the opened descriptor (crust.sys.mount). Afterwards the
   parent's path is read back from the kernel: if the directory was moved
   while we worked, the mount is undone and the request refused, so a
   refused publish leaves nothing behind.

The string path stays the key of records and of mountinfo look-ups: once
the walk holds, the string names the place the descriptors reach.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat

from crust.common import csi_input
from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.sys import mount as sysmount

_DIR_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
log = logging.getLogger(__name__)

# Directories crust creates on the way to a target (kubelet makes its own
# with 0750 too).
DIR_MODE = 0o750


class CoPath:
    """A CO path reached without following a symlink: its parent held open
    (parent_fd, None when an ancestor does not exist) and its last name."""

    def __init__(self, path: str, field: str, parent_fd: int | None, name: str, *, verify_place: bool = True):
        self.path = path
        self.field = field
        self.parent_fd = parent_fd
        self.name = name
        self._verify_place = verify_place

    # -- reaching ------------------------------------------------------------------------

    @classmethod
    def reach(cls, path: str, field: str, *, create_parents: bool = False, root_fd: int | None = None,
              checked: bool = False) -> "CoPath":
        """Walk to the parent of `path` (from root_fd instead of "/" when
        given: a sandbox's root seen from the host). create_parents makes
        missing directories on the way (never through a symlink)."""
        if not checked:
            path = csi_input.path(path, field)
        if path == "/":
            raise InvalidArgument(f"{field} must not be the root directory")
        *parents, name = path[1:].split("/")
        fd = os.open("/", _DIR_FLAGS) if root_fd is None else os.dup(root_fd)
        walked = ""
        try:
            for part in parents:
                walked += "/" + part
                nxt = cls._step(fd, part, path, field, walked, create_parents)
                os.close(fd)
                fd = nxt
                if fd is None:
                    break
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return cls(path, field, fd, name, verify_place=root_fd is None)

    @staticmethod
    def _step(fd: int, part: str, path: str, field: str, walked: str, create: bool) -> int | None:
        for _ in range(2):
            try:
                return os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    os.mkdir(part, DIR_MODE, dir_fd=fd)
                except FileExistsError:
                    pass  # made by someone else meanwhile: open it (never through a link)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    _refuse_kind(fd, part, path, field, walked)
                raise _os_error(exc, path, field)
        raise FailedPrecondition(f"{field} {path!r}: {walked} keeps vanishing while it is made")

    def close(self) -> None:
        if self.parent_fd is not None:
            os.close(self.parent_fd)
            self.parent_fd = None

    def __enter__(self) -> "CoPath":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- looking -----------------------------------------------------------------------------

    def lstat(self) -> os.stat_result | None:
        """The last component itself (a symlink is not followed); None when absent."""
        if self.parent_fd is None:
            return None
        try:
            return os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _os_error(exc, self.path, self.field)

    def refuse_symlink(self) -> os.stat_result | None:
        """lstat(), refusing a last component that is a symlink."""
        st = self.lstat()
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise InvalidArgument(f"{self.field} {self.path!r} is a symlink; refusing to follow it")
        return st

    @contextlib.contextmanager
    def opened(self):
        """An O_PATH descriptor of the last component (crossing a mount on
        it, never a symlink), closed on exit."""
        if self.parent_fd is None:
            raise FailedPrecondition(f"{self.field} {self.path!r} does not exist")
        try:
            fd = os.open(self.name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.parent_fd)
        except FileNotFoundError:
            raise FailedPrecondition(f"{self.field} {self.path!r} does not exist") from None
        except OSError as exc:
            raise _os_error(exc, self.path, self.field)
        try:
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise InvalidArgument(f"{self.field} {self.path!r} is a symlink; refusing to follow it")
            yield fd
        finally:
            os.close(fd)

    def mount_entry(self) -> sysmount.MountEntry | None:
        """The top mount on the last component, found by the mount id of
        what the descriptors reach, not by the path's text: a directory
        renamed meanwhile cannot hide a mount from us, nor lend us another."""
        st = self.refuse_symlink()
        if st is None:
            return None
        with self.opened() as fd:
            return sysmount.entry_if_not_on(fd, self.parent_fd)

    def statvfs(self) -> os.statvfs_result:
        with self.opened() as fd:
            return os.statvfs(fd)

    # -- making and removing ---------------------------------------------------------------

    def _need_parent(self) -> int:
        if self.parent_fd is None:
            raise FailedPrecondition(f"{self.field} {self.path!r}: its parent directory does not exist")
        return self.parent_fd

    def ensure_parents(self) -> None:
        """Make the missing directories above the last component (never
        through a link): the CO makes them, but a plugin may be asked first."""
        if self.parent_fd is None:
            fresh = CoPath.reach(self.path, self.field, create_parents=True, checked=True)
            self.parent_fd, fresh.parent_fd = fresh.parent_fd, None

    def mkdir(self, mode: int = DIR_MODE) -> bool:
        """Make the last component a directory; True if this call made it.
        An existing directory is fine, anything else is refused."""
        parent = self._need_parent()
        try:
            os.mkdir(self.name, mode, dir_fd=parent)
            return True
        except FileExistsError:
            st = self.refuse_symlink()
            if st is not None and not stat.S_ISDIR(st.st_mode):
                raise FailedPrecondition(f"{self.field} {self.path!r} exists and is not a directory")
            return False
        except OSError as exc:
            raise _os_error(exc, self.path, self.field)

    def make_file(self, mode: int = 0o600) -> bool:
        """Make the last component an empty regular file (the mount point of a
        raw block publish); True if this call made it."""
        parent = self._need_parent()
        try:
            fd = os.open(self.name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=parent)
            os.close(fd)
            return True
        except FileExistsError:
            st = self.refuse_symlink()
            if st is not None and stat.S_ISDIR(st.st_mode):
                raise FailedPrecondition(f"{self.field} {self.path!r} is a directory; a block volume needs a file")
            return False
        except OSError as exc:
            raise _os_error(exc, self.path, self.field)

    def remove(self) -> None:
        """Remove the last component (an empty directory or a file); absent is
        fine, a symlink is refused (crust never makes one), a directory that
        is not empty or still a mount point is FAILED_PRECONDITION."""
        st = self.refuse_symlink()
        if st is None:
            return
        try:
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(self.name, dir_fd=self.parent_fd)
            else:
                os.unlink(self.name, dir_fd=self.parent_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EBUSY):
                raise FailedPrecondition(f"{self.field} {self.path!r} cannot be removed: {exc.strerror}") from None
            raise _os_error(exc, self.path, self.field)

    def remove_after_failure(self) -> None:
        """Undo the directory or file a failed request made here; the
        request's own error is what the CO must see, so a failure to remove
        is logged, not raised."""
        try:
            self.remove()
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove what a failed request made",
                        extra={"fields": {"path": self.path, "error": str(exc)}})

    # -- mounting ----------------------------------------------------------------------------

    async def mount(self, source: str, fs_type: str, options: list[str] | None = None) -> None:
        """Mount a file system (a device, or a pseudo source such as tmpfs)
        onto the last component."""
        with self.opened() as fd:
            await sysmount.mount_fd(source, fd, fs_type, options)
        self._verify_in_place()

    def bind_from(self, source: "CoPath | str", *, readonly: bool = False) -> None:
        """Bind a CO path (reached the same way) or a path of our own (a
        device node) onto the last component; read-only from the start."""
        with self.opened() as target_fd:
            if isinstance(source, CoPath):
                with source.opened() as source_fd:
                    sysmount.bind_fd(source_fd, target_fd, readonly=readonly)
            else:
                source_fd = os.open(source, os.O_PATH | os.O_CLOEXEC)
                try:
                    sysmount.bind_fd(source_fd, target_fd, readonly=readonly)
                finally:
                    os.close(source_fd)
        self._verify_in_place()

    def unmount_all(self, limit: int = 64) -> int:
        """Unmount every mount stacked on the last component; returns how
        many were removed. A mount that is busy is FAILED_PRECONDITION."""
        self.refuse_symlink()
        if self.parent_fd is None:
            return 0
        count = 0
        try:
            while count < limit and sysmount.unmount_beneath(self.parent_fd, self.name):
                count += 1
        except OSError as exc:
            raise FailedPrecondition(f"{self.field} {self.path!r} cannot be unmounted: {exc.strerror}") from None
        return count

    def _verify_in_place(self) -> None:
        """After a mount: the parent must still be where the path says. A
        directory moved between the walk and the mount took the mount with
        it; undo it rather than leave a mount nobody asked for."""
        if not self._verify_place:
            return
        expected = os.path.dirname(self.path)
        actual = os.readlink(sysmount.fd_path(self.parent_fd))
        if actual != expected:
            try:
                sysmount.unmount_beneath(self.parent_fd, self.name)
            except OSError:
                pass  # busy already: the refusal below still tells the CO
            raise InvalidArgument(f"{self.field} {self.path!r} was moved while it was being mounted "
                                      f"(its directory is now at {actual!r}); the mount was undone")


def reach(path: str, field: str, **kw) -> CoPath:
    """CoPath.reach, for `with copath.reach(p, "target_path") as target:`."""
    return CoPath.reach(path, field, **kw)


def mounted_at(path: str, field: str) -> sysmount.MountEntry | None:
    """The top mount at a path crust recorded earlier (a target it
    published), found as CoPath.mount_entry finds it: for that one place,
    whatever else is mounted. None when nothing is mounted there, or when
    the path no longer leads there without crossing a symlink."""
    try:
        with CoPath.reach(path, field, checked=True) as at:
            return at.mount_entry()
    except (InvalidArgument, FailedPrecondition):
        return None


def refuse_links(path: str, field: str) -> None:
    """Refuse a checked path that is or crosses a symlink, for a caller that
    only hands it on (to a backend driver, into a record)."""
    with CoPath.reach(path, field, checked=True) as at:
        at.refuse_symlink()


def _refuse_kind(fd: int, part: str, path: str, field: str, walked: str) -> None:
    try:
        st = os.stat(part, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise InvalidArgument(f"{field} {path!r} crosses a symlink at {walked}; refusing to follow it")
    raise InvalidArgument(f"{field} {path!r}: {walked} is not a directory")


def _os_error(exc: OSError, path: str, field: str) -> Exception:
    """An OSError on the way, as the error the CO should see."""
    if exc.errno == errno.ENAMETOOLONG:
        return InvalidArgument(f"{field} {path!r} is too long for the file system")
    if exc.errno == errno.ELOOP:
        return InvalidArgument(f"{field} {path!r} is a symlink; refusing to follow it")
    return FailedPrecondition(f"{field} {path!r}: {exc.strerror or exc}")
