"""What the microVM handler records of a pod (crust.kata.pods): its
containers, their processes, its network; one JSON record per pod
(crust.common.recordstore), read back by a restarted handler."""

from __future__ import annotations

import hashlib
import secrets
import shlex
import time
from typing import ClassVar

from pydantic import BaseModel, Field

from crust.runtime_handler.handler import VolumeView

GUEST_CONTAINERS = "/run/crust/containers"
UNSHARE = "/sbin/unshare"     # util-linux's, in the guest image (crust.kata.image)
VM_GONE_EXIT_CODE = 255


class ProcessRecord(BaseModel):
    exec_id: str = ""
    args: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: list[int] | None = None   # an exec's, when it names them (else the container's)
    name: str = ""              # its output files in the guest (set when started)
    pid: int = 0                # the agent's pid for it; 0 until started
    exit_code: int | None = None
    exited_at_ns: int = 0
    reason: str = ""            # why it stopped, when not by itself
    terminal: bool = False      # runs on a terminal of the guest's (its output one stream)
    stdin: bool = False         # reads a standard input (WriteInput)
    oom_killed: bool = False    # the container's own process, once stopped: the OOM killer struck
    on_port: bool = False       # run by the guest's Python agent: its output, input and exit on its port


class GuestContainer(BaseModel):
    """What the guest's OCI runtime is given for a container (crust.kata.guest_oci)."""
    spec: dict = Field(default_factory=dict)
    sysctls: dict[str, str] = Field(default_factory=dict)
    hostname: str = ""
    # The guest's Python agent places the root and the binds' sources
    # (crust.guest.places): spec's are empty, sources names them (a
    # CreateContainerRequest's rootfs, binds and pod_pid_namespace).
    placed_by_agent: bool = False
    pod_pid_namespace: bool = False
    sources: dict = Field(default_factory=dict)
    bind_names: list[str] = Field(default_factory=list)   # each bind as the pod's spec says it


class ContainerRecord(BaseModel):
    container_id: str
    bundle: str
    # A root file system image of crust 0.x (made by copying, hot-plugged
    # under this serial): only in records of pods started before the share.
    image: str = ""
    serial: str = ""
    # Deferred volumes (the pod record's keys) -> this container's views.
    volumes: dict[str, list[VolumeView]] = Field(default_factory=dict)
    processes: dict[str, ProcessRecord] = Field(default_factory=dict)  # by exec id, "" the container's own
    readonly_root: bool = False
    # Run by crun in the guest, from this spec; None: a container of a pod
    # whose VM has no OCI runtime (started before crust ran containers so).
    oci: GuestContainer | None = None
    # True: crun mounts its root and binds in the container's namespace;
    # False (no OCI runtime, or a record of an earlier handler): the agent mounted
    # them below root in the guest's, and unmounts them at the delete.
    runtime_mounts: bool = False
    # True: the guest's Python agent made it (CreateContainer): its own
    # process is the agent's (container, "") and starts with StartContainer.
    created_on_port: bool = False

    @property
    def root(self) -> str:
        return f"{GUEST_CONTAINERS}/{self.container_id}/rootfs"


class PodNetwork(BaseModel):
    """The pod's network as CNI made it in its namespace, which the VM's NIC
    joined (crust.sys.podnet)."""
    netns: str                  # the namespace's path (the sandbox spec's)
    interface: str              # the veth CNI made there
    address: str = ""           # the pod's IPv4 address (port forwarding connects to it)


class PodRecord(BaseModel):
    FORMAT_VERSION: ClassVar[int] = 1
    sandbox_id: str
    bundle: str = ""
    # None: the VM has no NIC (a host-network pod, or no CNI network).
    network: PodNetwork | None = None
    containers: dict[str, ContainerRecord] = Field(default_factory=dict)
    # Why the VM is gone, once it is (the pod stays listed until DeletePod).
    gone: str = ""
    # The guest's OCI runtime ("crun"); "" for a pod started before the
    # guest had one (its containers run with unshare, as they started).
    guest_runtime: str = ""
    created_at: float = Field(default_factory=time.time)


def output_name(sandbox_id: str, container_id: str, exec_id: str) -> str:
    """A plain word naming a process's output files in the guest, new at
    each start (the agent never reuses a name)."""
    digest = hashlib.sha256(f"{sandbox_id}\0{container_id}\0{exec_id}".encode()).hexdigest()[:16]
    return f"{digest}-{secrets.token_hex(4)}"


def command_line(root: str, process: ProcessRecord) -> str:
    """The guest's shell line: the working directory made (as runc makes
    it; unshare --wd refuses one that is still missing, a read-only root),
    then a clean environment, chrooted, the user's ids, the args."""
    env = [e for e in process.env if "=" in e and not e.startswith("=")]
    cwd = process.cwd or "/"
    return (f"mkdir -p {shlex.quote(root + cwd)} 2>/dev/null; exec env -i "
            + " ".join(shlex.quote(e) for e in env)
            + f" {UNSHARE} --root={shlex.quote(root)} --wd={shlex.quote(cwd)}"
            + f" --setuid {process.uid} --setgid {process.gid} -- "
            + " ".join(shlex.quote(a) for a in process.args))
