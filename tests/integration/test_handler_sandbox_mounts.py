"""How `crust handler` mounts a deferred volume into a pod sandbox.

Real driver -> shim -> proxy processes and a real handler
(tests.harness.handler_env); a sandbox runs with `crust sandbox run` on an OCI
bundle whose mounts name the CSI target path. Checked here: the file
system is mounted in the sandbox's mount namespace only, never on the host,
whose target keeps the read-only placeholder; subpath mounts show only
their directory and refuse '..' and symlinks; several containers' mounts of
one volume share one mount of the file system; a single-writer volume
refuses a second sandbox; fsGroup is applied with the Always and
OnRootMismatch policies. What is asserted is what the kernel says: the
host's and the holder's /proc/<pid>/mountinfo, files seen through
/proc/<pid>/root, the JSON of `crust sandbox`, and the proxy's claims.
"""

from __future__ import annotations

import os
import stat

import grpc
import pytest

from crust.sys import mount as sysmount
from tests.harness.handler_env import Env, Vol, entries_of, env, make_env, rootfs_of, view  # noqa: F401 - fixtures
from tests.harness.daemons import pid_alive, wait_until

Code = grpc.StatusCode
GROUP_BITS = stat.S_IRGRP | stat.S_IWGRP | stat.S_IXGRP | stat.S_ISGID


# -- a running sandbox -----------------------------------------------------------------------


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_the_file_system_is_mounted_only_in_the_sandbox(env, fs):
    v = env.volume("pv-run", fs)
    bundle = env.bundle("run", "echo from-sandbox > /data/hello.txt && exec sleep 600",
                        [("/data", str(v.target))])
    info = env.run_ok(bundle, "sb-run")
    (volume,) = info["volumes"]
    assert (volume["target_path"], volume["device"], volume["fs_type"], volume["destinations"]) == \
        (str(v.target), v.device, fs, ["/data"])
    mount_point = volume["mount_point"]

    # The file system: in the holder's mount table (the sandbox-private mount
    # point and the container's /data), never in the host's.
    in_sandbox = entries_of(info["pid"], v.majmin)
    assert sorted(e.mount_point for e in in_sandbox) == sorted([mount_point, rootfs_of(bundle) + "/data"])
    assert all(e.fs_type == fs and not e.readonly for e in in_sandbox)
    assert entries_of("self", v.majmin) == []

    # The process's file: through the sandbox, not on the host's target,
    # which still holds only the empty read-only placeholder.
    written = view(info, mount_point) / "hello.txt"
    wait_until(written.exists, what="the sandbox process's file")
    assert written.read_text() == "from-sandbox\n"
    assert (view(info, rootfs_of(bundle)) / "data" / "hello.txt").read_text() == "from-sandbox\n"
    assert os.listdir(v.target) == []
    placeholder = sysmount.at(str(v.target))
    assert placeholder.fs_type == "tmpfs" and placeholder.readonly
    assert os.listdir(mount_point) == [], "the host sees the sandbox's mount point as an empty directory"
    assert pid_alive(info["process_pid"])

    # The claim names the sandbox and its holder.
    (claim,) = env.claims()
    assert (claim.target_path, claim.handler, claim.sandbox_id, claim.sandbox_pid) == \
        (str(v.target), "mountns", "sb-run", info["pid"])

    # While held, kubelet's unpublish is told to retry.
    with pytest.raises(grpc.RpcError) as exc:
        env.unpublish(v)
    assert exc.value.code() == Code.UNAVAILABLE and "sb-run" in exc.value.details()

    env.delete("sb-run")
    assert not pid_alive(info["pid"]) and not pid_alive(info["process_pid"])
    assert env.mounting(v) == []
    assert env.claims() == [] and env.sandboxes() == {}
    env.unpublish(v)
    env.publish_on_host(v)
    assert (v.target / "hello.txt").read_text() == "from-sandbox\n"
    env.unpublish(v)


# -- subpaths -----------------------------------------------------------------------------------


def assert_nothing_left(env: Env, v: Vol) -> None:
    assert env.sandboxes() == {}
    assert env.claims() == []
    assert env.holders() == []
    assert env.mounting(v) == []
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(str(env.path / "bundles"))] == []


def test_subpaths_show_only_their_directory_and_escapes_are_refused(env):
    v = env.create("pv-sub")
    # A host publish lays the volume out: a deep directory, a file at the
    # top, a symlink out of the volume and a symlink inside it.
    env.publish_on_host(v)
    (v.target / "sub" / "dir").mkdir(parents=True)
    (v.target / "sub" / "dir" / "inner").write_text("deep\n")
    (v.target / "top").write_text("top\n")
    (v.target / "link").symlink_to("/etc")
    (v.target / "sub" / "lnk").symlink_to("dir")
    env.unpublish(v)
    env.publish_deferred(v)

    bundle = env.bundle("sub", "echo new > /sub/new && exec sleep 600", [("/sub", f"{v.target}/sub/dir")])
    info = env.run_ok(bundle, "sb-sub")
    (volume,) = info["volumes"]
    assert volume["destinations"] == ["/sub"] and volume["subpaths"] == ["sub/dir"]
    dest = view(info, rootfs_of(bundle) + "/sub")
    wait_until((dest / "new").exists, what="the sandbox process's file")
    assert sorted(os.listdir(dest)) == ["inner", "new"]
    assert (dest / "inner").read_text() == "deep\n"
    (bound,) = [e for e in entries_of(info["pid"], v.majmin) if e.mount_point == rootfs_of(bundle) + "/sub"]
    assert bound.root == "/sub/dir"
    assert (view(info, volume["mount_point"]) / "sub" / "dir" / "new").read_text() == "new\n"
    assert entries_of("self", v.majmin) == []
    env.delete("sb-sub")
    assert_nothing_left(env, v)

    # '..' is refused before anything is touched.
    for i, source in enumerate([f"{v.target}/sub/../top", f"{v.target}/sub/dir/../../..", f"{v.target}/.."]):
        out = env.run(env.bundle(f"dots-{i}", "exec sleep 600", [("/x", source)]), f"sb-dots-{i}")
        assert out.returncode != 0 and "INVALID_ARGUMENT" in out.stderr and "'..'" in out.stderr, out.stderr
        assert_nothing_left(env, v)

    # A symlink on the way, out of the volume or inside it, is refused, and
    # the refused sandbox is undone (unmounted, released, holder gone).
    for i, source in enumerate([f"{v.target}/link", f"{v.target}/link/passwd", f"{v.target}/sub/lnk/inner"]):
        out = env.run(env.bundle(f"link-{i}", "exec sleep 600", [("/x", source)]), f"sb-link-{i}")
        assert out.returncode != 0 and "INVALID_ARGUMENT" in out.stderr and "symlink" in out.stderr, out.stderr
        assert_nothing_left(env, v)

    env.unpublish(v)


# -- several mounts of one volume -------------------------------------------------------------


def test_two_containers_share_one_mount_of_the_volume(env):
    v = env.volume("pv-shared", "xfs")
    # /c: a third, read-only view of the same volume.
    script = ("echo shared > /a/x && cat /b/x > /b/copy && "
              "if echo no > /c/y; then echo c-writable > /a/bad; fi; cat /c/x > /a/from-c; exec sleep 600")
    bundle = env.bundle("shared", script, [("/a", str(v.target)), ("/b", str(v.target)),
                                           ("/c", str(v.target), ["rbind", "ro"])])
    info = env.run_ok(bundle, "sb-shared")
    (volume,) = info["volumes"]
    assert volume["destinations"] == ["/a", "/b", "/c"]
    from_c = view(info, rootfs_of(bundle)) / "a" / "from-c"  # written last
    wait_until(lambda: from_c.exists() and from_c.read_text(), what="the copy read via /c")
    assert from_c.read_text() == "shared\n"
    assert (view(info, rootfs_of(bundle)) / "b" / "copy").read_text() == "shared\n"
    assert not (view(info, volume["mount_point"]) / "bad").exists()
    assert not (view(info, volume["mount_point"]) / "y").exists()
    # One mount of the file system plus its views.
    entries = {e.mount_point: e for e in entries_of(info["pid"], v.majmin)}
    assert sorted(entries) == sorted([volume["mount_point"]] + [rootfs_of(bundle) + d for d in ("/a", "/b", "/c")])
    assert all(e.root == "/" for e in entries.values())
    assert [p for p, e in entries.items() if e.readonly] == [rootfs_of(bundle) + "/c"]
    assert entries_of("self", v.majmin) == []
    env.delete("sb-shared")
    assert env.mounting(v) == [] and env.claims() == []
    env.unpublish(v)


# -- one writer ------------------------------------------------------------------------------------


def test_a_second_sandbox_on_a_single_writer_volume_is_refused(env):
    v = env.volume("pv-single")
    a = env.run_ok(env.bundle("a", "exec sleep 600", [("/data", str(v.target))]), "sb-a")
    bundle_b = env.bundle("b", "exec sleep 600", [("/data", str(v.target))])
    out = env.run(bundle_b, "sb-b")
    assert out.returncode != 0
    assert "FAILED_PRECONDITION" in out.stderr and "sandbox sb-a" in out.stderr, out.stderr
    # B left nothing: no sandbox, no claim, no holder, no mount.
    assert list(env.sandboxes()) == ["sb-a"]
    assert env.claim_set() == {(str(v.target), "mountns", "sb-a")}
    assert env.holders() == [a["pid"]]
    assert set(env.mounting(v)) == {a["pid"], a["process_pid"]}
    assert len(entries_of(a["pid"], v.majmin)) == 2
    assert [m for m in sysmount.mounts() if m.mount_point.startswith(str(bundle_b))] == []
    env.delete("sb-a")
    # Once A is gone, B may run.
    b = env.run_ok(bundle_b, "sb-b")
    assert set(env.mounting(v)) == {b["pid"], b["process_pid"]}
    env.delete("sb-b")
    env.unpublish(v)


# -- fsGroup -------------------------------------------------------------------------------------


def test_fs_group_always_and_on_root_mismatch(env):
    v = env.volume("pv-group", group="2000", policy="Always")
    assert env.entry(v)["metadata"] == {"fsGroup": "2000", "fsGroupChangePolicy": "Always"}
    script = ("echo new > /data/new && mkdir /data/d && echo o > /data/d/other && "
              "chgrp 0 /data/d/other && chmod 0600 /data/d/other")
    info = env.run_ok(env.bundle("group-1", script, [("/data", str(v.target))]), "sb-group-1")
    env.wait_exited("sb-group-1")
    vroot = view(info, info["volumes"][0]["mount_point"])
    st = os.stat(vroot)
    assert st.st_gid == 2000 and st.st_mode & GROUP_BITS == GROUP_BITS
    assert os.stat(vroot / "lost+found").st_gid == 2000, "Always walks the whole tree"
    assert os.stat(vroot / "new").st_gid == 2000, "a file the process creates inherits the group"
    assert os.stat(vroot / "d").st_gid == 2000 and os.stat(vroot / "d").st_mode & stat.S_ISGID
    other = os.stat(vroot / "d" / "other")
    assert (other.st_gid, stat.S_IMODE(other.st_mode)) == (0, 0o600)
    env.delete("sb-group-1")
    env.unpublish(v)

    # OnRootMismatch: the root already has the group and the permissions,
    # so the file with another group is left alone.
    env.publish_deferred(v, group="2000", policy="OnRootMismatch")
    assert env.entry(v)["metadata"] == {"fsGroup": "2000", "fsGroupChangePolicy": "OnRootMismatch"}
    info = env.run_ok(env.bundle("group-2", "ls -ln /data/d", [("/data", str(v.target))]), "sb-group-2")
    env.wait_exited("sb-group-2")
    vroot = view(info, info["volumes"][0]["mount_point"])
    assert os.stat(vroot).st_gid == 2000
    other = os.stat(vroot / "d" / "other")
    assert (other.st_gid, stat.S_IMODE(other.st_mode)) == (0, 0o600)
    env.delete("sb-group-2")
    env.unpublish(v)

    # Always changes it.
    env.publish_deferred(v, group="2000", policy="Always")
    info = env.run_ok(env.bundle("group-3", "true", [("/data", str(v.target))]), "sb-group-3")
    vroot = view(info, info["volumes"][0]["mount_point"])
    other = os.stat(vroot / "d" / "other")
    assert other.st_gid == 2000 and stat.S_IMODE(other.st_mode) == 0o660
    env.delete("sb-group-3")
    env.unpublish(v)

    # OnRootMismatch on a fresh volume (root group 0): the tree is walked.
    w = env.volume("pv-group-fresh", group="2000", policy="OnRootMismatch")
    info = env.run_ok(env.bundle("group-4", "echo x > /data/f", [("/data", str(w.target))]), "sb-group-4")
    env.wait_exited("sb-group-4")
    vroot = view(info, info["volumes"][0]["mount_point"])
    st = os.stat(vroot)
    assert st.st_gid == 2000 and st.st_mode & GROUP_BITS == GROUP_BITS
    assert os.stat(vroot / "lost+found").st_gid == 2000 and os.stat(vroot / "f").st_gid == 2000
    env.delete("sb-group-4")
    env.unpublish(w)
