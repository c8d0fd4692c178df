"""A container's security context holds inside the pod, whatever runs it:
the same pod under runc (the baseline) and under crust-microvm (crun in the
guest, from the OCI spec containerd wrote: crust.kata.pod.container_spec), started
through CRI as kubelet starts it (crust.kubelet), checked by what the
container's processes are: their effective uid after a setuid-root binary,
no_new_privs, capabilities, groups, masked and read-only /proc paths."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from crust.kubelet import HostPath, VolumeMount
from tests.harness.daemons import wait_until
from tests.harness.pod_nodes import KEEP_RUNNING, cri_log, node  # noqa: F401 - node is the fixture

# Prints its effective and real uid: made setuid-root, it says whether the
# exec gained root (euid 0) or the kernel refused it (no_new_privs).
EUID_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) { printf("euid=%d uid=%d\n", (int)geteuid(), (int)getuid()); return 0; }
"""
# containerd's default capabilities for a container (oci.DefaultCaps):
# CHOWN, DAC_OVERRIDE, FSETID, FOWNER, MKNOD, NET_RAW, SETGID, SETUID,
# SETFCAP, SETPCAP, NET_BIND_SERVICE, SYS_CHROOT, KILL, AUDIT_WRITE.
DEFAULT_CAPS = 0x00000000A80425FB
NET_ADMIN = 1 << 12


@pytest.fixture(scope="module")
def setuid_root_binary(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the setuid probe (./run tests installs it)", pytrace=False)
    directory = tmp_path_factory.mktemp("suid")
    directory.chmod(0o755)   # a hostPath every user of the pod may enter
    source = directory / "euid.c"
    source.write_text(EUID_C)
    binary = directory / "euid"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(source)], check=True)
    os.chown(binary, 0, 0)
    os.chmod(binary, 0o4755)
    source.unlink()
    return directory


def status_fields(text: bytes) -> dict[str, str]:
    fields = {}
    for line in text.decode().splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def test_the_security_context_holds_in_the_container(node, setuid_root_binary):  # noqa: F811
    probe = VolumeMount("probe", "/probe", read_only=True)
    status = "grep -E '^(NoNewPrivs|CapEff|CapBnd|CapPrm)' /proc/self/status; "
    pod = node.pod("security", supplemental_groups=[1234, 5678],
                   volumes={"probe": HostPath(str(setuid_root_binary))},
                   containers=[
                       node.container("nnp", status + "/probe/euid; " + KEEP_RUNNING, probe, run_as_user=1000,
                                      allow_privilege_escalation=False),
                       node.container("escalates", KEEP_RUNNING, probe, run_as_user=1000),
                       node.container("dropall", KEEP_RUNNING, probe, capabilities_drop=["ALL"]),
                       node.container("netadmin", KEEP_RUNNING, probe, capabilities_add=["NET_ADMIN"]),
                       node.container("groups", KEEP_RUNNING, probe, run_as_user=1000, run_as_group=3000),
                   ])
    with node.running(pod):
        ids = {name: node.status(pod, name).id for name in ("nnp", "escalates", "dropall", "netadmin", "groups")}

        # no_new_privs: the setuid-root binary runs, and stays uid 1000; in
        # the container's own process and in an exec (which takes the
        # container's settings, as containerd builds an exec's spec).
        assert node.run(ids["nnp"], "/probe/euid") == b"euid=1000 uid=1000\n"
        log_path = node.status(pod, "nnp").log_path
        wait_until(lambda: "euid=" in Path(log_path).read_text(errors="replace"),
                   what=f"the container's output in {log_path}: {Path(log_path).read_text(errors='replace')!r}")
        own = dict(line.partition(":")[::2] for _, line in cri_log(log_path) if ":" in line)
        assert own.get("NoNewPrivs", "").strip() == "1" and own.get("CapEff", "").strip() == "0" * 16, own
        assert any(line == "euid=1000 uid=1000" for _, line in cri_log(log_path)), cri_log(log_path)
        nnp = status_fields(node.run(ids["nnp"], "/bin/grep", "-E", "^(NoNewPrivs|CapEff)", "/proc/self/status"))
        assert nnp == {"NoNewPrivs": "1", "CapEff": "0000000000000000"}, nnp
        # Without it the same binary gains root, as the kernel lets it.
        assert node.run(ids["escalates"], "/probe/euid") == b"euid=0 uid=1000\n"
        assert status_fields(node.run(ids["escalates"], "/bin/grep", "NoNewPrivs", "/proc/self/status")) == {
            "NoNewPrivs": "0"}

        # Capabilities: none at all once ALL is dropped; containerd's default
        # set for root, plus what is added.
        dropped = status_fields(node.run(ids["dropall"], "/bin/grep", "-E", "^Cap(Eff|Prm|Bnd)", "/proc/self/status"))
        assert dropped == {"CapEff": "0000000000000000", "CapPrm": "0000000000000000",
                           "CapBnd": "0000000000000000"}, dropped
        refused = node.runtime.exec_sync(ids["dropall"], ["/bin/chown", "1:1", "/tmp"])
        assert refused.exit_code != 0 and b"Operation not permitted" in refused.stderr, refused
        added = status_fields(node.run(ids["netadmin"], "/bin/grep", "-E", "^Cap(Eff|Bnd)", "/proc/self/status"))
        assert int(added["CapEff"], 16) == DEFAULT_CAPS | NET_ADMIN, added
        assert int(added["CapBnd"], 16) == DEFAULT_CAPS | NET_ADMIN, added
        default = status_fields(node.run(ids["escalates"], "/bin/grep", "CapBnd", "/proc/self/status"))
        assert int(default["CapBnd"], 16) == DEFAULT_CAPS, default

        # The user, its group and the pod's supplemental groups.
        ids_of = status_fields(node.run(ids["groups"], "/bin/grep", "-E", "^(Uid|Gid|Groups)", "/proc/self/status"))
        assert ids_of["Uid"].split() == ["1000"] * 4 and ids_of["Gid"].split() == ["3000"] * 4, ids_of
        assert sorted(ids_of["Groups"].split()) == ["1234", "3000", "5678"], ids_of

        # Masked and read-only /proc paths (kubelet's defaults), for root.
        assert node.run(ids["netadmin"], "/bin/sh", "-c", "wc -c < /proc/timer_list") == b"0\n"
        refused = node.runtime.exec_sync(ids["netadmin"], ["/bin/sh", "-c", "echo 1 > /proc/sys/vm/overcommit_memory"])
        assert refused.exit_code != 0 and b"Read-only file system" in refused.stderr, refused
