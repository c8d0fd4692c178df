"""emptyDir volumes shared by a pod's running containers, started through
CRI by a real containerd with kubelet's volume manager replayed: on disk
(what one container writes the other reads, and back; two containers
appending to one file never tear a line) and in memory (a tmpfs of the
size limit, ENOSPC beyond it; in the microVM the guest's own, never more
than half its memory).

Every test runs once per RuntimeClass of RUNTIME_CLASSES (tests/harness/pod_nodes.py
`node`: a private containerd, and the crust stack for crust's runtimes);
runc (containerd's default handler) is the baseline. CRUST_POD_RUNTIME_CLASSES
(comma-separated) runs them under others: crust-runc (crust's OCI runtime)
or crust-microvm (crust's shim v2 and the microVM handler).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from crust.api import cri_pb2 as cri
from crust.kubelet import EmptyDir, VolumeMount
from crust.sys import mount as sysmount
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import KEEP_RUNNING, MiB
from tests.harness.pod_nodes import node  # noqa: F401 - a fixture


def test_an_empty_dir_is_shared_by_the_running_containers(node):
    shared = VolumeMount("shared", "/shared")
    pod = node.pod("shared", volumes={"shared": EmptyDir()}, containers=[
        node.container("writer", f"echo from-writer > /shared/msg && {KEEP_RUNNING}", shared),
        node.container("reader", "until [ -s /data/msg ]; do sleep 0.05; done; cat /data/msg; " + KEEP_RUNNING,
                       VolumeMount("shared", "/data"))])
    with node.running(pod):
        writer, reader = node.status(pod, "writer"), node.status(pod, "reader")
        assert (writer.state, reader.state) == (cri.CONTAINER_RUNNING, cri.CONTAINER_RUNNING)
        wait_until(lambda: "from-writer" in Path(reader.log_path).read_text(errors="replace"),
                   what="the reader to print what the writer wrote")
        host = node.volumes.path(pod, "shared")
        assert host == node.kubelet_root / "pods" / pod.uid / "volumes" / "kubernetes.io~empty-dir" / "shared"
        assert stat.S_IMODE(os.stat(host).st_mode) == 0o777 and sysmount.at(str(host)) is None
        assert (host / "msg").read_bytes() == b"from-writer\n"
        assert node.volumes.ready_file(pod, "shared").is_file()
        # And back: what the reader writes, the writer reads.
        node.run(reader.id, "/bin/sh", "-c", "echo from-reader > /data/back")
        assert node.run(writer.id, "/bin/cat", "/shared/back") == b"from-reader\n"
        assert (host / "back").read_bytes() == b"from-reader\n"


def test_two_containers_appending_to_one_file_never_tear_a_line(node):
    # Each container appends 400 lines of its own (one write each, O_APPEND)
    # once the host says go: on one file system a line never lands inside
    # another. Two views of the file in the guest (a bind per container)
    # each appended at the end it last saw.
    lines = 400
    loop = (f"until [ -e /shared/go ]; do sleep 0.05; done; i=0; while [ $i -lt {lines} ]; do "
            "echo \"$NAME-$i-xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\" >> /shared/log; i=$((i+1)); done; "
            "touch /shared/done-$NAME; " + KEEP_RUNNING)
    shared = VolumeMount("shared", "/shared")
    pod = node.pod("appenders", volumes={"shared": EmptyDir()}, containers=[
        node.container("a", loop, shared, env={"NAME": "A"}), node.container("b", loop, shared, env={"NAME": "B"})])
    with node.running(pod):
        host = node.volumes.path(pod, "shared")
        (host / "go").touch()
        wait_until(lambda: (host / "done-A").exists() and (host / "done-B").exists(), timeout=180,
                   what="both containers to finish appending")
        written = (host / "log").read_text().splitlines()
        torn = [line for line in written if not re.fullmatch(r"[AB]-\d+-x{40}", line)]
        assert torn == [] and len(written) == 2 * lines, (len(written), torn[:5])
        for name in "AB":
            assert [int(line.split("-")[1]) for line in written if line[0] == name] == list(range(lines))


def test_a_memory_empty_dir_is_a_tmpfs_shared_by_the_containers(node):
    limit = 16 * MiB
    cache, unbounded = VolumeMount("cache", "/cache"), VolumeMount("unbounded", "/unbounded")
    pod = node.pod("memory", volumes={"cache": EmptyDir(medium="Memory", size_limit=limit),
                                      "unbounded": EmptyDir(medium="Memory")}, containers=[
        node.container("one", KEEP_RUNNING, cache, unbounded), node.container("two", KEEP_RUNNING, cache)])
    with node.running(pod):
        host = node.volumes.path(pod, "cache")
        entry = sysmount.at(str(host))
        assert entry is not None and entry.fs_type == "tmpfs" and "size=16384k" in entry.super_options
        one, two = node.status(pod, "one"), node.status(pod, "two")
        for container in (one, two):
            line = next(line for line in node.run(container.id, "/bin/cat", "/proc/mounts").decode().splitlines()
                        if line.split()[1] == "/cache")
            assert line.split()[2] == "tmpfs" and "size=16384k" in line, line
        node.run(one.id, "/bin/sh", "-c", "echo in-memory > /cache/note")
        assert node.run(two.id, "/bin/cat", "/cache/note") == b"in-memory\n"
        if node.runtime_class == "crust-microvm":
            # The guest's own tmpfs, shared by the pod's containers: no host memory.
            assert not (host / "note").exists()
        else:
            assert (host / "note").read_text() == "in-memory\n"
        total_kib = int(node.run(two.id, "/bin/df", "-k", "/cache").decode().splitlines()[-1].split()[1])
        assert total_kib == limit // 1024
        # The size limit holds: more than it refuses with ENOSPC.
        full = node.runtime.exec_sync(one.id, ["/bin/dd", "if=/dev/zero", "of=/cache/big", "bs=1M", "count=32"])
        assert full.exit_code != 0 and b"No space left on device" in full.stderr, full.stderr
        node.run(one.id, "/bin/rm", "/cache/big")
        # Without a sizeLimit kubelet sizes the tmpfs for the node; in the
        # microVM it is never more than half the guest's memory (a writer is
        # told ENOSPC before the OOM killer would end the pod's processes).
        unbounded_kib = int(node.run(one.id, "/bin/df", "-k", "/unbounded").decode().splitlines()[-1].split()[1])
        host_kib = os.statvfs(node.volumes.path(pod, "unbounded")).f_blocks * \
            os.statvfs(node.volumes.path(pod, "unbounded")).f_frsize // 1024
        if node.runtime_class == "crust-microvm":
            memory_kib = int(next(line.split()[1] for line in node.run(one.id, "/bin/cat", "/proc/meminfo").decode()
                                  .splitlines() if line.startswith("MemTotal:")))
            assert unbounded_kib == min(host_kib, memory_kib // 2), (unbounded_kib, host_kib, memory_kib)
        else:
            assert unbounded_kib == host_kib
    assert sysmount.at(str(host)) is None and not host.exists()
