"""Kubelet's side of a node, replayed from kubelet's public source for the
demo and the tests, and the container runtime it talks to:

- crust.kubelet.csi: plugin registration and the volume manager's CSI calls;
- crust.kubelet.volumes: the volume manager for the volumes a pod brings
  along (emptyDir, configMap, secret, projected, downwardAPI, hostPath) and
  subPath binds, with crust.kubelet.atomic_writer;
- crust.kubelet.cri: the runtime manager's CRI calls (pods, init containers
  and sidecars, containers);
- crust.kubelet.pod: what kubelet knows of a pod, its containers and volumes;
- crust.kubelet.containerd, crust.kubelet.image: a private containerd and the
  tiny image its pods run; with it crust.kubelet.ctr (containers from specs
  of one's own through ctr), crust.kubelet.registry (a local registry it
  pulls from through mirrors) and crust.kubelet.cni (a pod network of its
  own);
- crust.kubelet.crio: a private CRI-O, the other CRI runtime, pulling from
  the same registry, its OCI runtimes called through
  crust.kubelet.runtime_wrapper where this machine cannot give what CRI-O
  asks.
"""

from crust.kubelet.csi import Kubelet, RegistrationRefused, highest_supported_version, is_mount_point
from crust.kubelet.pod import (ConfigMap, Container, ContainerPort, DownwardAPI, DownwardAPIFile, EmptyDir, HostPath,
                               KeyToPath, PersistentVolume, Pod, Projected, Secret, ServiceAccountToken, VolumeMount,
                               service_account_volume)
from crust.kubelet.volumes import VolumeError, VolumeManager

__all__ = ["ConfigMap", "Container", "ContainerPort", "DownwardAPI", "DownwardAPIFile", "EmptyDir", "HostPath", "KeyToPath",
           "Kubelet", "PersistentVolume", "Pod", "Projected", "RegistrationRefused", "Secret",
           "ServiceAccountToken", "VolumeError", "VolumeManager", "VolumeMount", "highest_supported_version",
           "is_mount_point", "service_account_volume"]
