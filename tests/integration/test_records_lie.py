"""Records that lie: each daemon's own record directories, damaged or planted.

A record is crust's own file, but a buggy root component, a half-restored
backup or an operator's edit can leave anything there. Each daemon must
check a record against the directories and ids it must have, set aside what
does not parse or does not belong (logged, renamed *.corrupt or left and
ignored, never followed), start, and go on serving:

- the driver: a controller record whose pool ("node") is "../../outside",
  in a state its start finishes (creating, deleting), must not make it
  delete a file outside --data-dir; a pool.json naming another node must not
  send backing files out of the pools; a malformed volume or snapshot id, or
  a record whose file name is not its id, must not stop it from starting;
- every daemon: a FIFO, a directory or a symlink named *.json in each of its
  record directories must not block or stop its start;
- the driver: a node record damaged while it runs: NodeGetVolumeStats,
  NodeUnpublishVolume and NodeUnstageVolume still answer from the kernel's
  state (no INTERNAL), and unstage leaves nothing mounted or attached.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc

from crust.api import csi_pb2
from crust.sys import loop as sysloop
from tests.harness.daemons import MIB, mount_cap, mounted_at
from tests.harness.daemons import wait_until

Code = grpc.StatusCode
VOL_A = "vol-00000000000000000000000a"
VOL_B = "vol-00000000000000000000000b"
SNAP_A = "snap-0000000000000000000000a0"


def plant(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(json.dumps(record))


def plant_fifo_dir_and_link(directory: Path, outside: Path) -> list[Path]:
    """A FIFO, a directory and a symlink (to a file outside) named *.json."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    fifo, folder, link = directory / "a-fifo.json", directory / "a-dir.json", directory / "a-link.json"
    os.mkfifo(fifo)
    folder.mkdir()
    link.symlink_to(outside)
    return [fifo, folder, link]


def assert_started_quickly(started: float, what: str) -> None:
    assert time.monotonic() - started < 15, f"{what} took {time.monotonic() - started:.1f} s to start"


def no_tracebacks(root) -> list[str]:
    return [f"{log.name}: {line[:300]}" for log in root.path.glob("*.log")
            for line in log.read_text(errors="replace").splitlines() if "Traceback" in line]


def test_a_driver_record_naming_a_pool_outside_the_data_dir_deletes_nothing_there(root):
    data = root.path / "data"
    outside = root.path / "outside"
    victims = [outside / "volumes" / f"{VOL_A}.img", outside / "volumes" / f".{VOL_A}.img.partial",
               outside / "snapshots" / f"{SNAP_A}.img"]
    for victim in victims:
        victim.parent.mkdir(parents=True, exist_ok=True)
        victim.write_text("not crust's\n")
    plant(data / "controller" / "volumes" / f"{VOL_A}.json",
          {"volume_id": VOL_A, "name": "pv-a", "node": "../../outside", "capacity_bytes": MIB, "state": "deleting"})
    plant(data / "controller" / "snapshots" / f"{SNAP_A}.json",
          {"snapshot_id": SNAP_A, "name": "snap-a", "source_volume_id": VOL_A, "node": "../../outside",
           "size_bytes": MIB, "state": "creating"})
    # A pool record whose node is not its directory's: volumes would be made out there.
    plant(data / "pools" / "evil" / "pool.json",
          {"node_id": "../../outside", "capacity_bytes": 100 * 2**30, "max_volumes_per_node": 64,
           "topology": {"topology.loop.csi.crust.dev/node": "../../outside"}})
    driver = root.driver().start()
    for victim in victims:
        assert victim.read_text() == "not crust's\n", f"{victim} was touched"
    for name in (f"{VOL_A}.json", f"{SNAP_A}.json"):
        kept = list((data / "controller").glob(f"*/{Path(name).stem}.*"))
        assert [p.suffix for p in kept] == [".corrupt"], kept
    # Volumes are made in the driver's own pool only, and none out there.
    for i in range(3):
        driver.create(f"pv-new-{i}")
    assert sorted(p.name for p in (outside / "volumes").iterdir()) == sorted(v.name for v in victims[:2])
    assert len(list((data / "pools" / "node-a" / "volumes").glob("*.img"))) == 3
    assert no_tracebacks(root) == []


def test_malformed_ids_and_misnamed_records_do_not_stop_the_driver(root):
    data = root.path / "data"
    controller = data / "controller"
    plant(controller / "volumes" / "not-an-id.json",
          {"volume_id": "not-an-id", "name": "pv-x", "node": "node-a", "capacity_bytes": MIB, "state": "creating"})
    plant(controller / "volumes" / f"{VOL_B}.json",  # its file name is not its id
          {"volume_id": VOL_A, "name": "pv-y", "node": "node-a", "capacity_bytes": MIB, "state": "ready"})
    plant(controller / "snapshots" / "bad.json",
          {"snapshot_id": "../x", "name": "s", "source_volume_id": VOL_A, "node": "node-a", "size_bytes": 1,
           "state": "deleting"})
    plant(data / "node" / "node-a" / "volumes" / "vol-zz.json",
          {"volume_id": "vol-zz", "staging_path": "/x", "access_type": "mount"})
    driver = root.driver().start()
    # The lying records were set aside, not served.
    assert driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=10).entries == []
    assert sorted(p.name for p in controller.rglob("*.corrupt")) == ["bad.corrupt", "not-an-id.corrupt",
                                                                      f"{VOL_B}.corrupt"]
    assert [p.name for p in (data / "node" / "node-a" / "volumes").iterdir()] == ["vol-zz.corrupt"]
    vol = driver.create("pv-works")
    assert vol.volume_id
    assert no_tracebacks(root) == []


def test_a_fifo_a_directory_or_a_symlink_named_json_in_any_record_directory_blocks_no_start(root):
    secret = root.path / "secret.json"
    secret.write_text('{"volume_id": "' + VOL_A + '"}')
    planted = []
    data = root.path / "data"
    for d in (data / "controller" / "volumes", data / "controller" / "snapshots", data / "controller" / "groups",
              data / "node" / "node-a" / "volumes", data / "pools" / "fifo-node",
              root.path / "shim-state" / "volumes",
              root.path / "proxy-state" / "volumes", root.path / "proxy-state" / "decisions",
              root.path / "proxy-state" / "handlers", root.path / "mountns-state" / "sandboxes"):
        planted += plant_fifo_dir_and_link(d, secret)
    (data / "pools" / "other-node").mkdir()
    os.mkfifo(data / "pools" / "other-node" / "pool.json")
    started = time.monotonic()
    driver, shim, proxy = root.stack()
    handler = root.handler(proxy).start()
    assert_started_quickly(started, "the stack")
    # Each one still serves, and a volume goes through all of them.
    vol = proxy.create("pv-fifo", 32 * MIB, mount_cap("ext4"))
    staging = proxy.staging("pv-fifo")
    proxy.stage(vol.volume_id, staging, mount_cap("ext4"))
    proxy.unstage(vol.volume_id, staging)
    assert secret.read_text() == '{"volume_id": "' + VOL_A + '"}'
    # Nothing planted was followed or read as a record; none is served.
    assert driver.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=10).entries[0].volume.volume_id \
        == vol.volume_id
    del handler
    assert no_tracebacks(root) == []


def test_a_node_record_damaged_while_the_driver_runs(root):
    driver = root.driver().start()
    record_dir = driver.data_dir / "node" / "node-a" / "volumes"
    for damage in (b"{not json", b"", b'{"volume_id": 7}', None):
        vol = driver.create(f"pv-dmg-{len(damage) if damage is not None else 'fifo'}")
        staging = root.path / f"st-{vol.volume_id}"
        target = root.path / f"t-{vol.volume_id}"
        driver.stage(vol.volume_id, staging)
        driver.publish(vol.volume_id, staging, target)
        (target / "data.txt").write_text("kept\n")
        record = record_dir / f"{vol.volume_id}.json"
        record.unlink()
        if damage is None:
            os.mkfifo(record)
        else:
            record.write_bytes(damage)
        stats = driver.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
            volume_id=vol.volume_id, volume_path=str(target)), timeout=30)
        assert stats.usage[0].total > 0
        driver.unpublish(vol.volume_id, target)
        assert mounted_at(target) is None
        driver.unstage(vol.volume_id, staging)
        assert mounted_at(staging) is None
        backing = str(driver.data_dir / "pools" / "node-a" / "volumes" / f"{vol.volume_id}.img")
        # (A detach is finished by the kernel once the last opener lets go.)
        wait_until(lambda: [d for d, b in sysloop.attached().items() if b == backing] == [],
                   what="the volume's loop device to be detached")
        # Staged again, the data is there.
        driver.stage(vol.volume_id, staging)
        driver.publish(vol.volume_id, staging, target)
        assert (target / "data.txt").read_text() == "kept\n"
        driver.unpublish(vol.volume_id, target)
        driver.unstage(vol.volume_id, staging)
    assert no_tracebacks(root) == []


def test_records_that_are_not_where_they_must_live_are_set_aside(root):
    """Each daemon's records name their own key and the daemon's own paths."""
    from crust.contract.mountinfo import digest

    target = str(root.path / "kubelet" / "pods" / "p" / "volumes" / "kubernetes.io~csi" / "pv" / "mount")
    # The shim: a record under another volume's key, one naming backend paths elsewhere.
    plant(root.path / "shim-state" / "volumes" / ("0" * 32 + ".json"),
          {"volume_id": VOL_A, "staging_path": "/s", "fs_type": "ext4", "backend_target": "/dev/sda"})
    from crust.csi_shim.records import volume_key
    plant(root.path / "shim-state" / "volumes" / f"{volume_key(VOL_B)}.json",
          {"volume_id": VOL_B, "staging_path": "/s", "fs_type": "ext4", "backend_target": "/dev/sda"})
    # The proxy: a decision stored under another target's digest.
    plant(root.path / "proxy-state" / "decisions" / f"{digest('/elsewhere')}.json",
          {"target_path": target, "volume_id": VOL_A, "deferred": True, "reason": "planted"})
    # The handler: a sandbox whose volume would be "unmounted" outside its run directory.
    plant(root.path / "mountns-state" / "sandboxes" / "sb-lie.json",
          {"sandbox_id": "sb-lie", "bundle": "/nonexistent", "volumes": {digest(target): {
              "target_path": target, "device": "/dev/loop0", "fs_type": "ext4", "mount_point": "/"}}})
    plant(root.path / "mountns-state" / "sandboxes" / "sb-other.json",
          {"sandbox_id": "sb-renamed", "bundle": "/nonexistent"})
    plant(root.path / "mountns-state" / "containers" / "c-one.json",
          {"container_id": "c-two", "sandbox_id": "sb-x"})
    driver, shim, proxy = root.stack()
    handler = root.handler(proxy).start()
    aside = sorted(p.relative_to(root.path).as_posix() for p in root.path.rglob("*.corrupt"))
    assert aside == sorted([f"shim-state/volumes/{'0' * 32}.corrupt", f"shim-state/volumes/{volume_key(VOL_B)}.corrupt",
                            f"proxy-state/decisions/{digest('/elsewhere')}.corrupt",
                            "mountns-state/sandboxes/sb-lie.corrupt", "mountns-state/sandboxes/sb-other.corrupt",
                            "mountns-state/containers/c-one.corrupt"])
    assert handler.sandbox("list", "--json").stdout.strip() in ("[]", "")
    assert no_tracebacks(root) == []


def test_shim_and_proxy_records_damaged_while_they_run(root):
    """Kubelet's unpublish and unstage still go through, leaving nothing
    mounted, when the shim's record or the proxy's decision is damaged."""
    from crust.contract.mountinfo import digest
    from crust.csi_shim.records import volume_key
    from tests.harness.handler_env import Env

    env = Env(root, start_handler=False)
    for what in ("shim, deferred", "shim, on the host", "proxy's decision"):
        pv = "pv-" + "".join(c for c in what if c.isalpha())
        v = env.create(pv)
        if what == "shim, on the host":
            env.publish_on_host(v)
        else:
            env.publish_deferred(v)
        if what.startswith("shim"):
            record = env.shim.state_dir / "volumes" / f"{volume_key(v.volume_id)}.json"
        else:
            record = env.proxy.state_dir / "decisions" / f"{digest(str(v.target))}.json"
        record.write_text("{damaged")
        try:
            env.proxy.node.NodeGetVolumeStats(csi_pb2.NodeGetVolumeStatsRequest(
                volume_id=v.volume_id, volume_path=str(v.target)), timeout=30)
        except grpc.RpcError as exc:  # what the shim no longer knows it may not find
            assert exc.code() == Code.NOT_FOUND, (what, exc.details())
        env.unpublish(v)
        env.proxy.unstage(v.volume_id, v.staging)
        assert mounted_at(v.target) is None and mounted_at(v.staging) is None, what
        assert list(record.parent.glob("*.corrupt")), what
    assert no_tracebacks(root) == []
