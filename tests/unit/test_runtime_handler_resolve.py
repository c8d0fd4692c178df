"""A pod's uid and its volumes (crust.runtime_handler.resolve, with
crust.kata.pod.pods.pod_uid).
"""

from __future__ import annotations


def test_a_pods_uid_comes_from_containerds_annotations_and_its_volumes_from_the_index():
    from crust.contract.mountinfo import MountInfo, digest
    from crust.kata.pod.pods import pod_uid
    from crust.runtime_handler.resolve import pod_volumes

    uid = "0c6d8a2e-5b8f-4e0c-9d3a-1f2e3d4c5b6a"
    assert pod_uid({"annotations": {"io.kubernetes.cri.sandbox-uid": uid}}) == uid
    # containerd before the uid annotation: the log directory's last part.
    assert pod_uid({"annotations": {"io.kubernetes.cri.sandbox-log-directory":
                                    f"/var/log/pods/my_ns_web_{uid}/"}}) == uid
    for spec in ({}, {"annotations": {}}, {"annotations": {"io.kubernetes.cri.sandbox-uid": "../x/y"}},
                 {"annotations": {"io.kubernetes.cri.sandbox-log-directory": "/var/log/pods/nouid"}}):
        assert pod_uid(spec) == "", spec

    def target(pod: str, pv: str, leaf: str = "mount") -> str:
        return f"/var/lib/kubelet/pods/{pod}/volumes/kubernetes.io~csi/{pv}/{leaf}"

    class Index:   # the one method pod_volumes asks
        def __init__(self, paths):
            self.entries = {digest(p): MountInfo(device="/dev/null", fstype="ext4", target_path=p) for p in paths}

        def items(self):
            return list(self.entries.items())

    ours = [target(uid, "pv-b"), target(uid, "pv-a")]
    index = Index(ours + [target("another-pod", "pv-c"), target(uid, "pv-d", "elsewhere"),
                          f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/pv-e/mount",
                          f"/var/lib/kubelet/pods/{uid}/volume-subpaths/pv-f/c/0",
                          f"/var/lib/kubelet/pods/x/volumes/kubernetes.io~csi/{uid}/mount"])
    found = pod_volumes(uid, index)
    assert [r.info.target_path for r in found] == sorted(ours)
    assert all(r.digest == digest(r.info.target_path) and r.subpath == "" for r in found)
    assert pod_volumes("another-pod", index)[0].info.target_path == target("another-pod", "pv-c")
    assert pod_volumes("nobody", index) == []
