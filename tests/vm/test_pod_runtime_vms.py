"""Where a pod's VM comes from, through PodRuntime on the microVM handler
(tests/harness/pod_runtime_client.py): a VM that does not start (CreatePod answers
UNAVAILABLE and leaves nothing), VMs booted ahead of their pods
(--vm-pool: a pod takes one, the pool boots the next, a restarted handler
adopts the pod and replaces the pool's VM), and VMs restored from one the
handler saved (--vm-template: each its own, a state QEMU cannot load made
again).

On real parts: driver -> shim -> proxy processes, `crust kata handler`
registered with the proxy, real QEMU microVMs (software emulation here).
What is checked is what the guests printed, the handler's answers and log,
and the QEMU processes on the host.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc
import pytest

from crust.kata.vmm.qemu import qemu_pids_under
from crust.sys import mount as sysmount
from tests.harness.daemons import wait_until
from tests.harness.pod_runtime_client import bind, container_bundle, kata_env_with_client, log_entries
from tests.harness.pool_log import READY, wait_for_pool
from tests.harness.template_log import template_events, wait_for_template


@pytest.fixture
def unbootable_env(root):
    """pod_env whose VMs cannot start: more vCPUs than QEMU's pc machine
    takes, which QEMU refuses at once."""
    yield from kata_env_with_client(root, handler_extra=["--cpus", "1000"])


def test_a_pod_whose_vm_does_not_start_is_unavailable_and_leaves_nothing(unbootable_env):
    """CreatePod whose VM does not start answers UNAVAILABLE (kubelet tries
    the pod again), names the pod and QEMU's reason, and leaves no QEMU, no
    pod, no work directory; asked again, the same. The root's check of the
    daemons' logs fails the test on an "unexpected error" (INTERNAL)."""
    kenv, client = unbootable_env
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as refused:
            client.create_pod("noboot", kenv.path)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        details = refused.value.details()
        assert "sandbox noboot: its VM did not start" in details and "Invalid SMP CPUs 1000" in details, details
        assert client.pods() == {}
        assert qemu_pids_under(kenv.handler.state_dir) == []
        assert list((kenv.handler.state_dir / "run").glob("*")) == []


# -- VMs booted ahead of their pods ---------------------------------------------------------------


@pytest.fixture
def pool_env(root):
    """pod_env with a pool of one VM booted ahead, and 3 s leases."""
    yield from kata_env_with_client(root, proxy_extra=["--lease-seconds", "3"], handler_extra=["--vm-pool", "1"])


def pooled_vms(kenv) -> dict[int, str]:
    """QEMU pid -> name of the VMs the pool holds, once their agent answered
    (the handler logs it)."""
    ready = {int(entry["pid"]): entry["vm"] for entry in log_entries(kenv, READY)}
    pool = kenv.handler.state_dir / "pool"
    running = set(qemu_pids_under(pool))   # by their command line: a taken VM's still names the pool
    return {pid: name for pid, name in ready.items() if pid in running and (pool / name).is_dir()}


def test_a_pod_takes_a_vm_booted_ahead_and_the_pool_boots_the_next(pool_env):
    """--vm-pool 1: a VM is booted before any pod; CreatePod takes it (its
    QEMU is the pod's), plugs the pod's shares and runs the pod's container
    in it (a host path written both ways, a configMap read), while the pool
    boots the next VM. The taken VM is never another pod's: it goes with
    its pod. A restarted handler adopts the pod that took a pooled VM (its
    name and sockets from the VM's own record), and stops the VM the killed
    handler's pool held, booting a new one."""
    kenv, client = pool_env
    wait_for_pool(kenv.handler, lambda: pooled_vms(kenv), "the pool's first VM")
    (first, name), = pooled_vms(kenv).items()
    # It ran a throwaway container while it waited (the agent's warm).
    assert [float(entry["warm_s"]) > 0 for entry in log_entries(kenv, READY)] == [True]

    qemu = client.create_pod("pooled", kenv.path)
    assert qemu == first, "the pod booted a VM of its own instead of taking the pooled one: " + "\n".join(
        line for line in kenv.handler.log_path.read_text().splitlines() if "pool" in line)[-3000:]
    workdir = kenv.handler.state_dir / "run"
    assert json.loads(next(workdir.glob("*/vm.json")).read_text())["name"] == name
    wait_for_pool(kenv.handler, lambda: set(pooled_vms(kenv)) - {first}, "the pool's next VM")
    (second, _), = pooled_vms(kenv).items()
    # A waiting VM yields the CPU to the pods (nice 10, its session's group
    # too); the taken one runs as the handler does.
    assert os.getpriority(os.PRIO_PROCESS, second) == 10 and os.getpriority(os.PRIO_PROCESS, first) == 0
    if Path(f"/proc/{second}/autogroup").exists():
        assert Path(f"/proc/{second}/autogroup").read_text().split()[-1] == "10"
        assert Path(f"/proc/{first}/autogroup").read_text().split()[-1] == "0"

    shared = kenv.path / "pooled-shared"
    shared.mkdir()
    (shared / "from-host").write_text("host\n")
    config_map = kenv.path / "pods" / "uid-pooled" / "volumes" / "kubernetes.io~configmap" / "cfg"
    (config_map / "..v1").mkdir(parents=True)
    (config_map / "..v1" / "key").write_text("cm 1\n")
    (config_map / "..data").symlink_to("..v1")
    (config_map / "key").symlink_to("..data/key")
    client.create_container("pooled", "app", container_bundle(
        kenv.path, "app", ["/bin/sh", "-c", "cat /shared/from-host /cfg/key; echo guest > /shared/from-guest; "
                                            "echo READY; exec sleep 600"],
        [bind("/shared", shared), bind("/cfg", config_map, "ro")]))
    client.start("app")
    assert client.output_until("app", b"READY") == b"host\ncm 1\nREADY\n"
    assert (shared / "from-guest").read_text() == "guest\n"

    kenv.handler.kill()
    wait_until(lambda: kenv.handlers()["kata"].lease_expired, timeout=15, what="the lease to expire")
    kenv.handler.start(timeout=120)
    client.close()
    client.__init__(kenv.handler.socket)
    assert client.pods()["pooled"].alive and client.pods()["pooled"].pid == first, "\n".join(
        kenv.handler.log_path.read_text().splitlines()[-25:])
    assert client.exec("app", "after-restart", ["cat", "/shared/from-host"])[:2] == (0, b"host\n")
    wait_until(lambda: second not in qemu_pids_under(kenv.handler.state_dir), timeout=30,
               what="the killed handler's pooled VM to be stopped")
    wait_for_pool(kenv.handler, lambda: set(pooled_vms(kenv)) - {first, second}, "a new pooled VM")

    client.delete_pod("pooled")
    wait_until(lambda: first not in qemu_pids_under(kenv.handler.state_dir), what="the pod's QEMU to exit")
    assert first not in pooled_vms(kenv)
    assert not list(workdir.glob("*/vm.json")), "the pod's work directory stays"
    # A handler stopped (SIGTERM) stops the VMs its pool holds; pods' VMs outlive it.
    waiting = set(pooled_vms(kenv))
    assert waiting
    assert kenv.handler.stop() == 0
    assert not waiting & set(qemu_pids_under(kenv.handler.state_dir))
    assert not list((kenv.handler.state_dir / "pool").iterdir())
    kenv.handler.start(timeout=120)


def test_a_pooled_vm_that_cannot_move_into_the_pods_directory_is_discarded(pool_env):
    """The pod's work directory is there already and not empty (what a
    crash left): the VM the pod took cannot be renamed into it, so it is
    stopped and its shares and directory removed, and the pod boots a VM of
    its own; the pool boots the next. A handler stopped while the pool
    boots stops that VM too and leaves the pool's directory empty."""
    from crust.runtime_handler.handler import workdir_name

    kenv, client = pool_env
    wait_for_pool(kenv.handler, lambda: pooled_vms(kenv), "the pool's first VM")
    (first, name), = pooled_vms(kenv).items()
    leftover = kenv.handler.state_dir / "run" / workdir_name("crashed")
    leftover.mkdir(parents=True)
    (leftover / "console.log").write_text("an earlier VM's\n")
    qemu = client.create_pod("crashed", kenv.path)
    assert qemu != first
    wait_until(lambda: first not in qemu_pids_under(kenv.handler.state_dir), what="the taken VM to be stopped")
    pool_dir = kenv.handler.state_dir / "pool"
    assert not (pool_dir / name).exists()
    assert [m.mount_point for m in sysmount.mounts() if m.mount_point.startswith(f"{pool_dir}/{name}")] == []
    client.delete_pod("crashed")
    booting = wait_until(lambda: set(qemu_pids_under(pool_dir)) - {first}, timeout=60,
                         what="the pool's next VM to boot")
    assert kenv.handler.stop() == 0
    assert not booting & set(qemu_pids_under(kenv.handler.state_dir))
    assert list(pool_dir.iterdir()) == []
    kenv.handler.start(timeout=120)


# -- VMs restored from a saved one ----------------------------------------------------------------


@pytest.fixture
def template_env(root):
    """pod_env whose handler restores each pod's VM from one it saved (--vm-template), with 3 s leases."""
    yield from kata_env_with_client(root, proxy_extra=["--lease-seconds", "3"], handler_extra=["--vm-template"])


def template_record(kenv) -> dict | None:
    path = kenv.handler.state_dir / "template" / "template.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_pods_vms_are_restored_from_the_saved_vm_and_each_is_its_own(template_env):
    """--vm-template: the handler saves one VM; each pod's VM is restored
    from it (no boot: the handler logs the restore), takes the pod's shares
    after (a host path read and written both ways) and runs its containers.
    Two pods' guests read different boot_ids and random bytes, and the
    host's clock although the template was saved 5 s before. A restarted
    handler adopts its pods and uses the saved VM as it is (not made again).
    A saved state QEMU cannot load fails that CreatePod with UNAVAILABLE
    (kubelet tries again), leaves nothing of the pod, and the template is
    made again; the next CreatePod restores from the new one."""
    kenv, client = template_env
    wait_for_template(kenv.handler)
    record = template_record(kenv)
    while time.time() < record["saved_at"] + 5:
        time.sleep(0.1)

    shared = kenv.path / "template-shared"
    shared.mkdir()
    (shared / "from-host").write_text("host\n")
    seen = {}
    for pod in ("restored-a", "restored-b"):
        client.create_pod(pod, kenv.path)
        up = [e for e in log_entries(kenv, "vm up") if e["sandbox"] == pod]
        assert [e["restored"] for e in up] == [True], up
        app = f"{pod}-app"
        script = (f"cat /shared/from-host; echo {pod} > /shared/{pod}; date +%s; "
                  "cat /proc/sys/kernel/random/boot_id; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; "
                  "echo; echo READY; exec sleep 600")
        client.create_container(pod, app, container_bundle(kenv.path, app, ["/bin/sh", "-c", script],
                                                           [bind("/shared", shared)]))
        started = time.time()
        client.start(app)
        lines = client.output_until(app, b"READY").decode().splitlines()
        ended = time.time()
        host, clock, boot_id, numbers, _ = lines
        assert host == "host" and (shared / pod).read_text() == f"{pod}\n"
        # The guest's clock read between the start and its output's arrival
        # (which takes seconds on a busy machine), to `date`'s whole second.
        assert started - 2 <= int(clock) <= ended + 1, (started, clock, ended)
        seen[pod] = (boot_id, numbers)
    assert seen["restored-a"][0] != seen["restored-b"][0] and seen["restored-a"][1] != seen["restored-b"][1]

    kenv.handler.kill()
    before_restart = len(template_events(kenv.handler))
    wait_until(lambda: kenv.handlers()["kata"].lease_expired, timeout=15, what="the lease to expire")
    kenv.handler.start(timeout=120)
    client.close()
    client.__init__(kenv.handler.socket)
    assert all(client.pods()[pod].alive for pod in seen)
    assert client.exec("restored-a-app", "after-restart", ["cat", "/shared/from-host"])[:2] == (0, b"host\n")
    assert not wait_for_template(kenv.handler, since=before_restart)["made"]
    assert template_record(kenv) == record

    # QEMU refuses a state that is not one (its first bytes overwritten).
    state = kenv.handler.state_dir / "template" / "vm.state"
    with open(state, "r+b") as f:
        f.write(b"\0" * 16)
    def pods_qemus() -> set[int]:
        # Not the template's: the refused restore makes it again meanwhile.
        return set(qemu_pids_under(kenv.handler.state_dir)) - set(
            qemu_pids_under(kenv.handler.state_dir / "template"))

    before = pods_qemus()
    before_refusal = len(template_events(kenv.handler))
    with pytest.raises(grpc.RpcError) as refused:
        client.create_pod("unloadable", kenv.path)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert "sandbox unloadable: its VM did not start" in refused.value.details()
    assert "unloadable" not in client.pods() and pods_qemus() <= before
    assert not list((kenv.handler.state_dir / "run").glob("*unloadable*"))
    assert wait_for_template(kenv.handler, since=before_refusal)["made"]
    assert template_record(kenv)["saved_at"] != record["saved_at"]
    client.create_pod("unloadable", kenv.path)
    assert [e["restored"] for e in log_entries(kenv, "vm up") if e["sandbox"] == "unloadable"] == [True]
    for pod in (*seen, "unloadable"):
        client.delete_pod(pod)
