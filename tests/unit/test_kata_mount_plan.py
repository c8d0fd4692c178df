"""The guest agent's refusals said in the pod's terms (crust.kata.mount_plan)."""

from __future__ import annotations


def test_the_guest_agents_refusal_of_a_bind_is_said_as_the_pods_spec_says_the_mount():
    from crust.common.errors import FailedPrecondition, InvalidArgument
    from crust.kata.mount_plan import in_pod_terms

    names = ["mount /config: /var/lib/kubelet/pods/u/volumes/cm", "mount /mnt: subPath 's' of the emptyDir shared"]
    told = in_pod_terms(InvalidArgument("container c1: the guest's agent: binds[1].source.subpath: subpath s: "
                                        "resolves outside its volume"), names)
    missing = in_pod_terms(FailedPrecondition("container c1: the guest's agent: binds[0].source.share.path: "
                                              "config in the share crust: No such file or directory"), names)
    other = FailedPrecondition("container c1: the guest's agent: oci_spec: the OCI runtime refused it: x")
    beyond = InvalidArgument("binds[5].source.subpath: subpath q: resolves outside its volume")
    assert (type(told), told.message) == (InvalidArgument, "mount /mnt: subPath 's' of the emptyDir shared: "
                                                            "resolves outside its volume")
    assert (type(missing), missing.message) == (FailedPrecondition, "mount /config: /var/lib/kubelet/pods/u/"
                                                                    "volumes/cm: config in the share crust: No "
                                                                    "such file or directory")
    assert in_pod_terms(other, names) is other and in_pod_terms(beyond, names) is beyond
