"""What `crust proxy`'s runtime endpoint refuses: planted symlinks, bad target paths, bad stage fields.

A real driver -> shim -> proxy stack (tests.harness.proxy_runtime_env). Symlinks
planted in the watched directories (for an entry, its mountInfo.json, the
Kata mirror, a runtime-cli) are never followed; a target path that is
relative, has '..', lies outside the kubelet root or under a symlink out of
it, holds a NUL, is huge or empty is INVALID_ARGUMENT for every runtime and
registry call, and nothing is written; a bad stage field is
INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import os
import stat

import grpc

from tests.harness.proxy_runtime_env import GIB, Req, env, failure, mode  # noqa: F401 - env: the stack fixture

Code = grpc.StatusCode


# -- symlinks -------------------------------------------------------------------------------


def test_planted_symlinks_are_never_followed(env):
    e = env()
    target = e.target("links")
    elsewhere = e.path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "decoy").write_text("keep me")
    kata_elsewhere = e.path / "kata-elsewhere"
    kata_elsewhere.mkdir()
    os.symlink(elsewhere, e.entry(target))
    os.symlink(kata_elsewhere, e.mirror(target))

    e.stage(target)
    for d in (e.entry(target), e.mirror(target)):
        assert stat.S_ISDIR(os.lstat(d).st_mode) and mode(d) == 0o700, f"{d} is not a real directory"
        assert os.listdir(d) == ["mountInfo.json"]
    assert os.listdir(elsewhere) == ["decoy"] and (elsewhere / "decoy").read_text() == "keep me"
    assert os.listdir(kata_elsewhere) == []

    # A symlink in place of mountInfo.json is replaced, its target untouched.
    f = e.entry(target) / "mountInfo.json"
    f.unlink()
    os.symlink(elsewhere / "decoy", f)
    e.stage(target, mount_flags=["noatime"])
    assert stat.S_ISREG(os.lstat(f).st_mode) and e.info(target)["options"] == ["noatime"]
    assert (elsewhere / "decoy").read_text() == "keep me"

    # A symlinked runtime-cli is ignored: the CLI never runs.
    ran = e.path / "cli-ran"
    cli = e.script("rt-cli", f'echo "$@" > {ran}\necho \'{{"usage": []}}\'\n')
    (e.path / "cli-path").write_text(str(cli))
    os.symlink(e.path / "cli-path", e.entry(target) / "runtime-cli")
    rsp = e.stats(target)
    assert not ran.exists(), "the proxy followed a symlinked runtime-cli"
    assert rsp.volume_condition.abnormal is False and "starting" in rsp.volume_condition.message

    # Unstage through a planted symlink removes the link, not what it points to.
    e.unstage(target)
    os.symlink(elsewhere, e.entry(target))
    e.stage(target)
    e.unstage(target)
    assert not os.path.lexists(e.entry(target)) and not os.path.lexists(e.mirror(target))
    assert os.listdir(elsewhere) == ["decoy"]


# -- bad input ------------------------------------------------------------------------------


def test_bad_target_paths_are_invalid_argument_and_write_nothing(env):
    e = env()
    kubelet = e.proxy.kubelet_root
    elsewhere = e.path / "elsewhere"
    elsewhere.mkdir()
    # Parent of the target is a symlink out of the kubelet root.
    parent = kubelet / "pods" / "p1" / "volumes" / "kubernetes.io~csi" / "pv1"
    parent.parent.mkdir(parents=True)
    os.symlink(elsewhere, parent)
    # An ancestor is a symlink out of the root and the directories below it do not exist yet.
    (kubelet / "pods").mkdir(exist_ok=True)
    os.symlink(elsewhere, kubelet / "pods" / "p2")
    bad = {
        "relative": "kubelet/pods/p/volumes/kubernetes.io~csi/pv/mount",
        "dotdot": f"{kubelet}/pods/p/../../../elsewhere/mount",
        "outside": str(elsewhere / "mount"),
        "the root itself": str(kubelet),
        "beside the root": f"{kubelet}-other/pods/p/mount",
        "parent symlink": str(parent / "mount"),
        "ancestor symlink": str(kubelet / "pods" / "p2" / "volumes" / "kubernetes.io~csi" / "pv2" / "mount"),
        "nul": f"{kubelet}/pods/p\x00/mount",
        "huge": f"{kubelet}/pods/" + "a" * 5000,
        "empty": "",
    }
    e.register("h")
    problems = []
    for why, path in bad.items():
        checks = [
            ("RuntimeStageVolume", "volume_target_path", lambda p=path: e.stage(p)),
            ("RuntimeUnstageVolume", "volume_target_path", lambda p=path: e.unstage(p)),
            ("RuntimeGetVolumeStats", "volume_target_path", lambda p=path: e.stats(p)),
            ("RuntimeExpandVolume", "volume_target_path", lambda p=path: e.expand(p, GIB)),
            ("ClaimVolume", "target_path", lambda p=path: e.claim(p, "h", "sb-1")),
            ("ReleaseVolume", "target_path", lambda p=path: e.release(p, "h", "sb-1")),
        ]
        for rpc, field, call in checks:
            try:
                call()
                problems.append(f"{rpc} accepted the {why} path")
                continue
            except grpc.RpcError as exc:
                if exc.code() != Code.INVALID_ARGUMENT or field not in exc.details():
                    problems.append(f"{rpc} {why}: {exc.code().name} {exc.details()!r}")
    assert not problems, "\n".join(problems)
    assert os.listdir(e.proxy.volumes_dir) == [] and os.listdir(e.proxy.kata_dir) == []
    assert not list((e.proxy.state_dir / "volumes").glob("*.json"))
    assert os.listdir(elsewhere) == []
    assert e.volumes() == {}


def test_bad_stage_fields_are_invalid_argument_naming_the_field(env):
    e = env()
    target = e.target("fields")
    cases = {
        "volume_backing_path": e.request(target, device="dev/loop3"),
        "fs_type": e.request(target, fs_type="ntfs"),
        "volume_type": Req(volume_type=Req.NETWORK, volume_target_path=target, volume_backing_path="/dev/x",
                           fs_type="ext4"),
        "mount_flags": e.request(target, mount_flags=["noatime,suid"]),
        "volume_supplemental_group": e.request(target, volume_supplemental_group="wheel"),
    }
    for field, request in cases.items():
        exc = failure(e.runtime.RuntimeStageVolume, request, timeout=10)
        assert exc.code() == Code.INVALID_ARGUMENT and field in exc.details(), (field, exc.details())
    assert os.listdir(e.proxy.volumes_dir) == [] and os.listdir(e.proxy.kata_dir) == []
