"""Everything crust creates has the mode it names, whatever the umask.

Every daemon is started under umask 000 (a careless unit file or container
image), then made to create all it creates in normal use: records,
pools, backing images (a volume, a snapshot, a clone), the shim's backend
directories, the watched directory and its Kata mirror, the handler's run
directory, a sandbox's files. Its own directories must then be 0700 and its
files 0600 (pool.json, which the controller and other nodes read, is 0644),
sockets 0600 (0660 only for a configured group), and nothing it made may be
writable by group or others.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

from crust.api import csi_pb2
from tests.harness.daemons import MIB
from tests.harness.handler_env import Env
from tests.harness.node_run import NodeRun, write_config

# Files crust writes for other readers, with the mode it gives them.
READABLE_BY_OTHERS = {"pool.json": 0o644, "status.json": 0o644}


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def wrong_modes(*trees: Path) -> list[str]:
    """Everything under trees (themselves included) whose mode is not the
    one crust gives what it creates."""
    wrong = []
    for tree in trees:
        for path in [tree, *tree.rglob("*")]:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue  # removed meanwhile (a temporary)
            mode, kind = stat.S_IMODE(st.st_mode), stat.S_IFMT(st.st_mode)
            if kind == stat.S_IFDIR:
                expected = 0o700
            elif kind == stat.S_IFREG:
                expected = READABLE_BY_OTHERS.get(path.name, 0o600)
            elif kind == stat.S_IFSOCK:
                expected = 0o600
            else:
                continue
            if mode != expected:
                wrong.append(f"{path}: {mode:o}, expected {expected:o}")
    return wrong


def test_the_daemons_state_is_private_under_umask_000(root):
    with umask(0):
        env = Env(root)
    v = env.volume("pv-modes")
    bundle = env.bundle("modes", "echo x > /data/x && exec sleep 600", [("/data", str(v.target))])
    env.run_ok(bundle, "sb-modes")
    try:
        host = env.create("pv-host")
        env.publish_on_host(host)
        snap = env.proxy.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(
            source_volume_id=host.volume_id, name="snap-modes"), timeout=60).snapshot
        env.proxy.create("pv-clone", 32 * MIB, env.cap("ext4"), volume_content_source=csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)))
        env.unpublish(host)
        p = env.proxy
        trees = [env.driver.data_dir, env.shim.state_dir, p.state_dir, p.volumes_dir, p.kata_dir,
                 env.handler.state_dir]
        made = [path for tree in trees for path in tree.rglob("*.img")]
        assert len(made) == 4, made  # two volumes, a snapshot, a clone
        assert wrong_modes(*trees) == []
        sockets = [env.driver.socket, env.shim.socket, p.socket, p.runtime_socket, env.handler.socket]
        assert [f"{s}: {stat.S_IMODE(os.stat(s).st_mode):o}" for s in sockets
                if stat.S_IMODE(os.stat(s).st_mode) != 0o600] == []
        # The container's own files are the workload's business: its log is the handler's.
        log = env.handler.state_dir / "run" / "sb-modes" / "process.log"
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
    finally:
        env.delete("sb-modes")


def test_crust_node_makes_private_directories_under_umask_000(root):
    config = write_config(root.path)
    run = NodeRun(root.path, config)
    try:
        with umask(0):
            run.wait_serving()
        status = json.loads(run.config.status_file.read_text())
        assert [c["running"] for c in status["children"]] == [True] * 4
        assert wrong_modes(run.config.run_dir, run.config.state_dir) == []
    finally:
        run.stop()
