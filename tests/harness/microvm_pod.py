"""What the CRI tests of the microVM runtime (containerd's and CRI-O's) run
and read: a pod of RuntimeClass crust-microvm, the two containers that
write and read its volumes, an independent watch of the host's mount
table, and a volume's usage as kubelet gets it and as df in the guest
sees it."""

from __future__ import annotations

from crust.api import csi_pb2
from crust.kubelet import Container, Pod

# The first container writes into both volumes, then runs until a file
# appears (ExecSync makes it) and exits with a code of its own.
APP = ("echo hello-from-the-guest; echo ext4 > /ext4/written && echo xfs > /xfs/written && sync && "
       "ls -n /ext4/written /xfs/written; "
       "while [ ! -e /ext4/stop ]; do sleep 1; done; echo stopping; exit 7")
# The second reads what the first wrote, in the same VM and volume.
READER = "while [ ! -e /ext4/written ]; do sleep 1; done; echo second-sees-$(cat /ext4/written); exit 3"


def kubelet_volume_stats(node, pv, pod) -> dict[str, int]:
    """The volume's bytes as kubelet's NodeGetVolumeStats answers them."""
    rsp = node.kubelet.volume_stats(pv, pod)
    assert not rsp.volume_condition.abnormal, rsp.volume_condition.message
    b = {u.unit: u for u in rsp.usage}[csi_pb2.VolumeUsage.BYTES]
    return {"total": b.total, "used": b.used, "available": b.available}


def container_df(node, container_id: str, path: str) -> dict[str, int]:
    """The bytes of the file system at path as df in the container sees them."""
    out = node.runtime.exec_sync(container_id, ["/bin/df", "-P", "-B1", path], timeout=60)
    assert out.exit_code == 0, out.stderr
    fields = out.stdout.decode().splitlines()[-1].split()
    return {"total": int(fields[1]), "used": int(fields[2]), "available": int(fields[3])}


def microvm_pod(node, name: str, volumes: dict, containers: list[Container]) -> Pod:
    """A host-network pod of RuntimeClass crust-microvm that is never restarted."""
    return Pod(uid=f"uid-{name}", name=name, fs_group=2000, host_network=True, runtime_class_name="crust-microvm",
               volumes=volumes, restart_policy="Never", termination_grace_period_seconds=2, containers=containers)
