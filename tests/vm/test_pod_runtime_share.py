"""A microVM pod's shared directories, through PodRuntime on the microVM
handler (tests/harness/pod_runtime_client.py): the read-only shares its own
virtiofsd daemons serve, each container's root and host-path binds in
them, live both ways, a kubelet atomic-writer volume's updates and an
emptyDir's rewrites read in the guest, nothing left once the pod goes; and
a container's submounts of the share pinned in the guest agent's mount
namespace, so that no container's exit unmounts one.

On real parts: driver -> shim -> proxy processes, `crust kata handler`
registered with the proxy, a real QEMU microVM (software emulation here),
a container root file system made from a busybox-static tree. What is
checked is what the guest read and wrote, the file servers' and the
host's mount tables, and the guest's console.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import grpc
import pytest

from crust.api import handler_pb2
from crust.guest.places import ROOT_RETIRE
from crust.kata.vmm.qemu import qemu_pids_under
from crust.sys import mount as sysmount
from crust.sys import proc
from tests.harness.daemons import wait_until
from tests.harness.pod_runtime_client import bind, container_bundle
from tests.harness.pod_runtime_client import pod_env  # noqa: F401 - a fixture

Code = grpc.StatusCode
Status = handler_pb2.ProcessState.Status


def test_the_share_serves_what_the_containers_bind_and_goes_with_the_pod(pod_env):
    """The pod's shared directories: read-only mounts served by the VM's own
    virtiofsd daemons; each container's rootfs and host-path binds in the
    share, live both ways, read-only where the mount says so; a volume
    kubelet's atomic writer updates in the live share (cache=none), its
    update read at once; an emptyDir in the share, whose file's pages the
    guest keeps across opens until the file changes (cache=always, looked at
    again after a second): a rewrite of the same size is read within a few
    seconds; a host path that leads to a CSI volume's path is
    refused; nothing of it outlives the pod."""
    from crust.kata.vmm import virtiofsd

    kenv, client, watch = pod_env
    ext4 = kenv.volume("pv-share-e", "ext4")
    watch.watch(ext4.majmin)
    sandbox_bundle = kenv.path / "bundles" / "share-sandbox"
    sandbox_bundle.mkdir(parents=True)
    (sandbox_bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {"args": ["/p"]}}))
    qemu = client.create_pod("share-pod", sandbox_bundle)
    workdir = kenv.handler.state_dir / "run" / "share-pod"
    daemons, serving_of = [], {}
    for name, options in (("share", (b"cache=always", b"timeout=1")), ("live", (b"cache=none",))):
        served, writable = sysmount.at(str(workdir / name)), sysmount.at(str(workdir / f"{name}.rw"))
        assert served is not None and served.readonly and writable is not None and not writable.readonly
        serving = [pid for pid in virtiofsd.pids_under(Path("/run"), kenv.handler.state_dir)
                   if f"source={workdir / name}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
        # Its namespace sandbox: the daemon and its child in a pid namespace of its own.
        assert 1 <= len(serving) <= 2, (name, serving)
        assert all(set(options) <= set(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
                   for pid in serving), name
        daemons += serving
        serving_of[name] = serving[0]

    shared, conf = kenv.path / "shared-dir", kenv.path / "conf"
    shared.mkdir()
    conf.write_text("version 1\n")
    # A configMap volume as kubelet's atomic writer lays it out.
    config_map = kenv.path / "pods" / "uid-share" / "volumes" / "kubernetes.io~configmap" / "cfg"
    config_map.mkdir(parents=True)
    (config_map / "..v1").mkdir()
    (config_map / "..v1" / "key").write_text("cm 1\n")
    (config_map / "..data").symlink_to("..v1")
    (config_map / "key").symlink_to("..data/key")
    empty_dir = kenv.path / "pods" / "uid-share" / "volumes" / "kubernetes.io~empty-dir" / "scratch"
    empty_dir.mkdir(parents=True)
    (empty_dir / "note").write_text("first\n")
    script = "echo from-guest > /shared/out; cat /conf; { echo x > /conf; } 2>/dev/null || echo conf-read-only; " \
             "cat /cfg/key; touch /rootfile; echo READY; exec sleep 600"
    one = container_bundle(kenv.path, "share-one", ["/bin/sh", "-c", script],
                           [bind("/shared", shared), bind("/conf", conf, "ro"), bind("/cfg", config_map, "ro"),
                            bind("/scratch", empty_dir)])
    client.create_container("share-pod", "share-one", one)
    client.start("share-one")
    assert client.output_until("share-one", b"READY") == b"version 1\nconf-read-only\ncm 1\nREADY\n"
    # The container's writes land on the host: in the bound directory, and
    # in the bundle's rootfs (containerd's snapshot), nothing copied.
    assert (shared / "out").read_text() == "from-guest\n"
    assert (one / "rootfs" / "rootfile").exists()
    # The host's later writes reach the container.
    (shared / "later").write_text("from-host\n")
    conf.write_text("version 2\n")
    assert client.exec("share-one", "cat-1", ["cat", "/shared/later", "/conf"])[1] == b"from-host\nversion 2\n"
    # The atomic writer's update (a new version, ..data renamed over, the
    # old version removed) reaches the guest's own copy of the volume, which
    # its agent switches the writer's way: every read succeeds, old or new.
    for version in range(2, 5):
        client.exec("share-one", f"cm-before-{version}", ["cat", "/cfg/key"])
        (config_map / f"..v{version}").mkdir()
        (config_map / f"..v{version}" / "key").write_text(f"cm {version}\n")
        (config_map / "..data_tmp").symlink_to(f"..v{version}")
        os.rename(config_map / "..data_tmp", config_map / "..data")
        shutil.rmtree(config_map / f"..v{version - 1}")
        reads = []

        def read_new(version=version) -> bool:
            reads.append(client.exec("share-one", f"cm-after-{version}-{len(reads)}", ["cat", "/cfg/key"]))
            return reads[-1][:2] == (0, f"cm {version}\n".encode())

        wait_until(read_new, timeout=10, what=f"version {version} in the guest")
        assert all(code == 0 for code, _, _ in reads), reads
    # The share keeps a file's pages across opens; a change the host makes
    # (same size: only its modification time tells) drops them once the
    # guest looks at the file's attributes again.
    assert client.exec("share-one", "note-1", ["cat", "/scratch/note"])[1] == b"first\n"
    assert client.exec("share-one", "note-2", ["cat", "/scratch/note"])[1] == b"first\n"
    (empty_dir / "note").write_text("again\n")
    notes = []

    def note_rewritten() -> bool:
        notes.append(client.exec("share-one", f"note-after-{len(notes)}", ["cat", "/scratch/note"])[1])
        return notes[-1] == b"again\n"

    wait_until(note_rewritten, timeout=5, what="the host's rewrite of an emptyDir file in the guest")
    assert set(notes) <= {b"first\n", b"again\n"}, notes
    # Only the binds: no deferred volume, no placeholder. The container's
    # root and the emptyDir in the share (the guest caches them); the host paths and
    # the configMap in the live share (cache=none: the host's changes seen
    # at once), each bound once for the pod.
    assert sorted(os.listdir(workdir / "share" / "share-one")) == ["rootfs"]
    assert len(os.listdir(workdir / "share" / ".binds")) == 1
    assert len(os.listdir(workdir / "live" / ".binds")) == 3
    # The binds are the file servers' alone, made in each daemon's mount
    # namespace: on the host the share's directories are plain ones (its
    # only mounts there are its own two per share), so no copy the pod
    # holds keeps a host directory busy.
    on_host = sorted(m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(f"{workdir}/"))
    assert on_host == sorted(str(workdir / n) for n in ("live", "live.rw", "share", "share.rw")), on_host

    def served_mounts(name: str) -> list[str]:
        return [m.mount_point for m in sysmount.mounts(f"/proc/{serving_of[name]}/mountinfo") if m.mount_point != "/"]

    assert sorted(served_mounts("share"))[1:] == ["/share-one/rootfs"]
    assert len([p for p in served_mounts("share") if p.startswith("/.binds/")]) == 1
    assert len([p for p in served_mounts("live") if p.startswith("/.binds/")]) == 3

    # A host path that is a link to a CSI volume's path: refused, nothing left.
    link = kenv.path / "link-to-csi"
    link.symlink_to(ext4.target)
    linked = container_bundle(kenv.path, "share-link", ["/bin/true"], [bind("/data", link)])
    with pytest.raises(grpc.RpcError) as refused:
        client.create_container("share-pod", "share-link", linked)
    assert refused.value.code() == Code.INVALID_ARGUMENT and "CSI volume" in refused.value.details(), \
        refused.value.details()
    assert list(client.pods()["share-pod"].container_ids) == ["share-one"]
    assert not (workdir / "share.rw" / "share-link").exists()

    assert client.delete_container("share-one").status == Status.STOPPED
    assert not (workdir / "share.rw" / "share-one").exists() and not (workdir / "live.rw" / "share-one").exists()
    assert not [p for p in served_mounts("share") if p.startswith("/share-one")]
    client.delete_pod("share-pod")
    wait_until(lambda: qemu not in qemu_pids_under(kenv.handler.state_dir), what="QEMU to exit")
    wait_until(lambda: not any(proc.alive(proc.identify(pid)) for pid in daemons if proc.identify(pid)),
               what="virtiofsd to exit")
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(str(workdir))] == []
    assert not any((workdir / name).exists() for name in ("share", "share.rw", "live", "live.rw"))
    assert not workdir.exists(), "a deleted pod's work directory (its VM's logs) stays behind"
    assert (shared / "out").read_text() == "from-guest\n" and conf.read_text() == "version 2\n"
    assert watch.stop() == [] and kenv.claims() == []


def test_a_containers_submounts_of_the_share_are_pinned_in_the_agents_namespace(pod_env):
    """No container's exit unmounts the last mount of a virtio-fs submount
    (Debian 12's 6.1 kernel stops at a BUG when one goes with a file's
    release in flight: docs/microvm-pods.md, "No exit unmounts a submount"): each container's root,
    its binds and the mounts below a bind are mounted in the guest agent's
    namespace before crun runs, and the agent holds the container's own
    namespace from its start until it is removed; a removed container's
    root and namespace are gone from the agent's. Containers deleted
    (SIGKILL) at once after their start, many times, each with files open
    on its root and on the mount below its bind: every delete succeeds, the
    console shows no BUG, the guest still runs containers. A container's
    volume is unmounted for good (the hold released) before its disk goes:
    what it wrote just before its removal is on the disk."""
    kenv, client, watch = pod_env
    shared = kenv.path / "pin-shared"
    (shared / "sub").mkdir(parents=True)
    sysmount.mount_path("tmpfs", str(shared / "sub"), "tmpfs", ["size=1m"])
    try:
        (shared / "sub" / "f").write_text("f\n")
        sandbox_bundle = kenv.path / "bundles" / "pin-sandbox"
        sandbox_bundle.mkdir(parents=True)
        (sandbox_bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                                "process": {"args": ["/p"]}}))
        client.create_pod("pin-pod", sandbox_bundle)
        args = ["/bin/sh", "-c", ("exec 3</shared/sub/f 4</etc/passwd; "
                                  "while :; do cat /shared/sub/f /etc/passwd >/dev/null; done")]
        for n in range(KILLED_AT_START):
            name = f"killed-{n}"
            client.create_container("pin-pod", name, container_bundle(kenv.path, name, args,
                                                                      [bind("/shared", shared)]))
            client.start(name)
            assert client.delete_container(name).status == Status.STOPPED, name
            console = kenv.console("pin-pod")
            assert "Busy inodes" not in console and "kernel BUG" not in console, console[-4000:]

        def agent_mounts(name: str) -> list[str]:
            """The guest agent's mount points under the shares, as a container
            of the pod's PID namespace reads them (its init runs in the
            agent's mount namespace)."""
            bundle = container_bundle(kenv.path, name, ["/bin/sh", "-c", "cat /shared/sub/f /proc/1/mountinfo"],
                                      [bind("/shared", shared)])
            spec = json.loads((bundle / "config.json").read_text())
            spec["linux"]["namespaces"] = [n for n in spec["linux"]["namespaces"] if n["type"] != "pid"]
            (bundle / "config.json").write_text(json.dumps(spec))
            client.create_container("pin-pod", name, bundle)
            client.start(name)
            assert client.wait(name).exit_code == 0
            out = client.output(name)[0].decode().splitlines()
            assert out[0] == "f", out
            return sorted(line.split()[4] for line in out[1:] if " /run/crust/" in line)

        first = agent_mounts("pinned-1")
        binds = [p for p in first if p.startswith("/run/crust/live/.binds/")]
        assert len(binds) == 2 and binds[1] == binds[0] + "/sub", first
        assert "/run/crust/share/pinned-1/rootfs" in first, first
        assert [p for p in first if p.startswith("/run/crust/ns/")] == ["/run/crust/ns/pinned-1"], first
        assert client.delete_container("pinned-1").status == Status.STOPPED
        # Only the running container's root and namespace: the removed ones'
        # went with them (a root ROOT_RETIRE seconds after its removal; each
        # look is a container, removed in turn, until no other root is left).
        deadline, attempt = time.monotonic() + 60, 2
        while True:
            name = f"pinned-{attempt}"
            second = agent_mounts(name)
            if [p for p in second if p.endswith("/rootfs")] == [f"/run/crust/share/{name}/rootfs"] or \
                    time.monotonic() > deadline:
                break
            assert client.delete_container(name).status == Status.STOPPED
            attempt += 1
            time.sleep(ROOT_RETIRE)
        assert [p for p in second if p.endswith("/rootfs")] == [f"/run/crust/share/{name}/rootfs"], second
        assert [p for p in second if p.startswith("/run/crust/ns/")] == [f"/run/crust/ns/{name}"], second
        assert [p for p in second if "/.binds/" in p] == binds, second
        # A container writes in its deferred volume and is removed at once
        # (before the file system would write it back by itself): the hold of
        # its namespace goes first, so the volume is unmounted for good, its
        # bytes written, before its disk leaves the guest.
        ext4 = kenv.volume("pv-pin-e", "ext4")
        watch.watch(ext4.majmin)
        client.create_container("pin-pod", "writer", container_bundle(
            kenv.path, "writer", ["/bin/sh", "-c", "echo written > /data/f"], [bind("/data", ext4.target)]))
        client.start("writer")
        assert client.wait("writer").exit_code == 0
        assert client.delete_container("writer").exit_code == 0
        assert kenv.claims() == []
        console = kenv.console("pin-pod")
        assert "Busy inodes" not in console and "kernel BUG" not in console, console[-4000:]
        assert "EXT4-fs error" not in console and "I/O error" not in console, console[-4000:]
        client.delete_pod("pin-pod")
        kenv.unpublish(ext4)
        kenv.publish_on_host(ext4)
        assert (ext4.target / "f").read_text() == "written\n"
        kenv.unpublish(ext4)
    finally:
        sysmount.unmount_all(str(shared / "sub"))


KILLED_AT_START = 8
