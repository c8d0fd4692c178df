"""CSI Identity service: who the plugin is and whether it is ready."""

from __future__ import annotations

from typing import Callable

from crust import __version__
from crust.api import csi_pb2, csi_pb2_grpc
from crust.driver.config import DRIVER_NAME

PluginCap = csi_pb2.PluginCapability


class IdentityService(csi_pb2_grpc.IdentityServicer):
    def __init__(self, *, controller: bool, ready: Callable[[], bool]):
        self.controller = controller
        self.ready = ready

    async def GetPluginInfo(self, request, context):
        return csi_pb2.GetPluginInfoResponse(name=DRIVER_NAME, vendor_version=__version__,
                                             manifest={"backend": "loop"})

    async def GetPluginCapabilities(self, request, context):
        caps = [
            PluginCap(service=PluginCap.Service(type=PluginCap.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS)),
            PluginCap(volume_expansion=PluginCap.VolumeExpansion(type=PluginCap.VolumeExpansion.ONLINE)),
            PluginCap(volume_expansion=PluginCap.VolumeExpansion(type=PluginCap.VolumeExpansion.OFFLINE)),
        ]
        if self.controller:
            caps[:0] = [PluginCap(service=PluginCap.Service(type=PluginCap.Service.CONTROLLER_SERVICE)),
                        PluginCap(service=PluginCap.Service(type=PluginCap.Service.GROUP_CONTROLLER_SERVICE))]
        return csi_pb2.GetPluginCapabilitiesResponse(capabilities=caps)

    async def Probe(self, request, context):
        return csi_pb2.ProbeResponse(ready={"value": self.ready()})
