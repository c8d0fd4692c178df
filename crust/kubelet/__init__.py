"""Kubelet's side of a node, replayed from kubelet's public source for the
demo and the tests, and the container runtime it talks to:

- crust.kubelet.csi: plugin registration and the volume manager's CSI calls;
- crust.kubelet.cri: the runtime manager's CRI calls (pods and containers);
- crust.kubelet.pod: what kubelet knows of a pod, its containers and volumes;
- crust.kubelet.containerd, crust.kubelet.image: a private containerd and the
  tiny image its pods run; with it crust.kubelet.ctr (containers from specs
  of one's own through ctr), crust.kubelet.registry (a local registry it
  pulls from through mirrors) and crust.kubelet.cni (a pod network of its
  own).
"""

from crust.kubelet.csi import Kubelet, RegistrationRefused, highest_supported_version, is_mount_point
from crust.kubelet.pod import Container, PersistentVolume, Pod, VolumeMount

__all__ = ["Container", "Kubelet", "PersistentVolume", "Pod", "RegistrationRefused", "VolumeMount",
           "highest_supported_version", "is_mount_point"]
