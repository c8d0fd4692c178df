from crust.api import csi_pb2
from tests.harness.daemons import MIB


def test_volume_lifecycle_writes_bytes_to_backing_file(driver, root):
    vol = driver.create("smoke", 64 * MIB)
    staging, target = root.path / "staging", root.path / "target"
    driver.stage(vol.volume_id, staging)
    driver.publish(vol.volume_id, staging, target)
    (target / "hello").write_bytes(b"crust-smoke-payload")
    driver.unpublish(vol.volume_id, target)
    driver.unstage(vol.volume_id, staging)
    backing = driver.data_dir / "pools" / "node-a" / "volumes" / f"{vol.volume_id}.img"
    assert b"crust-smoke-payload" in backing.read_bytes()
    assert not target.exists()
    driver.delete(vol.volume_id)
    assert not backing.exists()
    info = driver.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == "loop.csi.crust.dev"
