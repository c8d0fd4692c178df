"""The CSI calls `crust proxy` does not intercept reach the plugin and come back byte for byte.

Real `crust driver` -> `crust shim` -> `crust proxy` processes
(tests.harness.proxy_csi): Identity, Controller and NodeGetInfo calls,
their answers and their errors (same code, same message) are the same
through the proxy as from the driver, and the node capabilities are the
shim's, unchanged. (The passthrough's own mechanics, on a stand-in backend,
are covered in tests/integration/test_passthrough.py.)
"""

from __future__ import annotations

import grpc
import pytest

from crust.api import csi_pb2
from tests.harness.proxy_csi import new_volume, start_stack

Code = grpc.StatusCode


# -- everything else passes through -------------------------------------------------------------------------------


def test_calls_not_intercepted_pass_through_byte_for_byte(root):
    driver, shim, proxy = start_stack(root)
    new_volume(proxy, "pv-a")
    new_volume(proxy, "pv-b")

    def raw(channel, method: str, request) -> bytes:
        call = channel.unary_unary(method)  # no (de)serialisers: bytes in, bytes out
        return call(request.SerializeToString(), timeout=30)

    for method, request in (
        ("/csi.v1.Identity/GetPluginInfo", csi_pb2.GetPluginInfoRequest()),
        ("/csi.v1.Identity/GetPluginCapabilities", csi_pb2.GetPluginCapabilitiesRequest()),
        ("/csi.v1.Controller/ControllerGetCapabilities", csi_pb2.ControllerGetCapabilitiesRequest()),
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest()),
        ("/csi.v1.Controller/ListVolumes", csi_pb2.ListVolumesRequest(max_entries=1)),
        ("/csi.v1.Node/NodeGetInfo", csi_pb2.NodeGetInfoRequest()),
    ):
        expected = raw(driver.channel, method, request)
        assert raw(proxy.channel, method, request) == expected, method
    listed = csi_pb2.ListVolumesResponse.FromString(raw(proxy.channel, "/csi.v1.Controller/ListVolumes",
                                                        csi_pb2.ListVolumesRequest()))
    assert len(listed.entries) == 2
    # The node capabilities are the plugin's (the shim's), unchanged.
    request = csi_pb2.NodeGetCapabilitiesRequest()
    assert raw(proxy.channel, "/csi.v1.Node/NodeGetCapabilities", request) == \
        raw(shim.channel, "/csi.v1.Node/NodeGetCapabilities", request)
    # Errors too: same code, same message.
    missing = csi_pb2.ControllerGetVolumeRequest(volume_id="vol-00000000000000000000nope")
    codes = []
    for channel in (driver.channel, proxy.channel):
        with pytest.raises(grpc.RpcError) as info:
            raw(channel, "/csi.v1.Controller/ControllerGetVolume", missing)
        codes.append((info.value.code(), info.value.details()))
    assert codes[0] == codes[1] and codes[0][0] != Code.OK
