"""A container's OCI spec made for the guest (crust.kata.pod.container_spec): what is
kept, what is dropped and what is refused.
"""

from __future__ import annotations

import pytest


def _containerd_like_spec(**linux) -> dict:
    return {"ociVersion": "1.0.2", "hostname": "web-0", "root": {"path": "rootfs", "readonly": True},
            "process": {"args": ["/app"], "env": ["A=1"], "cwd": "/", "user": {"uid": 1000, "gid": 1000},
                        "noNewPrivileges": True, "apparmorProfile": "cri-containerd.apparmor.d",
                        "capabilities": {"bounding": ["CAP_CHOWN"], "effective": ["CAP_CHOWN"]}},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                       {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/x/hosts",
                        "options": ["rbind", "ro"]},
                       {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"}],
            "linux": {"namespaces": [{"type": "pid"}, {"type": "ipc", "path": "/proc/9/ns/ipc"},
                                     {"type": "uts", "path": "/proc/9/ns/uts"}, {"type": "mount"},
                                     {"type": "network", "path": "/var/run/netns/cni-1"}],
                      "cgroupsPath": "/kubepods/besteffort/pod1/abc", "devices": [{"path": "/dev/fuse"}],
                      "maskedPaths": ["/proc/kcore"], "readonlyPaths": ["/proc/sys"],
                      "sysctl": {"net.ipv4.ip_unprivileged_port_start": "0"},
                      "seccomp": {"defaultAction": "SCMP_ACT_ERRNO"}, "mountLabel": "x", **linux}}


def test_a_containers_spec_for_the_guest_keeps_its_confinement_and_drops_the_hosts_paths():
    from crust.kata.pod import container_spec

    spec, sysctls, hostname = container_spec.guest_spec(_containerd_like_spec(), "/run/crust/containers/c/rootfs", "c")
    assert spec["root"] == {"path": "/run/crust/containers/c/rootfs", "readonly": True}
    assert spec["mounts"][0] == {"destination": "/proc", "type": "proc", "source": "proc"}
    assert spec["process"]["noNewPrivileges"] is True and spec["process"]["user"]["uid"] == 1000
    assert "apparmorProfile" not in spec["process"]
    assert spec["process"]["capabilities"]["bounding"] == ["CAP_CHOWN"]
    # The host's mounts in its order: the kernel's and tmpfs fresh, a bind's
    # source left for the guest's path, and none run before it has one; the
    # terminals and /dev/shm containerd's default spec has, below /dev.
    assert [m["destination"] for m in spec["mounts"]] == ["/proc", "/dev", "/dev/shm", "/dev/pts", "/etc/hosts",
                                                         "/sys/fs/cgroup"]
    assert spec["mounts"][3]["type"] == "devpts" and spec["mounts"][2]["type"] == "tmpfs"
    assert spec["mounts"][4] == {"destination": "/etc/hosts", "type": "bind", "source": "", "options": ["bind"]}
    bare, _, _ = container_spec.guest_spec({"process": {"args": ["/x"]}}, "/r", "c")
    assert [m["destination"] for m in bare["mounts"]] == ["/dev", "/dev/shm", "/dev/pts", "/proc"]
    # A new namespace stays; the pod's (a path) is the guest's own; no new network.
    assert spec["linux"]["namespaces"] == [{"type": "pid"}, {"type": "mount"}]
    # crun's cgroup below one the agent keeps until the container is deleted (its OOM count).
    assert spec["linux"]["cgroupsPath"] == "/crust/c/ctr"
    assert spec["linux"]["maskedPaths"] == ["/proc/kcore"] and spec["linux"]["readonlyPaths"] == ["/proc/sys"]
    assert spec["linux"]["seccomp"] == {"defaultAction": "SCMP_ACT_ERRNO"}
    assert "devices" not in spec["linux"] and "mountLabel" not in spec["linux"] and "sysctl" not in spec["linux"]
    # The pod's settings go to the guest: its UTS namespace is the pod's.
    assert sysctls == {"net.ipv4.ip_unprivileged_port_start": "0"} and hostname == "web-0"
    assert "hostname" not in spec
    process = container_spec.exec_process(spec["process"], ["id"], ["B=2"], "/tmp", 5, 6, None)
    assert process["args"] == ["id"] and process["user"] == {"uid": 5, "gid": 6} and process["noNewPrivileges"]
    assert spec["process"]["args"] == ["/app"]   # the container's own untouched


def test_a_process_on_a_terminal_keeps_it_for_crun_and_an_exec_sizes_its_own():
    from crust.kata.pod import container_spec

    host = _containerd_like_spec()
    host["process"].update(terminal=True, consoleSize={"width": 100, "height": 30})
    spec, _, _ = container_spec.guest_spec(host, "/r", "c")
    # crun makes the terminal in the container's devpts, of the spec's size.
    assert spec["process"]["terminal"] is True and spec["process"]["consoleSize"] == {"width": 100, "height": 30}
    process = container_spec.exec_process(spec["process"], ["sh"], [], "/", 0, 0, terminal=True)
    assert process["terminal"] is True and "consoleSize" not in process


def test_a_shared_pid_namespace_is_the_pods_in_the_guest():
    from crust.kata.pod import container_spec

    shared = _containerd_like_spec(namespaces=[{"type": "pid", "path": "/proc/9/ns/pid"}, {"type": "mount"}])
    assert container_spec.needs_pod_pid_namespace(shared)
    assert not container_spec.needs_pod_pid_namespace(_containerd_like_spec())
    # The guest's agent adds the pod's namespace's path (CreateContainer's
    # pod_pid_namespace): the spec names none, and no namespace of the host.
    spec, _, _ = container_spec.guest_spec(shared, "/r", "c")
    assert [ns for ns in spec["linux"]["namespaces"] if ns["type"] == "pid"] == []


def test_the_guest_spec_states_its_own_version_whatever_1x_the_host_wrote():
    """CRI-O writes 1.3.0; the guest's crun takes only 1.0 specs, and the
    guest's spec is container_spec's own."""
    from crust.kata.pod import container_spec

    for version in ("1.0.2-dev", "1.3.0"):
        spec, _, _ = container_spec.guest_spec({**_containerd_like_spec(), "ociVersion": version}, "/r", "c")
        assert spec["ociVersion"] == container_spec.GUEST_OCI_VERSION == "1.0.2"


@pytest.mark.parametrize("change, field", [
    ({"linux": {"uidMappings": [{"containerID": 0, "hostID": 1000, "size": 1}]}}, "linux.uidMappings"),
    ({"linux": {"namespaces": [{"type": "user"}, {"type": "pid"}]}}, "linux.namespaces"),
    ({"hooks": {"prestart": [{"path": "/bin/true"}]}}, "hooks"),
    ({"linux": {"namespaces": [{"type": "pid"}], "sysctl": {"net.core/../x": "1"}}}, "linux.sysctl"),
    ({"hostname": "a b"}, "hostname"),
    ({"ociVersion": "2.0.0"}, "ociVersion"),
])
def test_what_the_guest_cannot_honour_is_refused_naming_the_field(change, field):
    from crust.common.errors import InvalidArgument
    from crust.kata.pod import container_spec

    spec = {**_containerd_like_spec(), **change}
    with pytest.raises(InvalidArgument) as refused:
        container_spec.guest_spec(spec, "/r", "c")
    assert str(refused.value.message if hasattr(refused.value, "message") else refused.value).startswith(field)
