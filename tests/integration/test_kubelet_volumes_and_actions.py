"""kubelet's parts crust replays (crust.kubelet), on their own: no
containerd, no container. The atomic writer's layout and its switch of
versions (also the pod-spec renderer's configMap layout), the volume
manager refusing what kubelet refuses (a hostPath of the wrong type, a
missing key, a subPath that leaves its volume) and never deleting through
a mount at tear-down, and computePodActions for init containers and
sidecars on statuses made up.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from crust.api import cri_pb2 as cri
from crust.kubelet import (
    ConfigMap,
    Container,
    DownwardAPI,
    DownwardAPIFile,
    EmptyDir,
    HostPath,
    KeyToPath,
    Pod,
    Secret,
    VolumeError,
    VolumeManager,
    VolumeMount,
)
from crust.kubelet.atomic_writer import AtomicWriter, FileProjection, PayloadError
from crust.kubelet.pod_actions import PodStatus, compute_pod_actions
from crust.sys import mount as sysmount
from tests.harness.pod_nodes import MiB, mounts_below


def test_the_atomic_writer_lays_out_and_switches_versions_as_kubelet(tmp_path):
    writer = AtomicWriter(tmp_path)
    assert writer.write({"a": FileProjection(b"one", 0o644), "dir/b": FileProjection(b"two", 0o400)})
    first = os.readlink(tmp_path / "..data")
    assert first.startswith("..") and first[2:6].isdigit() and first.split(".")[-1].isdigit()
    assert stat.S_IMODE(os.stat(tmp_path / first).st_mode) == 0o755
    assert os.readlink(tmp_path / "a") == "..data/a" and os.readlink(tmp_path / "dir") == "..data/dir"
    assert (tmp_path / "dir" / "b").read_bytes() == b"two"
    assert stat.S_IMODE(os.stat(tmp_path / first / "dir" / "b").st_mode) == 0o400
    # The same bytes again: no new version.
    assert not writer.write({"a": FileProjection(b"one", 0o644), "dir/b": FileProjection(b"two", 0o400)})
    assert os.readlink(tmp_path / "..data") == first
    # An update: a new version, the dropped name's link and the old version gone.
    assert writer.write({"a": FileProjection(b"three", 0o644)})
    second = os.readlink(tmp_path / "..data")
    assert second != first and not (tmp_path / first).exists() and not os.path.lexists(tmp_path / "dir")
    assert (tmp_path / "a").read_bytes() == b"three"
    assert sorted(os.listdir(tmp_path)) == sorted(["..data", second, "a"])
    for bad, wording in (("/abs", "must be relative"), ("x/../y", "must not contain '..'"),
                         ("..hidden", "must not start with '..'"), ("", "must not be empty")):
        with pytest.raises(PayloadError, match=wording):
            writer.write({bad: FileProjection(b"", 0o644)})
    assert os.readlink(tmp_path / "..data") == second


def test_the_configmap_layout_of_the_pod_spec_renderer_is_the_atomic_writers(tmp_path):
    from tests.harness.podspec import PodContext, config_map_volume

    ctx = PodContext(pod_name="p", namespace="default", node_name="n", workdir=tmp_path, host_path=Path)
    directory = config_map_volume("cfg", {"data": {"node.yaml": "a: 1\n"}}, ctx)
    assert directory == tmp_path / "volumes" / "kubernetes.io~configmap" / "cfg"
    assert os.readlink(directory / "node.yaml") == "..data/node.yaml"
    assert (directory / "node.yaml").read_text() == "a: 1\n"


def test_volume_set_up_refuses_what_kubelet_refuses(tmp_path):
    manager = VolumeManager(tmp_path / "kubelet", allocatable_memory=64 * MiB)
    missing = tmp_path / "missing"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [(HostPath(str(missing), "Directory"), f"hostPath type check failed: {missing} is not a directory"),
             (HostPath(str(tmp_path), "File"), f"hostPath type check failed: {tmp_path} is not a file"),
             (HostPath(str(a_file), "Socket"), f"{a_file} is not a socket file"),
             (HostPath(str(tmp_path / ".." / "x")), "must not contain '..'"),
             (HostPath(str(tmp_path), "Folder"), "Folder is an invalid volume type"),
             (ConfigMap(data={"k": "v"}, items=[KeyToPath("other", "o")]), "non-existent config key: other"),
             (Secret(data={}, items=[KeyToPath("pw", "pw")]), "references non-existent secret key: pw"),
             (DownwardAPI(items=[DownwardAPIFile("n", "spec.nodeName")]), "unsupported fieldPath: spec.nodeName"),
             (EmptyDir(medium="HugePages"), 'unknown storage medium "HugePages"')]
    for index, (source, wording) in enumerate(cases):
        pod = Pod(uid=f"u{index}", name=f"p{index}", volumes={"v": source})
        with pytest.raises(VolumeError, match='MountVolume.SetUp failed for volume "v"') as refused:
            manager.set_up(pod)
        assert wording in str(refused.value), str(refused.value)
        manager.tear_down(pod)
        assert manager.clean_pod_dir(pod)
    assert not missing.exists() and a_file.read_text() == "x"
    assert mounts_below(tmp_path) == []


def test_a_sub_path_leaving_the_volume_is_refused(tmp_path):
    manager = VolumeManager(tmp_path / "kubelet")
    outside = tmp_path / "outside"
    outside.mkdir()
    pod = Pod(uid="u-sub", name="sub", volumes={"work": EmptyDir()})
    manager.set_up(pod)
    (manager.path(pod, "work") / "escape").symlink_to(outside)
    app = Container("app", "img")
    for sub_path, wording in (("../x", "must not contain '..'"), ("/etc", "must not be an absolute path"),
                              ("escape", 'failed to prepare subPath for volumeMount "work" of container "app"')):
        with pytest.raises(VolumeError, match="SubPath|subPath") as refused:
            manager.mount_source(pod, app, 0, VolumeMount("work", "/w", sub_path=sub_path))
        assert wording in str(refused.value)
    assert mounts_below(tmp_path) == [] and list(outside.iterdir()) == []
    manager.tear_down(pod)
    assert manager.clean_pod_dir(pod)


def test_tear_down_never_deletes_through_a_mount(tmp_path):
    """Something mounted inside an emptyDir (not by kubelet) stops its
    removal: the error names it, and what it holds is left alone."""
    manager = VolumeManager(tmp_path / "kubelet")
    pod = Pod(uid="u-td", name="td", volumes={"scratch": EmptyDir()})
    manager.set_up(pod)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("keep me")
    inside = manager.path(pod, "scratch") / "bound"
    inside.mkdir()
    sysmount.mount_path(str(precious), str(inside), "bind", ["bind"])
    try:
        with pytest.raises(VolumeError, match="it is a mount point"):
            manager.tear_down(pod)
        assert (precious / "keep").read_text() == "keep me"
    finally:
        sysmount.unmount_all(str(inside))
    manager.tear_down(pod)
    assert manager.clean_pod_dir(pod) and (precious / "keep").read_text() == "keep me"


def _status(name: str, state: int, exit_code: int = 0, created: int = 1) -> cri.ContainerStatus:
    return cri.ContainerStatus(id=f"id-{name}", metadata=cri.ContainerMetadata(name=name), state=state,
                               exit_code=exit_code, created_at=created)


def test_init_container_actions_follow_kubelet():
    """computePodActions on statuses made up: one init container at a time,
    sidecars started in order and kept running, a failure restarts the init
    container unless the policy is Never, which kills the pod."""
    pod = Pod(uid="u", name="p", restart_policy="Always", containers=[Container("app", "img")],
              init_containers=[Container("setup", "img"), Container("proxy", "img", restart_policy="Always"),
                               Container("migrate", "img")])
    ready = cri.PodSandboxStatus(id="sb", state=cri.SANDBOX_READY)

    def actions(*statuses, sandboxes=(ready,)):
        found = compute_pod_actions(pod, PodStatus(sandboxes=list(sandboxes), containers=list(statuses)))
        return ([c.name for c in found.init_to_start], [c.name for c in found.containers_to_start],
                found.kill_pod, found.initialized)

    R, E = cri.CONTAINER_RUNNING, cri.CONTAINER_EXITED
    assert compute_pod_actions(pod, PodStatus()).create_sandbox
    assert actions(sandboxes=()) == (["setup"], [], False, False)
    assert actions() == (["setup"], [], False, False)
    assert actions(_status("setup", R)) == ([], [], False, False)
    assert actions(_status("setup", E)) == (["proxy"], [], False, False)
    assert actions(_status("setup", E), _status("proxy", R)) == (["migrate"], [], False, False)
    assert actions(_status("setup", E, 1)) == (["setup"], [], False, False)
    assert actions(_status("setup", E), _status("proxy", R), _status("migrate", E)) == ([], ["app"], False, True)
    # Initialized: an exited sidecar starts again, the other init containers stay done.
    assert actions(_status("setup", E), _status("proxy", E), _status("migrate", E), _status("app", R)) == (
        ["proxy"], [], False, True)
    pod.restart_policy = "Never"
    assert actions(_status("setup", E, 3)) == ([], [], True, False)
