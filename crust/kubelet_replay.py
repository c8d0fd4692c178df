"""Kubelet's replay moved to the crust.kubelet package (its CSI side is
crust.kubelet.csi); this name stays for older imports and is that module."""

import sys

from crust.kubelet import csi

sys.modules[__name__] = csi
