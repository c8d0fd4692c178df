"""PodRuntime on the microVM handler: one VM per pod, its containers inside,
its volumes deferred to the guest. Two containers in one VM, volumes
mounted ahead at the pod's start, a killed VM, a restarted handler that
adopts its running pod, and requests refused with their code.

Driven over the handler's socket exactly as containerd's crust shim drives
it (tests/harness/pod_runtime_client.py), on real parts: driver -> shim -> proxy
processes, `crust kata handler` registered with the proxy, a real QEMU
microVM (software emulation here), real loop devices hot-plugged as
virtio-blk, a container root file system made from a busybox-static tree.
What is checked is what the guest wrote (stdout and stderr bytes, exit
codes, files read back on the host), what the Handler service and the
registry answer, Kata's direct-volume layout, and the host's mount tables
(never the volume's device).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest

from crust.api import csi_pb2, handler_pb2
from crust.contract.mountinfo import digest
from crust.kata.sandbox.direct_volume import entry_name
from crust.kata.vmm.qemu import qemu_pids_under
from tests.harness.daemons import MIB
from tests.harness.daemons import wait_until
from tests.harness.kata_env import anyone_mounts, holds_device, make_loop_volume, usage_dict
from tests.harness.loops import release_each
from tests.harness.pod_runtime_client import bind, container_bundle, kata_env_with_client, log_entries
from tests.harness.pod_runtime_client import pod_env  # noqa: F401 - a fixture

Code = grpc.StatusCode
Status = handler_pb2.ProcessState.Status


def df_numbers(out: bytes) -> dict[str, int]:
    """`df -P -B1 PATH; df -P -i PATH` output as usage_dict's keys."""
    lines = [line.split() for line in out.decode().splitlines() if line.startswith("/")]
    (b, i) = lines
    return {"bytes_total": int(b[1]), "bytes_used": int(b[2]), "bytes_available": int(b[3]),
            "inodes_total": int(i[1]), "inodes_used": int(i[2]), "inodes_available": int(i[3])}


DF = ["sh", "-c", "df -P -B1 /vol | tail -n 1 && df -P -i /vol | tail -n 1"]


# -- the tests ---------------------------------------------------------------------------------


def test_a_pod_runs_two_containers_in_one_vm_with_deferred_volumes(pod_env):
    kenv, client, watch = pod_env
    ext4, xfs = kenv.volume("pv-pod-e", "ext4"), kenv.volume("pv-pod-x", "xfs")
    for v in (ext4, xfs):
        watch.watch(v.majmin)
    hosts = kenv.path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.0.0.7 pod-one\n")
    sandbox_bundle = kenv.path / "bundles" / "pod-one-sandbox"
    sandbox_bundle.mkdir(parents=True)
    (sandbox_bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2",
                                                            "process": {"args": ["/pause"]}}))

    qemu = client.create_pod("pod-one", sandbox_bundle)
    assert qemu in qemu_pids_under(kenv.handler.state_dir)
    assert client.create_pod("pod-one", sandbox_bundle) == qemu   # idempotent

    # Container 1: its image's command writes into both volumes and prints.
    script = ("echo marker-ext4 > /data/marker && echo marker-xfs > /x/marker && "
              "echo out-line-1 && echo err-line-1 >&2 && cat /etc/hosts && "
              "{ echo changed > /etc/hosts; } 2>/dev/null || echo hosts-read-only; "
              "test -c /dev/null && test -c /dev/zero && test -c /dev/urandom && test -c /dev/full && "
              "test -c /dev/random && test -c /dev/tty && test -L /dev/fd && test -L /dev/stderr && "
              "test -d /dev/pts && echo x > /dev/null && test \"$(stat -c %a /dev/zero)\" = 666 && echo devices; "
              # No tmpfs over /tmp: the tree (which has none) as runc leaves it.
              "{ touch /tmp/t; } 2>/dev/null || echo no-tmp; ls /proc/self/ >/dev/null && echo proc; "
              "touch /shared/x && echo root-writable; cat /data/conf; pwd; id -u; sync; "
              # Left running when the container's process exits: its delete ends it.
              "sleep 600 </dev/null >/dev/null 2>&1 & exit 7")
    conf = kenv.path / "conf"
    conf.write_text("a file bound inside the volume\n")
    one = container_bundle(kenv.path, "one", ["/bin/sh", "-c", script], [
        bind("/data", ext4.target), bind("/x", xfs.target), bind("/etc/hosts", hosts, "ro"),
        bind("/data/conf", conf, "ro")], cwd="/work")
    client.create_container("pod-one", "one", one)
    client.create_container("pod-one", "one", one)   # idempotent
    assert client.state("one").status == Status.CREATED
    pid = client.start("one")
    assert pid > 0 and client.start("one") == pid
    state = client.wait("one")
    assert state.status == Status.STOPPED and state.exit_code == 7 and state.exited_at_ns > 0, state
    out, err = client.output("one")
    assert out == (b"out-line-1\n127.0.0.1 localhost\n10.0.0.7 pod-one\nhosts-read-only\ndevices\n"
                   b"no-tmp\nproc\nroot-writable\na file bound inside the volume\n/work\n0\n"), out
    assert err == b"err-line-1\n", err
    # A reader that reconnects resumes at its offsets.
    assert client.output("one", stdout_offset=11, stderr_offset=4) == (out[11:], err[4:])

    # Both volumes are the pod's, claimed under its id (Kata's marker too).
    assert kenv.claim_set() == {(str(ext4.target), "kata", "pod-one"), (str(xfs.target), "kata", "pod-one")}
    for v in (ext4, xfs):
        assert (kenv.kata_dir / entry_name(str(v.target)) / "pod-one").exists()
        assert holds_device(qemu, v.majmin)

    # Container 2 shares the VM and the ext4 volume; runs as 1000:1000, on
    # a read-only root (its volume and /dev/shm stay writable; the image's
    # /tmp is the root's, read-only as under runc).
    script = ("id; cat /vol/marker; { touch /shared/x; } 2>/dev/null || echo root-read-only; "
              "{ touch /tmp/t; } 2>/dev/null || echo tmp-read-only; "
              # PID 1 of its namespace: SIGTERM acts only through a handler.
              "touch /dev/shm/t && echo shm; echo READY; trap 'exit 143' TERM; sleep 600 & wait")
    two = container_bundle(kenv.path, "two", ["/bin/sh", "-c", script], [bind("/vol", ext4.target)],
                           uid=1000, gid=1000, readonly=True)
    client.create_container("pod-one", "two", two)
    client.start("two")
    first = client.output_until("two", b"READY")
    # No supplementary groups: the spec names none.
    assert first == b"uid=1000 gid=1000\nmarker-ext4\nroot-read-only\ntmp-read-only\nshm\nREADY\n", first
    pods = client.pods()
    assert pods["pod-one"].alive and pods["pod-one"].pid == qemu
    assert list(pods["pod-one"].container_ids) == ["one", "two"]
    assert set(pods["pod-one"].target_paths) == {str(ext4.target), str(xfs.target)}
    assert qemu_pids_under(kenv.handler.state_dir) == [qemu]   # one VM for the pod

    # An exec's df of the volume equals the stats the Handler service answers.
    code, out, err = client.exec("two", "df-1", DF)
    assert code == 0, err
    stats = client.handler.GetVolumeStats(handler_pb2.GetVolumeStatsRequest(
        target_path=str(ext4.target), sandbox_id="pod-one"), timeout=30)
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    assert usage_dict(stats.usage) == df_numbers(out)
    assert usage_dict(kenv.stats(ext4).usage) == df_numbers(out)   # and through the proxy (kubelet's way)
    # Output larger than one read of the guest's files, exactly.
    line = b"0123456789abcdefghijklmnopqrstuvwxyz"
    code, big, err = client.exec("two", "big", ["sh", "-c", f"yes {line.decode()} | head -n 3000"])
    assert code == 0 and big == (line + b"\n") * 3000 and err == b"", (code, len(big), err)
    # An exec's own user.
    assert client.exec("two", "id-1", ["id", "-u"], uid=4242, gid=4242)[1] == b"4242\n"

    # Online expansion of ext4 in the guest while the containers run.
    before = df_numbers(out)["bytes_total"]
    assert kenv.expand(ext4, 96 * MIB) >= 96 * MIB
    code, out, _ = client.exec("two", "df-2", DF)
    assert df_numbers(out)["bytes_total"] > before + 48 * MIB, (before, out)
    assert usage_dict(kenv.stats(ext4).usage) == df_numbers(out)
    # Signals reach the container's process; its exit code is the shell's.
    client.stub.SignalProcess(handler_pb2.SignalProcessRequest(container_id="two", signal=signal.SIGTERM),
                              timeout=30)
    assert client.wait("two").exit_code == 128 + signal.SIGTERM

    # Deleting container 1 gives back the volume only it used.
    assert client.delete_container("one").exit_code == 7
    assert kenv.claim_set() == {(str(ext4.target), "kata", "pod-one")}
    assert not (kenv.handler.state_dir / "run" / "pod-one" / "containers" / "one").exists()
    assert client.delete_container("two").status == Status.STOPPED
    assert kenv.claims() == []
    assert client.pods()["pod-one"].container_ids == []
    client.delete_pod("pod-one")
    assert client.pods() == {} and kenv.claims() == []
    wait_until(lambda: qemu not in qemu_pids_under(kenv.handler.state_dir), what="QEMU to exit")
    assert not (kenv.kata_dir / entry_name(str(ext4.target)) / "pod-one").exists()

    # The host never mounted either volume, at any moment.
    assert watch.stop() == []
    assert anyone_mounts(ext4.majmin) == [] and anyone_mounts(xfs.majmin) == []
    # The bytes the guest wrote, read back on the host once the pod is gone.
    kenv.unpublish(ext4)
    kenv.publish_on_host(ext4)
    assert (ext4.target / "marker").read_text() == "marker-ext4\n"
    kenv.unpublish(ext4)


def sandbox_bundle_of(kenv, name: str, annotations: dict[str, str]) -> Path:
    """A pod sandbox's bundle with containerd's annotations."""
    bundle = kenv.path / "bundles" / f"{name}-sandbox"
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.0.2", "process": {"args": ["/pause"]},
                                                    "annotations": annotations}))
    return bundle


def test_a_pods_deferred_volumes_are_mounted_at_its_start_and_its_containers_bind_them(pod_env):
    """kubelet publishes a pod's volumes before RunPodSandbox: CreatePod
    (the pod's uid in containerd's annotation) claims, plugs and mounts
    them in the guest in the background, before any container, and only
    the pod's own (not another pod's volume); the container binds the
    mounted volume. A volume the mount ahead cannot take (claimed by
    another pod) is left to the container's create, which fails as it
    always did and succeeds once the volume is free; a pod deleted at once
    waits for its mounts ahead and leaves no claim."""
    kenv, client, watch = pod_env
    v, other, shared = kenv.volume("pv-ahead", "ext4"), kenv.volume("pv-ahead-other", "ext4"), \
        kenv.volume("pv-ahead-shared", "ext4")
    for vol in (v, other, shared):
        watch.watch(vol.majmin)
    uid = v.target.parts[-5]
    assert uid == "pod-pv-ahead" and other.target.parts[-5] != uid

    qemu = client.create_pod("pod-a", sandbox_bundle_of(kenv, "pod-a", {"io.kubernetes.cri.sandbox-uid": uid}))
    wait_until(lambda: kenv.claim_set() == {(str(v.target), "kata", "pod-a")}, timeout=60,
               what="the pod's volume to be claimed before any container")
    wait_until(lambda: log_entries(kenv, "volumes mounted ahead"), timeout=60, what="the mount ahead to end")
    [ahead] = log_entries(kenv, "volumes mounted ahead")
    assert ahead["sandbox"] == "pod-a" and ahead["target_paths"] == [str(v.target)], ahead
    assert holds_device(qemu, v.majmin) and not holds_device(qemu, other.majmin)
    assert list(client.pods()["pod-a"].target_paths) == [str(v.target)]
    assert client.pods()["pod-a"].container_ids == []

    script = "echo ahead > /data/m && cat /data/m && grep -c ' /data ' /proc/self/mounts"
    bundle = container_bundle(kenv.path, "ahead", ["/bin/sh", "-c", script], [bind("/data", v.target)])
    client.create_container("pod-a", "ahead", bundle)
    client.start("ahead")
    assert client.wait("ahead").exit_code == 0
    assert client.output("ahead")[0] == b"ahead\n1\n"
    assert len(log_entries(kenv, "volumes mounted ahead")) == 1

    # Another pod whose uid names the volume pod-a holds: its mount ahead
    # is refused (a warning), the pod runs; its container's create fails
    # as it did without the mount ahead, and succeeds once pod-a is gone.
    client.create_pod("pod-b", sandbox_bundle_of(kenv, "pod-b", {
        "io.kubernetes.cri.sandbox-log-directory": f"/var/log/pods/default_b_{uid}"}))
    wait_until(lambda: any(e["sandbox"] == "pod-b" for e in log_entries(
        kenv, "volume not mounted ahead; its container's create mounts it")), timeout=60,
        what="pod-b's mount ahead to be refused")
    assert kenv.claim_set() == {(str(v.target), "kata", "pod-a")}
    assert list(client.pods()["pod-b"].target_paths) == []
    taker = container_bundle(kenv.path, "taker", ["/bin/cat", "/data/m"], [bind("/data", v.target)])
    with pytest.raises(grpc.RpcError) as refused:
        client.create_container("pod-b", "taker", taker)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    client.delete_pod("pod-a")
    client.create_container("pod-b", "taker", taker)
    client.start("taker")
    assert client.wait("taker").exit_code == 0 and client.output("taker")[0] == b"ahead\n"
    assert kenv.claim_set() == {(str(v.target), "kata", "pod-b")}
    client.delete_pod("pod-b")

    # Deleted right after it was made: the delete waits for the mount ahead.
    client.create_pod("pod-c", sandbox_bundle_of(kenv, "pod-c", {
        "io.kubernetes.cri.sandbox-uid": shared.target.parts[-5]}))
    client.delete_pod("pod-c")
    assert client.pods() == {} and kenv.claims() == []
    wait_until(lambda: qemu_pids_under(kenv.handler.state_dir) == [], what="QEMU to exit")
    assert watch.stop() == []


def test_a_killed_vm_stops_its_processes_and_a_missing_entry_fails_create(pod_env):
    kenv, client, watch = pod_env
    v, lost = kenv.volume("pv-pod-k", "ext4"), kenv.volume("pv-pod-lost", "ext4")
    watch.watch(v.majmin)
    qemu = client.create_pod("pod-two", kenv.path)
    client.create_container("pod-two", "runs", container_bundle(
        kenv.path, "runs", ["/bin/sh", "-c", "echo up > /data/up && exec sleep 600"], [bind("/data", v.target)]))
    client.start("runs")

    # A deferred target whose entry the handler cannot see: refused, nothing
    # claimed, attached or left on disk for it.
    entry_dir = kenv.proxy.volumes_dir / digest(str(lost.target))
    saved = (entry_dir / "mountInfo.json").read_bytes()
    shutil.rmtree(entry_dir)
    try:
        time.sleep(1.0)   # the handler's watcher drops the entry
        with pytest.raises(grpc.RpcError) as failed:
            client.create_container("pod-two", "lost", container_bundle(
                kenv.path, "lost", ["/bin/true"], [bind("/data", v.target), bind("/lost", lost.target)]))
        assert failed.value.code() == Code.FAILED_PRECONDITION, failed.value
        assert "no entry" in failed.value.details(), failed.value.details()
    finally:
        entry_dir.mkdir(mode=0o700)
        (entry_dir / "mountInfo.json").write_bytes(saved)
    assert kenv.claim_set() == {(str(v.target), "kata", "pod-two")}
    assert list(client.pods()["pod-two"].container_ids) == ["runs"]

    # A volume another pod holds: refused, and that pod keeps it.
    client.create_pod("pod-other", kenv.path)
    with pytest.raises(grpc.RpcError) as failed:
        client.create_container("pod-other", "steals", container_bundle(
            kenv.path, "steals", ["/bin/true"], [bind("/data", v.target)]))
    assert failed.value.code() == Code.FAILED_PRECONDITION, failed.value
    assert "pod-two" in failed.value.details(), failed.value.details()
    assert list(client.pods()["pod-other"].container_ids) == []
    assert not (kenv.handler.state_dir / "run" / "pod-other" / "containers" / "steals").exists()
    client.delete_pod("pod-other")
    assert kenv.claim_set() == {(str(v.target), "kata", "pod-two")}
    assert not (kenv.handler.state_dir / "run" / "pod-two" / "containers" / "lost").exists()

    # The VM is SIGKILLed: every process reports STOPPED, 255, with the reason.
    assert client.state("runs").status == Status.RUNNING
    os.kill(qemu, signal.SIGKILL)
    state = client.wait("runs", timeout=30)
    assert state.status == Status.STOPPED and state.exit_code == 255, state
    assert "gone" in state.reason and "pod-two" in state.reason, state.reason
    wait_until(lambda: kenv.claims() == [], timeout=15, what="the claims to be released")
    assert not client.pods()["pod-two"].alive
    with pytest.raises(grpc.RpcError) as failed:
        client.start("runs", "after", args=["true"])
    assert failed.value.code() == Code.FAILED_PRECONDITION
    assert client.delete_container("runs").exit_code == 255
    client.delete_pod("pod-two")
    assert client.pods() == {} and kenv.claims() == []
    assert watch.stop() == [] and anyone_mounts(v.majmin) == []
    for x in (v, lost):
        kenv.unpublish(x)


@pytest.fixture
def pod_env_short_lease(root):
    """pod_env with 3 s leases: a killed handler is seen gone quickly."""
    yield from kata_env_with_client(root, proxy_extra=["--lease-seconds", "3"])


def test_a_restarted_handler_adopts_a_running_pod(pod_env_short_lease):
    """Also a Kata-style driver's direct volume in a pod: the pod's id is its
    marker, and `direct-volume stats` answers through the adopted pod."""
    kenv, client = pod_env_short_lease
    v = kenv.volume("pv-pod-r", "ext4")
    backing, device = make_loop_volume(kenv.path, "direct", 64 * MIB, "ext4")
    try:
        _adopted_pod(kenv, client, v, device)
    finally:
        try:
            for pod_id in client.pods():
                client.delete_pod(pod_id)
        finally:
            release_each([(device, backing)])


def _adopted_pod(kenv, client, v, device: str) -> None:
    direct = kenv.proxy.target("pod-direct", "pv-direct")
    entry = kenv.kata_dir / entry_name(str(direct))
    added = kenv.direct_volume("add", "--volume-path", str(direct), "--mount-info", json.dumps(
        {"volume-type": "block", "device": device, "fstype": "ext4", "metadata": {}, "options": []}))
    assert added.returncode == 0, added.stderr
    qemu = client.create_pod("pod-three", kenv.path)
    client.create_container("pod-three", "keeps", container_bundle(
        kenv.path, "keeps", ["/bin/sh", "-c", "echo before; exec sleep 600"],
        [bind("/vol", v.target), bind("/direct", direct)]))
    pid = client.start("keeps")
    assert client.output_until("keeps", b"before\n") == b"before\n"
    assert sorted(p.name for p in entry.iterdir()) == ["mountInfo.json", "pod-three"]

    kenv.handler.kill()
    wait_until(lambda: kenv.handlers()["kata"].lease_expired, timeout=15, what="the lease to expire")
    kenv.handler.start(timeout=120)
    client.close()
    client.__init__(kenv.handler.socket)

    pods = client.pods()
    assert pods["pod-three"].alive and pods["pod-three"].pid == qemu and list(pods["pod-three"].container_ids) == ["keeps"]
    state = client.state("keeps")
    assert state.status == Status.RUNNING and state.pid == pid
    assert kenv.claim_set() == {(str(v.target), "kata", "pod-three")}
    # The new handler reads the guest again: an exec, its df against the stats.
    code, out, err = client.exec("keeps", "df-after", DF)
    assert code == 0, err
    assert usage_dict(kenv.stats(v).usage) == df_numbers(out)
    code, out, err = client.exec("keeps", "df-direct", ["sh", "-c", DF[2].replace("/vol", "/direct")])
    assert code == 0, err
    stats = kenv.direct_volume("stats", "--volume-path", str(direct))
    assert stats.returncode == 0, stats.stderr
    by_unit = {u["unit"]: u for u in json.loads(stats.stdout)["usage"]}
    assert int(by_unit[csi_pb2.VolumeUsage.BYTES]["total"]) == df_numbers(out)["bytes_total"], (stats.stdout, out)
    # The container's disk is in the adopted VM's table: its delete detaches it.
    assert client.delete_container("keeps").exit_code == 128 + signal.SIGKILL
    assert kenv.claims() == []
    assert sorted(p.name for p in entry.iterdir()) == ["mountInfo.json"]   # the marker went with it
    client.delete_pod("pod-three")
    wait_until(lambda: qemu not in qemu_pids_under(kenv.handler.state_dir), what="QEMU to exit")
    assert "could not" not in kenv.handler.log_path.read_text()
    kenv.unpublish(v)
    assert kenv.direct_volume("remove", "--volume-path", str(direct)).returncode == 0


def test_bad_requests_get_their_code_and_leave_nothing(pod_env):
    """No VM needed: every refusal names its field, nothing is recorded."""
    kenv, client, _ = pod_env
    good = container_bundle(kenv.path, "good", ["/bin/true"], [])
    (kenv.path / "bundles" / "no-config").mkdir()

    def code(call, request) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as failed:
            result = call(request, timeout=30)
            if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
                list(result)
        return failed.value.code(), failed.value.details()

    s = client.stub
    for call, request, expected, words in [
        (s.CreatePod, handler_pb2.CreatePodRequest(), Code.INVALID_ARGUMENT, "sandbox_id"),
        (s.CreatePod, handler_pb2.CreatePodRequest(sandbox_id="../up"), Code.INVALID_ARGUMENT, "sandbox_id"),
        (s.CreatePod, handler_pb2.CreatePodRequest(sandbox_id="p", bundle="relative"), Code.INVALID_ARGUMENT,
         "bundle"),
        (s.CreateContainer, handler_pb2.CreateContainerRequest(container_id="c", bundle=str(good)),
         Code.INVALID_ARGUMENT, "sandbox_id"),
        (s.CreateContainer, handler_pb2.CreateContainerRequest(sandbox_id="p", container_id="a/b", bundle=str(good)),
         Code.INVALID_ARGUMENT, "container_id"),
        (s.CreateContainer, handler_pb2.CreateContainerRequest(sandbox_id="p", container_id="c",
                                                               bundle=str(kenv.path / "bundles" / "no-config")),
         Code.INVALID_ARGUMENT, "config.json"),
        (s.CreateContainer, handler_pb2.CreateContainerRequest(sandbox_id="p", container_id="c", bundle=str(good)),
         Code.NOT_FOUND, "sandbox_id"),
        (s.StartProcess, handler_pb2.StartProcessRequest(container_id="c"), Code.NOT_FOUND, "container_id"),
        (s.GetProcess, handler_pb2.GetProcessRequest(container_id="c"), Code.NOT_FOUND, "container_id"),
        (s.SignalProcess, handler_pb2.SignalProcessRequest(container_id="c", signal=9), Code.NOT_FOUND,
         "container_id"),
        (s.ReadOutput, handler_pb2.ReadOutputRequest(container_id="c"), Code.NOT_FOUND, "container_id"),
        (s.ReadOutput, handler_pb2.ReadOutputRequest(container_id="c", stdout_offset=-1), Code.INVALID_ARGUMENT,
         "offset"),
        (s.ReadOutput, handler_pb2.ReadOutputRequest(), Code.INVALID_ARGUMENT, "container_id"),
    ]:
        got, details = code(call, request)
        assert (got, words in details) == (expected, True), (call, request, got, details)
    # Deleting what does not exist is done already.
    assert client.delete_container("nothing").status == Status.STOPPED
    client.delete_pod("nothing")
    assert client.pods() == {} and kenv.claims() == []
    assert list((kenv.handler.state_dir / "pods").iterdir()) == []
    assert qemu_pids_under(kenv.handler.state_dir) == []
