"""Volumes kubelet's atomic writer lays out and updates, in running
containers: a configMap update reaching the container (and a reader
never failing across updates), a projected service-account token read
and rotated, secret and downwardAPI volumes; started through CRI by a real
containerd with kubelet's volume manager replayed, checked by what the
containers read and when.

Every test runs once per RuntimeClass of RUNTIME_CLASSES (tests/harness/pod_nodes.py
`node`: a private containerd, and the crust stack for crust's runtimes);
runc (containerd's default handler) is the baseline. CRUST_POD_RUNTIME_CLASSES
(comma-separated) runs them under others: crust-runc (crust's OCI runtime)
or crust-microvm (crust's shim v2 and the microVM handler).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from crust.kubelet import ConfigMap, DownwardAPI, DownwardAPIFile, KeyToPath, Secret, VolumeMount
from crust.kubelet import service_account_volume
from crust.kubelet.pod import SERVICE_ACCOUNT_MOUNT_PATH
from crust.sys import mount as sysmount
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import CA_CRT, KEEP_RUNNING, UPDATE_VISIBLE_WITHIN, cri_log
from tests.harness.pod_nodes import node  # noqa: F401 - a fixture


def test_a_config_map_update_reaches_the_running_container(node):
    config = ConfigMap(data={"greeting": "hello", "stale": "goes away"})
    pod = node.pod("config", volumes={"config": config}, containers=[node.container(
        "app", 'while true; do echo "seen $(cat /etc/config/greeting)"; sleep 0.02; done',
        VolumeMount("config", "/etc/config"))])
    with node.running(pod):
        app = node.status(pod, "app")
        host = node.volumes.path(pod, "config")
        assert host.parent.name == "kubernetes.io~configmap"
        version = os.readlink(host / "..data")
        assert os.readlink(host / "greeting") == "..data/greeting"
        assert stat.S_IMODE(os.stat(host / version / "greeting").st_mode) == 0o644
        assert node.run(app.id, "/bin/cat", "/etc/config/greeting") == b"hello"
        refused = node.runtime.exec_sync(app.id, ["/bin/touch", "/etc/config/new"])
        assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr
        wait_until(lambda: "seen hello" in Path(app.log_path).read_text(errors="replace"), what="the first read")

        node.volumes.update_config_map(pod, "config", {"greeting": "bonjour"})
        written = time.time()
        node.read_until(app.id, "/etc/config/greeting", b"bonjour", "the new value through ExecSync",
                        timeout=UPDATE_VISIBLE_WITHIN, interval=0.01)
        by_exec = time.time() - written
        wait_until(lambda: "seen bonjour" in Path(app.log_path).read_text(errors="replace"),
                   timeout=UPDATE_VISIBLE_WITHIN, what="the container's own loop to read the new value")
        first_seen = next(t for t, text in cri_log(app.log_path) if text == "seen bonjour")
        print(f"\nconfigMap update under {node.runtime_class}: ExecSync saw it {by_exec:.3f} s after the write "
              f"returned; the container's 20 ms loop logged it {first_seen - written:+.3f} s after")
        assert first_seen - written < UPDATE_VISIBLE_WITHIN
        # The atomic writer's update: a new version, the old one and the dropped key gone.
        assert os.readlink(host / "..data") != version and not (host / version).exists()
        # The container sees the same once its copy caught up: the guest's
        # mirror removes the version it replaced one look later (0.25 s: a
        # reader that resolved ..data to it a moment before still opens its
        # file), so the new value is read before the old version goes.
        published = sorted([b"..data", os.readlink(host / "..data").encode(), b"greeting"])
        listings = []

        def listed_as_published() -> bool:
            listings.append(sorted(node.run(app.id, "/bin/ls", "-A", "/etc/config").split()))
            return listings[-1] == published

        try:
            wait_until(listed_as_published, timeout=UPDATE_VISIBLE_WITHIN, what="the container's listing")
        except AssertionError:
            raise AssertionError(f"the container lists {listings[-1]}, the host published {published}") from None


def test_a_reader_never_fails_across_config_map_updates(node):
    """A container reading a key in a loop while kubelet's atomic writer
    publishes version after version (each removed right after the next is
    linked): in the microVM every read succeeds. A walk through virtio-fs
    took a round trip per name, long enough for the writer to remove the
    version it had started in (ENOENT, seen 8 times in 40 updates); the
    guest now reads its own copy (crust.kata.vmm.share, agent `mirror`), which
    keeps the replaced version one pass longer. Under runc (the baseline)
    the same race is kubelet's own, in a window of a path walk: rare (once
    in a loaded run), so at most two failed reads are taken there."""
    updates = 20
    config = ConfigMap(data={"key": "v0"})
    # The value has no newline (kubelet writes it as given): read's status
    # is 1 at its end, but v holds it; a file that cannot be opened fails.
    loop = ('last=; while true; do v=; if { read -r v || [ -n "$v" ]; } < /etc/config/key; then '
            '[ "$v" = "$last" ] || { echo "seen $v"; last=$v; }; else echo "ERR $?"; fi; done')
    pod = node.pod("reader", volumes={"config": config},
                   containers=[node.container("app", loop, VolumeMount("config", "/etc/config"))])
    with node.running(pod):
        app = node.status(pod, "app")
        wait_until(lambda: "seen v0" in Path(app.log_path).read_text(errors="replace"), what="the first read")
        for n in range(1, updates + 1):
            node.volumes.update_config_map(pod, "config", {"key": f"v{n}"})
            time.sleep(0.15)
        wait_until(lambda: f"seen v{updates}" in Path(app.log_path).read_text(errors="replace"),
                   timeout=UPDATE_VISIBLE_WITHIN, what="the last version")
        lines = [text for _, text in cri_log(app.log_path)]
        errors = [line for line in lines if line.startswith("ERR")]
        if node.runtime_class == "crust-microvm":
            assert not errors, errors[:5]   # the guest's copy keeps the replaced version a pass longer
        else:
            # runc's reads walk the writer's own files: a reader preempted
            # between resolving ..data and opening the file it names finds
            # that version removed (once in 20 updates on a loaded machine).
            print("reads that failed", len(errors))
            assert len(errors) <= 2, errors[:5]
        # Versions are seen in the writer's order, never an older one after a newer.
        seen = [int(line.split()[1][1:]) for line in lines if line.startswith("seen v")]
        assert seen == sorted(seen), seen


def test_a_projected_service_account_token_is_read_and_rotated(node):
    pod = node.pod("token", volumes={"kube-api-access-x7k2p": service_account_volume("token-one", CA_CRT)},
                   fs_group=2000, containers=[node.container(
                       "app", KEEP_RUNNING, VolumeMount("kube-api-access-x7k2p", SERVICE_ACCOUNT_MOUNT_PATH,
                                                        read_only=True), run_as_user=1000)])
    with node.running(pod):
        app = node.status(pod, "app")
        assert node.run(app.id, "/usr/bin/id", "-u") == b"1000\n"
        assert node.run(app.id, "/bin/ls", SERVICE_ACCOUNT_MOUNT_PATH).split() == [b"ca.crt", b"namespace", b"token"]
        # Readable by the pod's user only through ownership: 0600, its user, then the fsGroup's g+r.
        assert node.run(app.id, "/bin/cat", f"{SERVICE_ACCOUNT_MOUNT_PATH}/token") == b"token-one"
        assert node.run(app.id, "/bin/cat", f"{SERVICE_ACCOUNT_MOUNT_PATH}/namespace") == b"default"
        assert node.run(app.id, "/bin/cat", f"{SERVICE_ACCOUNT_MOUNT_PATH}/ca.crt") == CA_CRT.encode()
        host = node.volumes.path(pod, "kube-api-access-x7k2p")
        assert sysmount.at(str(host)).fs_type == "tmpfs"
        token = os.stat(host / "token")
        assert (stat.S_IMODE(token.st_mode), token.st_uid, token.st_gid) == (0o640, 1000, 2000)
        assert stat.S_IMODE(os.stat(host / "ca.crt").st_mode) == 0o644
        version = os.readlink(host / "..data")

        node.volumes.rotate_token(pod, "kube-api-access-x7k2p", "token-two")
        node.read_until(app.id, f"{SERVICE_ACCOUNT_MOUNT_PATH}/token", b"token-two", "the rotated token",
                        timeout=UPDATE_VISIBLE_WITHIN)
        assert not (host / version).exists()


def test_secret_and_downward_api_volumes(node):
    pod = node.pod("info", labels={"app": "demo", "tier": 'back"end'}, annotations={"note": "two\nlines"},
                   volumes={"creds": Secret(data={"password": b"s3cr3t\n"},
                                            items=[KeyToPath("password", "db/password", mode=0o400)]),
                            "info": DownwardAPI(items=[DownwardAPIFile("labels", "metadata.labels"),
                                                       DownwardAPIFile("name", "metadata.name"),
                                                       DownwardAPIFile("note", "metadata.annotations['note']"),
                                                       DownwardAPIFile("tier", "metadata.labels['tier']")])},
                   containers=[node.container("app", KEEP_RUNNING, VolumeMount("creds", "/etc/creds"),
                                              VolumeMount("info", "/etc/podinfo"))])
    with node.running(pod):
        app = node.status(pod, "app")
        creds, info = node.volumes.path(pod, "creds"), node.volumes.path(pod, "info")
        assert sysmount.at(str(creds)).fs_type == "tmpfs" and sysmount.at(str(info)).fs_type == "tmpfs"
        assert stat.S_IMODE(os.stat(creds / "db" / "password").st_mode) == 0o400
        assert node.run(app.id, "/bin/cat", "/etc/creds/db/password") == b"s3cr3t\n"
        assert node.run(app.id, "/bin/cat", "/etc/podinfo/labels") == b'app="demo"\ntier="back\\"end"'
        assert node.run(app.id, "/bin/cat", "/etc/podinfo/name") == b"info"
        assert node.run(app.id, "/bin/cat", "/etc/podinfo/tier") == b'back"end'
        assert node.run(app.id, "/bin/cat", "/etc/podinfo/note") == b"lines\ntwo"  # lines sorted, as kubelet does
        node.volumes.update_secret(pod, "creds", {"password": b"n3w\n"})
        node.read_until(app.id, "/etc/creds/db/password", b"n3w\n", "the updated secret",
                        timeout=UPDATE_VISIBLE_WITHIN)
