"""A microVM container's binds planned from its OCI spec (crust.kata.pod.mount_plan),
without a VM: what each bind is, in the spec's order, each refusal with its
status and the mount it names, the facts the host gives of a source, read
from a real tree, and the guest agent's refusals said in the pod's terms."""

from __future__ import annotations

import os

import pytest

from crust.common.errors import FailedPrecondition, InvalidArgument
from crust.kata.pod import mount_plan
from crust.kata.pod.mount_plan import HOST, TMPFS, VOLUME, SourceFacts, in_pod_terms, plan
from crust.kata.agent.calls import SHM_TMPFS
from crust.runtime_handler.oci import Mount

KUBELET = "/var/lib/kubelet/pods/uid-1"


def bind(destination: str, source: str, *options: str, type: str = "bind") -> Mount:
    return Mount(destination=destination, source=source, type=type, options=["rbind", *options])


def there(source: str, **facts) -> SourceFacts:
    return SourceFacts(exists=True, real=facts.pop("real", source), **facts)


def test_each_bind_is_planned_as_what_its_source_is_in_the_specs_order():
    volume = object()   # the handler's Resolved, carried as it is
    mounts = [
        Mount(destination="/proc", source="proc", type="proc"),
        bind("/data", f"{KUBELET}/volumes/kubernetes.io~csi/pv-1/mount"),
        bind("/etc/hosts", f"{KUBELET}/etc-hosts", "ro"),
        bind("/dev/shm", "/run/containerd/sandboxes/s/shm"),
        bind("/cache", f"{KUBELET}/volumes/kubernetes.io~empty-dir/cache"),
        Mount(destination="/logs", source=f"{KUBELET}/volumes/kubernetes.io~empty-dir/logs", type="none",
              options=["bind"]),
        Mount(destination="/dev/pts", source="devpts", type="devpts"),
    ]
    facts = {
        f"{KUBELET}/volumes/kubernetes.io~csi/pv-1/mount": SourceFacts(volume=volume, direct=True),
        f"{KUBELET}/etc-hosts": there(f"{KUBELET}/etc-hosts"),
        "/run/containerd/sandboxes/s/shm": there("/run/containerd/sandboxes/s/shm"),
        f"{KUBELET}/volumes/kubernetes.io~empty-dir/cache": there(
            f"{KUBELET}/volumes/kubernetes.io~empty-dir/cache", memory=("cache", "", "64m")),
        f"{KUBELET}/volumes/kubernetes.io~empty-dir/logs": there(f"{KUBELET}/volumes/kubernetes.io~empty-dir/logs"),
    }
    planned = plan(mounts, facts)
    assert [(p.mount.destination, p.kind, p.what) for p in planned] == [
        ("/data", VOLUME, (volume, True)),
        ("/etc/hosts", HOST, None),
        ("/dev/shm", TMPFS, (SHM_TMPFS, "", "")),
        ("/cache", TMPFS, ("cache", "", "64m")),
        ("/logs", HOST, None),
    ]
    # The facts asked for are exactly those of the binds.
    assert mount_plan.bind_sources(mounts) == [m.source for m in mounts if m.destination not in ("/proc", "/dev/pts")]
    # A relative source is refused before any source is looked at.
    with pytest.raises(InvalidArgument) as relative:
        mount_plan.bind_sources([*mounts, bind("/rel", "data/dir")])
    assert relative.value.message == "mount /rel: source 'data/dir' must be an absolute path"


@pytest.mark.parametrize(("mount", "facts", "status", "words"), [
    (bind("/data", "relative/dir"), {}, InvalidArgument,
     "mount /data: source 'relative/dir' must be an absolute path"),
    (bind("/data", "/nowhere"), {"/nowhere": SourceFacts()}, FailedPrecondition,
     "mount /data: source /nowhere does not exist"),
    (bind("/data", "/srv/link"), {"/srv/link": there(
        "/srv/link", real=f"{KUBELET}/volumes/kubernetes.io~csi/pv-2/mount")}, InvalidArgument,
     f"mount /data: source /srv/link leads to a CSI volume's path ({KUBELET}/volumes/kubernetes.io~csi/pv-2/mount)"),
])
def test_a_bind_that_cannot_work_is_refused_naming_its_mount(mount, facts, status, words):
    ok = bind("/ok", "/srv/ok")
    with pytest.raises(status) as refused:
        plan([ok, mount], {"/srv/ok": there("/srv/ok"), **facts})
    assert refused.value.message.startswith(words), refused.value.message


def test_the_hosts_facts_of_a_source_are_read_from_its_tree(tmp_path):
    csi = tmp_path / "pods" / "uid" / "volumes" / "kubernetes.io~csi" / "pv" / "mount"
    csi.mkdir(parents=True)
    (tmp_path / "to-csi").symlink_to(csi)
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    to_csi = mount_plan.host_facts(str(tmp_path / "to-csi"))
    assert to_csi.exists and to_csi.real == str(csi) and to_csi.volume is None and to_csi.memory is None
    # A link counts as the source being there, wherever it leads.
    assert mount_plan.host_facts(str(tmp_path / "dangling")).exists
    assert not mount_plan.host_facts(str(tmp_path / "missing")).exists
    with pytest.raises(InvalidArgument):
        plan([bind("/v", str(tmp_path / "to-csi"))], {str(tmp_path / "to-csi"): to_csi})
    file = str(tmp_path / "file")
    assert plan([bind("/f", file)], {file: mount_plan.host_facts(file)})[0].kind == HOST
    assert os.path.realpath(file) == mount_plan.host_facts(file).real



def test_the_guest_agents_refusal_of_a_bind_is_said_as_the_pods_spec_says_the_mount():
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
