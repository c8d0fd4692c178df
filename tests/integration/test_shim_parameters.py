"""crust.dev/ StorageClass parameters: kept from the backend, returned in volume_context."""

import grpc

from crust.api import csi_pb2
from tests.harness.daemons import MIB, code_of, mount_cap


def test_crust_parameters_stay_out_of_the_backend_and_reach_volume_context(root):
    """A StorageClass parameter such as crust.dev/defer is for the proxy's
    policy: the backend (which rejects unknown parameters) never sees it,
    and it comes back in volume_context for NodeStage/NodePublish."""
    driver = root.driver().start()
    shim = root.shim(driver).start()
    request = csi_pb2.CreateVolumeRequest(
        name="sc-param", capacity_range=csi_pb2.CapacityRange(required_bytes=64 * MIB),
        volume_capabilities=[mount_cap()], parameters={"crust.dev/defer": "true", "provisioning": "thin"})
    assert code_of(driver.controller.CreateVolume, request) == grpc.StatusCode.INVALID_ARGUMENT
    volume = shim.controller.CreateVolume(request, timeout=60).volume
    assert volume.volume_context["crust.dev/defer"] == "true"
    assert volume.volume_context["provisioning"] == "thin"
