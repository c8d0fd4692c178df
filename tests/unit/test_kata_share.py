"""Which of a pod's paths the guest caches and which its agent mirrors
(crust.kata.vmm.share).
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("source, expected", [
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~configmap/cfg", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~secret/creds/db/password", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~projected/kube-api-access-x7k2p", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~downward-api/info/", True),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~empty-dir/cache", False),
    ("/var/lib/kubelet/pods/uid-1/volumes/kubernetes.io~configmap", False),      # the plugin's directory
    ("/var/lib/kubelet/pods/uid-1/volume-subpaths/cfg/app/0", False),           # a subPath: never updated
    ("/var/lib/kubelet/pods/uid-1/etc-hosts", False),
    ("/srv/kubernetes.io~configmap/cfg", False),
    ("/pods/volumes/kubernetes.io~secret/x", False),
])
def test_an_atomic_writer_volume_is_known_by_kubelets_path(source, expected):
    from crust.kata.vmm.share import is_atomic_writer_volume

    assert is_atomic_writer_volume(source) is expected


@pytest.mark.parametrize("source, cached, mirrored", [
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/scratch", True, False),
    ("/var/lib/kubelet/pods/u1/volume-subpaths/config/app/0", True, False),
    ("/var/lib/kubelet/pods/u1/etc-hosts", True, False),
    ("/var/lib/kubelet/pods/u1/containers/app/1a2b", True, False),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~configmap/cfg", False, True),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~projected/kube-api-access-x", False, True),
    ("/var/lib/kubelet/pods/u1/volumes/kubernetes.io~secret/creds/key", False, False),
    ("/srv/data", False, False),                        # a hostPath
    ("/var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/9f/resolv.conf", False, False),
    ("/var/lib/kubelet/pods", False, False),
])
def test_what_the_guest_caches_and_what_its_agent_mirrors(source, cached, mirrored):
    """Only what nobody but the pod changes is cached in the guest; the
    atomic writer's volumes themselves (not a path inside one) are mirrored."""
    from crust.kata.vmm.share import cached_in_guest, is_atomic_writer_volume_root

    assert cached_in_guest(source) is cached
    assert is_atomic_writer_volume_root(source) is mirrored
