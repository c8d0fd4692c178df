"""Where a pod's mounts lead on the host and in the container: hostPath
volumes read and written both ways (their submounts along, following the
host's later mounts when asked), subPaths of a configMap key and of an
emptyDir directory (one with `..` stops the container before it is
created), a link in the image that never leads a mount out of the
container, and nothing of the pods left on the host but their hostPath;
started through CRI by a real containerd with kubelet's volume manager
replayed.

Every test runs once per RuntimeClass of RUNTIME_CLASSES (tests/harness/pod_nodes.py
`node`: a private containerd, and the crust stack for crust's runtimes);
runc (containerd's default handler) is the baseline. CRUST_POD_RUNTIME_CLASSES
(comma-separated) runs them under others: crust-runc (crust's OCI runtime)
or crust-microvm (crust's shim v2 and the microVM handler).
"""

from __future__ import annotations

import os
import stat
import subprocess
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
    Secret,
    VolumeError,
    VolumeMount,
    service_account_volume,
)
from crust.kubelet import image as images
from crust.kubelet.cri import SyncError
from crust.kubelet.pod import SERVICE_ACCOUNT_MOUNT_PATH
from crust.sys import mount as sysmount
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import CA_CRT, KEEP_RUNNING, UPDATE_VISIBLE_WITHIN, MiB, mounts_below, sh
from tests.harness.pod_nodes import node  # noqa: F401 - a fixture


def test_host_path_volumes_are_read_and_written_both_ways(node):
    directory, file = node.host_dir / "shared-dir", node.host_dir / "shared-file"
    pod = node.pod("hostpath", volumes={"dir": HostPath(str(directory), "DirectoryOrCreate"),
                                        "file": HostPath(str(file), "FileOrCreate")},
                   containers=[node.container("app", f"echo from-container > /host/written && {KEEP_RUNNING}",
                                              VolumeMount("dir", "/host"), VolumeMount("file", "/host-file"))])
    with node.running(pod):
        # Made by the volume manager as kubelet makes them.
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o755 and stat.S_IMODE(os.stat(file).st_mode) == 0o644
        app = node.status(pod, "app")
        wait_until(lambda: (directory / "written").exists() and (directory / "written").read_text() != "",
                   what="the container's write on the host")
        assert (directory / "written").read_text() == "from-container\n"
        # Written on the host later: the container sees it.
        (directory / "later").write_text("from-host\n")
        file.write_text("host line\n")
        assert node.run(app.id, "/bin/cat", "/host/later") == b"from-host\n"
        assert node.run(app.id, "/bin/cat", "/host-file") == b"host line\n"
        node.run(app.id, "/bin/sh", "-c", "echo container line >> /host-file")
        assert file.read_text() == "host line\ncontainer line\n"
        # The host replaces a file by a rename (as editors and configuration
        # tools do), again and again: the container's next read is the new
        # file at once (a guest that cached the lookup for a second read the
        # old one).
        for n in range(4):
            (directory / ".swap").write_text(f"version {n}\n")
            os.rename(directory / ".swap", directory / "swapped")
            assert node.run(app.id, "/bin/cat", "/host/swapped") == f"version {n}\n".encode(), n
    # A hostPath is the host's: nothing of it is removed with the pod.
    assert (directory / "written").exists() and file.read_text() == "host line\ncontainer line\n"
    missing = node.pod("hostpath-missing", volumes={"dir": HostPath(str(node.host_dir / "absent"), "Directory")},
                       containers=[node.container("app", KEEP_RUNNING, VolumeMount("dir", "/host"))])
    with pytest.raises(VolumeError, match="is not a directory"):
        node.volumes.set_up(missing)
    node.volumes.tear_down(missing)
    assert node.volumes.clean_pod_dir(missing)


def test_a_host_paths_mounts_come_along_and_follow_the_host_when_asked(node):
    """A hostPath's submounts are the container's too, as runc binds it
    (rbind): a read-only hostPath is read-only at its top only (a writable
    tmpfs below it stays writable); with HostToContainer propagation a
    mount the host makes below it later appears in the container, and
    without it it does not; the host can still unmount and remove a
    directory below it while the pod runs."""
    tree = node.host_dir / "tree"
    (tree / "pre").mkdir(parents=True)
    (tree / "later").mkdir()
    made: list[Path] = []
    try:
        # Propagation needs a shared source (containerd refuses a private
        # one for HostToContainer): the tree bound on itself, then shared.
        subprocess.run(["mount", "--bind", str(tree), str(tree)], check=True)
        made.append(tree)
        subprocess.run(["mount", "--make-rshared", str(tree)], check=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "pre", str(tree / "pre")], check=True)
        made.append(tree / "pre")
        (tree / "gone").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "gone", str(tree / "gone")], check=True)
        made.append(tree / "gone")
        pod = node.pod("submounts", volumes={"tree": HostPath(str(tree), "Directory")}, containers=[
            node.container("follows", KEEP_RUNNING, VolumeMount("tree", "/tree", read_only=True,
                                                               mount_propagation="HostToContainer")),
            node.container("private", KEEP_RUNNING, VolumeMount("tree", "/tree"))])
        with node.running(pod):
            follows, private = node.status(pod, "follows").id, node.status(pod, "private").id
            # Read-only at the top, not below.
            refused = node.runtime.exec_sync(follows, ["/bin/touch", "/tree/top"])
            assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr, refused
            node.run(follows, "/bin/touch", "/tree/pre/below")
            assert (tree / "pre" / "below").exists()
            assert node.run(private, "/bin/ls", "/tree/pre") == b"below\n"
            # A mount made on the host now: followed by one, not the other.
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "later", str(tree / "later")], check=True)
            made.append(tree / "later")
            (tree / "later" / "flag").write_text("mounted later\n")
            wait_until(lambda: node.runtime.exec_sync(follows, ["/bin/cat", "/tree/later/flag"]).stdout
                       == b"mounted later\n", timeout=30, what="the host's later mount in the following container")
            assert node.run(private, "/bin/ls", "-A", "/tree/later") == b""
            # The host takes a mount below the hostPath away and removes its
            # directory while the pod runs (a container wrote in it): no copy
            # the pod holds keeps the directory busy (runc's copies are in
            # the containers' mount namespaces, the microVM's in its file
            # server's). A copy that follows the host is a slave, and a slave
            # copy in use fails the host's umount under either runtime: a
            # file the guest has looked up is one virtiofsd holds open.
            node.run(private, "/bin/touch", "/tree/gone/written")
            subprocess.run(["umount", str(tree / "gone")], check=True)
            made.remove(tree / "gone")
            os.rmdir(tree / "gone")
            assert not (tree / "gone").exists()
    finally:
        for point in reversed(made):
            subprocess.run(["umount", "-l", str(point)], check=False)


def test_sub_paths_of_a_config_map_key_and_of_an_empty_dir_directory(node):
    pod = node.pod("subpath", volumes={"config": ConfigMap(data={"app.conf": "version 1\n"}), "work": EmptyDir()},
                   containers=[node.container("app", KEEP_RUNNING,
                                              VolumeMount("config", "/etc/app.conf", sub_path="app.conf"),
                                              VolumeMount("config", "/etc/config"),
                                              VolumeMount("work", "/var/log/app", sub_path="logs/app"))])
    with node.running(pod):
        app = node.status(pod, "app")
        binds = node.volumes.subpath_dir(pod)
        key_bind, dir_bind = binds / "config" / "app" / "0", binds / "work" / "app" / "2"
        assert key_bind.is_file() and sysmount.at(str(key_bind)) is not None
        assert dir_bind.is_dir() and sysmount.at(str(dir_bind)) is not None
        # The missing subPath was made with the volume directory's mode.
        made = node.volumes.path(pod, "work") / "logs" / "app"
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o777
        assert node.run(app.id, "/bin/cat", "/etc/app.conf") == b"version 1\n"
        node.run(app.id, "/bin/sh", "-c", "echo logged > /var/log/app/out")
        assert (made / "out").read_text() == "logged\n"
        refused = node.runtime.exec_sync(app.id, ["/bin/sh", "-c", "echo x > /etc/app.conf"])
        assert refused.exit_code != 0
        # An update reaches the volume's mount, not the subPath's (kubelet's
        # bind holds the file it was made from).
        node.volumes.update_config_map(pod, "config", {"app.conf": "version 2\n"})
        node.read_until(app.id, "/etc/config/app.conf", b"version 2\n", "the update in the volume's mount",
                        timeout=UPDATE_VISIBLE_WITHIN)
        assert node.run(app.id, "/bin/cat", "/etc/app.conf") == b"version 1\n"
    assert not binds.exists()


def test_a_sub_path_with_dot_dot_stops_the_container_before_it_is_created(node):
    pod = node.pod("subpath-bad", volumes={"work": EmptyDir()},
                   containers=[node.container("app", KEEP_RUNNING, VolumeMount("work", "/w", sub_path="a/../../b"))])
    node.volumes.set_up(pod)
    try:
        node.runtime.calls.clear()
        with pytest.raises(SyncError, match="unable to provision SubPath `a/../../b`: must not contain '..'"):
            node.runtime.run_pod(pod)
        assert "CreateContainer" not in node.runtime.calls
    finally:
        node.stop(pod)
    node.assert_gone(pod)


def test_nothing_of_the_pods_is_left_on_the_host(node):
    """What a pod of every kind of volume leaves once torn down: no mount,
    no directory below kubelet's root, the hostPath alone remains."""
    directory = node.host_dir / "kept"
    pod = node.pod("all", fs_group=3000, volumes={
        "scratch": EmptyDir(), "ram": EmptyDir(medium="Memory", size_limit=8 * MiB),
        "config": ConfigMap(data={"k": "v"}), "creds": Secret(data={"s": b"x"}),
        "sa": service_account_volume("t", CA_CRT), "info": DownwardAPI(items=[DownwardAPIFile("n", "metadata.name")]),
        "host": HostPath(str(directory), "DirectoryOrCreate")},
        containers=[node.container("app", KEEP_RUNNING, VolumeMount("scratch", "/scratch"),
                                   VolumeMount("ram", "/ram"), VolumeMount("config", "/config"),
                                   VolumeMount("config", "/config-key", sub_path="k"),
                                   VolumeMount("creds", "/creds"), VolumeMount("sa", SERVICE_ACCOUNT_MOUNT_PATH),
                                   VolumeMount("info", "/info"), VolumeMount("host", "/host"),
                                   VolumeMount("scratch", "/config/nested"))])
    with node.running(pod):
        app = node.status(pod, "app")
        assert node.run(app.id, "/bin/cat", "/config-key") == b"v"
        # A volume mounted below a read-only one: kubelet made its mount point.
        assert (node.volumes.path(pod, "config") / "nested").is_dir()
        assert os.stat(node.volumes.path(pod, "scratch")).st_gid == 3000
        tmpfs = [m for m in mounts_below(node.volumes.pod_dir(pod)) if sysmount.at(m).fs_type == "tmpfs"]
        assert len(tmpfs) == 4  # ram, creds, sa, info
    assert directory.is_dir() and not (node.kubelet_root / "pods" / pod.uid).exists()


def test_a_link_in_the_image_never_leads_a_mount_out_of_the_container(node):
    """An image whose /data is a link to /run/crust (where crust's guest
    keeps its own files) and an emptyDir at /data/out: the bind lands at
    /run/crust/out inside the container, as runc resolves it, and the
    container sees only the emptyDir there. The image's /tmp is its own."""
    image = node.image_with("link-to-run", images.File("run", is_dir=True, mode=0o755),
                            images.File("data", link="/run/crust"),
                            images.File("tmp", is_dir=True, mode=0o1777),
                            images.File("tmp/shipped.txt", data=b"shipped in the image\n"))
    out = VolumeMount("out", "/data/out")
    pod = node.pod("linked", volumes={"out": EmptyDir()}, containers=[
        Container("app", image, command=sh(f"echo mine > /data/out/f && echo secret-output && {KEEP_RUNNING}"),
                  volume_mounts=[out]),
        node.container("other", f"echo other-output && {KEEP_RUNNING}")])
    with node.running(pod):
        app = node.status(pod, "app")
        assert app.state == cri.CONTAINER_RUNNING
        host = node.volumes.path(pod, "out")
        wait_until(lambda: (host / "f").exists(), what="the write through the link")
        assert sorted(os.listdir(host)) == ["f"]
        assert node.run(app.id, "/bin/ls", "-A", "/data/out").split() == [b"f"]
        assert node.run(app.id, "/bin/ls", "-A", "/run/crust/out").split() == [b"f"]
        # Nothing of the guest's (or the host's) /run/crust is in the container.
        assert node.run(app.id, "/bin/ls", "-A", "/run/crust").split() == [b"out"]
        # The image's own /tmp, as the image has it (nothing mounted over it).
        assert node.run(app.id, "/bin/cat", "/tmp/shipped.txt") == b"shipped in the image\n"
