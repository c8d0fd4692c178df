"""Where a container's sources are in the guest (crust/guest/places.py,
crust/sys/beneath.py): subPaths opened below their volume by descriptors
while another container swaps names for symlinks in it, and
CreateContainer placing a container's root, binds and PID namespace from
what the host names (a share's path, the pod's tmpfs, a subpath), run on
the host beside a real crun (tests/harness/guest_container.py)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from crust.api import agent_pb2
from crust.common import ttrpc
from crust.guest.places import ROOT_RETIRE
from crust.kata.agent.client import AgentClient
from crust.sys.beneath import SubpathError, open_subpath
from tests.harness.guest_container import (  # noqa: F401 - pod_cgroup_cleaned: a fixture
    ContainerAgent, code_of, container_spec, crun_container_agent, crun_knows, pod_cgroup_cleaned)

pytestmark = pytest.mark.usefixtures("pod_cgroup_cleaned")


def _opened(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def test_a_subpath_never_leaves_its_volume_while_a_container_swaps_symlinks(tmp_path):
    """One thread swaps a directory of the volume for a symlink to / and
    back as fast as it can; every open of a subpath through it is below the
    volume or refused, never outside."""
    volume = tmp_path / "volume"
    (volume / "shared" / "deep").mkdir(parents=True)
    outside = tmp_path / "outside" / "deep"
    outside.mkdir(parents=True)
    stop = threading.Event()
    (volume / "link").symlink_to(tmp_path / "outside")
    libc = ctypes.CDLL(None, use_errno=True)
    swaps, failures = [0], []

    def swap():
        # renameat2(RENAME_EXCHANGE): "shared" is the directory or the link,
        # never missing (a missing name would be made by the lookup).
        while not stop.is_set():
            if libc.renameat2(-100, str(volume / "shared").encode(), -100, str(volume / "link").encode(), 2):
                failures.append(os.strerror(ctypes.get_errno()))
                return
            swaps[0] += 1

    swapper = threading.Thread(target=swap)
    swapper.start()
    seen: dict[str, int] = {}
    try:
        for _ in range(3000):
            try:
                path = _opened(open_subpath(str(volume), "shared/deep", strict=False))
            except SubpathError as exc:
                seen[exc.message] = seen.get(exc.message, 0) + 1
                continue
            seen[path] = seen.get(path, 0) + 1
    finally:
        stop.set()
        swapper.join()
    escaped = [p for p in seen if p.startswith(str(tmp_path / "outside"))]
    assert swaps[0] > 100 and not failures, (swaps, failures)
    assert not escaped, seen
    assert any(p.startswith(f"{volume}/") for p in seen), seen
    assert not (outside / "deep").exists()   # nothing made outside either


def test_a_subpath_is_made_with_the_volumes_mode_and_refused_where_kubelet_refuses(tmp_path):
    volume = tmp_path / "volume"
    volume.mkdir(mode=0o777)
    volume.chmod(0o2775)
    (volume / "file").write_text("x")
    (volume / "up").symlink_to("/")
    (volume / "inside").symlink_to("file")
    made = _opened(open_subpath(str(volume), "a/./b", strict=False))
    modes = [oct((volume / p).stat().st_mode & 0o7777) for p in ("a", "a/b")]
    refusals = {}
    for subpath, strict in (("up/etc", False), ("../x", False), ("/etc", False), ("inside", True),
                            ("missing", True), ("file/below", False)):
        with pytest.raises(SubpathError) as caught:
            open_subpath(str(volume), subpath, strict)
        refusals[(subpath, strict)] = (caught.value.message.split(": ", 1)[1], caught.value.leaves)
    assert made == str(volume / "a" / "b") and modes == ["0o2775", "0o2775"]
    assert _opened(open_subpath(str(volume), "inside", strict=False)) == str(volume / "file")
    assert refusals == {
        ("up/etc", False): ("resolves outside its volume", True),
        ("../x", False): ("must not contain '..'", True),
        ("/etc", False): ("must be a relative path", False),
        ("inside", True): ("goes through a symlink inside the volume", True),
        ("missing", True): ("does not exist in the volume", False),
        ("file/below", False): ("cannot be opened in its volume: Not a directory", False),
    }


def _in_agent(c: ContainerAgent, script: str) -> str:
    """A shell command in the agent's mount namespace (where the guest's
    mounts are)."""
    return subprocess.run(["nsenter", "-t", str(c.agent_pid), "-m", "sh", "-c", script], capture_output=True,
                          text=True, timeout=30, check=True).stdout


def _mounted(c: ContainerAgent, path: Path) -> bool:
    return subprocess.run(["nsenter", "-t", str(c.agent_pid), "-m", "mountpoint", "-q", str(path)],
                          timeout=30, check=False).returncode == 0


def _with_binds(c: ContainerAgent, container_id: str, destinations: list[str], *args: str) -> bytes:
    spec = json.loads(container_spec(c, container_id, *args))
    spec["root"]["path"] = ""
    spec["mounts"] += [{"destination": d, "type": "bind", "source": "", "options": ["rbind"]} for d in destinations]
    return json.dumps(spec).encode()


def test_create_container_places_the_root_binds_and_subpaths_from_named_sources(tmp_path):
    cid, refused = f"placed-{os.getpid()}", f"refused-{os.getpid()}"
    run = tmp_path / "run"
    share = tmp_path / "share-source"
    (share / "config").mkdir(parents=True)
    (share / "config" / "greeting").write_text("hello from the share\n")
    (share / "config" / "below").mkdir()

    async def main(c: ContainerAgent):
        # The share as the guest sees it (a mount at its place), with a mount
        # of the host below one of its binds.
        _in_agent(c, f"mkdir -p {run}/share && mount --bind {share} {run}/share && ln -s / {run}/share/config/up "
                     f"&& mount --bind {c.state.parent / 'bundle'} {run}/share/config/below")
        client = await AgentClient.connect(str(c.socket))
        try:
            details = await client.call("GetGuestDetails", agent_pb2.GuestDetailsRequest(), timeout=10)
            shares = [await code_of(client.call("MountShare", agent_pb2.MountShareRequest(tag=tag), timeout=10))
                      for tag in ("crust", "other")]
            tmpfs = await client.call("MountPodTmpfs", agent_pb2.MountPodTmpfsRequest(name="scratch",
                                                                                    size_bytes=1 << 20), timeout=10)
            resized = await client.call("MountPodTmpfs", agent_pb2.MountPodTmpfsRequest(name="scratch",
                                                                                     size_bytes=2 << 20), timeout=10)
            _in_agent(c, f"mkdir -p {tmpfs.mount_point}/kept && echo old > {tmpfs.mount_point}/kept/note && "
                         f"ln -s / {tmpfs.mount_point}/escape")
            bundle = agent_pb2.SharePath(tag="crust", path="config/below")
            create = agent_pb2.CreateContainerRequest(
                container_id=cid, stdin=False, pod_pid_namespace=True,
                oci_spec=_with_binds(c, cid, ["/config", "/work", "/kept"], "sh", "-c",
                                     "cat /config/greeting /kept/note; echo new > /work/made; ls /work; readlink /proc/self/ns/pid"),
                rootfs=agent_pb2.Source(share=bundle, subpath="rootfs"),
                binds=[agent_pb2.Bind(mount_index=len(c.spec["mounts"]), readonly=True, source=agent_pb2.Source(
                           share=agent_pb2.SharePath(tag="crust", path="config", submounts=["below"]))),
                       agent_pb2.Bind(mount_index=len(c.spec["mounts"]) + 1, source=agent_pb2.Source(
                           pod_tmpfs="scratch", subpath="a/b")),
                       agent_pb2.Bind(mount_index=len(c.spec["mounts"]) + 2, source=agent_pb2.Source(
                           pod_tmpfs="scratch", subpath="kept", strict=True))])
            pid = (await client.call("CreateContainer", create, timeout=30)).pid
            subpaths = sorted(os.listdir(run / "subpath" / cid))
            await client.call("StartContainer", agent_pb2.StartContainerRequest(container_id=cid), timeout=30)
            key = {"container_id": cid, "exec_id": ""}
            exit_ = await client.call("WaitProcess", agent_pb2.WaitProcessRequest(**key), timeout=30)
            out = await client.call("ReadStdout", agent_pb2.ReadStreamRequest(max_bytes=1000, **key), timeout=10)
            err = await client.call("ReadStderr", agent_pb2.ReadStreamRequest(max_bytes=1000, **key), timeout=10)
            written = _in_agent(c, f"cat {tmpfs.mount_point}/a/b/made")
            pod_pid = (run / "podpid").read_text().strip()
            pod_ns = os.readlink(f"/proc/{pod_pid}/ns/pid")
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=cid), timeout=30)
            dropped = not (run / "subpath" / cid).exists()

            # A root that is a mount of the share (as a container's root is a
            # submount in the guest): unmounted in the agent's namespace only
            # a while after the container's removal.
            rooted = f"rooted-{os.getpid()}"
            _in_agent(c, f"mkdir -p {run}/share/root-{rooted} && "
                         f"mount --bind {c.state.parent / 'bundle' / 'rootfs'} {run}/share/root-{rooted}")
            await client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=rooted, oci_spec=_with_binds(c, rooted, [], "true"),
                rootfs=agent_pb2.Source(share=agent_pb2.SharePath(tag="crust", path=f"root-{rooted}"))), timeout=30)
            await client.call("RemoveContainer", agent_pb2.RemoveContainerRequest(container_id=rooted), timeout=30)
            root_mounted = [_mounted(c, run / "share" / f"root-{rooted}")]
            await asyncio.sleep(ROOT_RETIRE + 1)
            root_mounted.append(_mounted(c, run / "share" / f"root-{rooted}"))

            # A subpath through a link out of the tmpfs is refused, naming the
            # bind; nothing of the container is left.
            escape = await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=refused, oci_spec=_with_binds(c, refused, ["/x"], "true"),
                rootfs=agent_pb2.Source(share=bundle, subpath="rootfs"),
                binds=[agent_pb2.Bind(mount_index=len(c.spec["mounts"]), source=agent_pb2.Source(
                    pod_tmpfs="scratch", subpath="escape/etc"))]), timeout=30))
            left = (run / "subpath" / refused).exists() or crun_knows(c, refused)
            wrong = [await code_of(client.call("CreateContainer", agent_pb2.CreateContainerRequest(
                container_id=refused, oci_spec=_with_binds(c, refused, ["/x"], "true"),
                rootfs=agent_pb2.Source(share=bundle, subpath="rootfs"), binds=binds), timeout=30))
                for binds in (
                    [agent_pb2.Bind(mount_index=0, source=agent_pb2.Source(pod_tmpfs="scratch"))],   # /proc
                    [agent_pb2.Bind(mount_index=len(c.spec["mounts"]),
                                    source=agent_pb2.Source(pod_tmpfs="missing"))],
                    [agent_pb2.Bind(mount_index=len(c.spec["mounts"]), source=agent_pb2.Source(
                        share=agent_pb2.SharePath(tag="crust", path="config/up")))],
                    [agent_pb2.Bind(mount_index=len(c.spec["mounts"]), source=agent_pb2.Source(
                        share=agent_pb2.SharePath(tag="other", path="config")))],
                    [agent_pb2.Bind(mount_index=len(c.spec["mounts"]), source=agent_pb2.Source(
                        volume_id="never-mounted"))])]
            return details, tmpfs, resized, pid, subpaths, exit_, out, err, written, pod_pid, pod_ns, dropped, \
                escape, left, wrong, root_mounted, shares
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        (details, tmpfs, resized, pid, subpaths, exit_, out, err, written, pod_pid, pod_ns, dropped, escape, left,
         wrong, root_mounted, shares) = asyncio.run(main(c))
    n = len(c.spec["mounts"])
    assert {"container.oci", "container.pod-pid", "tmpfs.pod", "subpath.beneath"} <= set(details.capabilities)
    # The share's place holds another file system (here a bind): refused, not mounted over.
    assert shares[0][0] == ttrpc.FAILED_PRECONDITION and "already" in shares[0][1], shares
    assert shares[1] == (ttrpc.INVALID_ARGUMENT, "tag: 'other' is not one of crust's shares (crust, crust-live)")
    assert (tmpfs.mount_point, tmpfs.size_bytes, resized.size_bytes) == (str(run / "podtmpfs" / "scratch"),
                                                                        1 << 20, 2 << 20)
    # The rootfs's subpath at the index after the spec's mounts, each bind's at its mount's.
    assert pid > 0 and subpaths == sorted(str(i) for i in (n + 1, n + 2, n + 3)), subpaths
    assert (exit_.exit_code, err.data) == (0, b""), err.data
    assert out.data == f"hello from the share\nold\nmade\n{pod_ns}\n".encode()
    assert pod_ns != os.readlink("/proc/self/ns/pid")
    assert written == "new\n" and dropped and root_mounted == [True, False]
    assert escape[0] == ttrpc.INVALID_ARGUMENT and escape[1] == \
        "binds[0].source.subpath: subpath escape/etc: resolves outside its volume", escape
    assert not left
    assert [code for code, _ in wrong] == [ttrpc.INVALID_ARGUMENT, ttrpc.NOT_FOUND, ttrpc.INVALID_ARGUMENT,
                                           ttrpc.INVALID_ARGUMENT, ttrpc.NOT_FOUND], wrong
    assert wrong[0][1].startswith("binds[0].mount_index: 0 is not a bind mount"), wrong
    assert wrong[4][1].startswith("binds[0].source.volume_id: 'never-mounted' is not mounted"), wrong
    assert _ended(int(pod_pid))   # the pod's init ends with the agent


def _ended(pid: int) -> bool:
    """Whether pid is gone or a zombie (its new parent reaps it in its own time)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_source_is_bound_at_a_path_of_the_guest_for_its_own_process(tmp_path):
    """BindGuestPath (a sandbox's own process, outside any container): the
    pod's tmpfs's subPath opened below it and bound at the target; a retry
    is OK, another source there ALREADY_EXISTS, a subPath through a link
    and a target in the agent's places are refused by field; Unbind undoes
    it, twice."""
    view, other = tmp_path / "views" / "data", tmp_path / "views" / "other"

    async def main(c: ContainerAgent):
        client = await AgentClient.connect(str(c.socket))
        try:
            await client.call("MountPodTmpfs", agent_pb2.MountPodTmpfsRequest(name="t", size_bytes=1 << 20),
                              timeout=10)
            tmpfs = tmp_path / "run" / "podtmpfs" / "t"
            _in_agent(c, f"mkdir -p {tmpfs}/sub {tmpfs}/else && echo in-sub > {tmpfs}/sub/f && "
                         f"ln -s / {tmpfs}/link")

            def bind(subpath: str, target: Path, readonly: bool = True):
                return client.call("BindGuestPath", agent_pb2.BindGuestPathRequest(
                    source=agent_pb2.Source(pod_tmpfs="t", subpath=subpath, strict=True), target=str(target),
                    readonly=readonly), timeout=10)
            await bind("sub", view)
            await bind("sub", view)   # a retry
            seen = _in_agent(c, f"cat {view}/f; touch {view}/new 2>&1 || true")
            taken = await code_of(bind("else", view))
            through_link = await code_of(bind("link", other))
            reserved = await code_of(client.call("BindGuestPath", agent_pb2.BindGuestPathRequest(
                source=agent_pb2.Source(pod_tmpfs="t"), target="/run/crust/x"), timeout=10))
            await client.call("UnbindGuestPath", agent_pb2.UnbindGuestPathRequest(target=str(view)), timeout=10)
            await client.call("UnbindGuestPath", agent_pb2.UnbindGuestPathRequest(target=str(view)), timeout=10)
            return seen, taken, through_link, reserved, _mounted(c, view), _mounted(c, other)
        finally:
            await client.close()

    with crun_container_agent(tmp_path) as c:
        seen, taken, through_link, reserved, view_mounted, other_mounted = asyncio.run(main(c))
    assert seen.startswith("in-sub\n") and "Read-only file system" in seen, seen
    assert taken[0] == ttrpc.ALREADY_EXISTS and taken[1].startswith("target: "), taken
    assert through_link[0] == ttrpc.INVALID_ARGUMENT and "symlink" in through_link[1], \
        through_link
    assert reserved[0] == ttrpc.INVALID_ARGUMENT and reserved[1].startswith("target: /run/crust/x is below")
    assert not view_mounted and not other_mounted
