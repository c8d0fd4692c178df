"""What the microVM handler records of a pod (crust.kata.pod.pods): its
containers, their own processes, its network; one JSON record per pod
(crust.common.recordstore), read back by a restarted handler.

An exec lives in memory only, from its start to containerd's Delete of
it (or the bound on exited execs nobody deletes, crust.kata.pod.processes):
the record holds what finds the pod again, never its history, so its
size and the cost of a write do not grow with the execs a pod ran. A
restarted handler learns the execs of a running VM from the guest's
agent (ListProcesses), which knows every exec not removed."""

from __future__ import annotations

import time
from typing import ClassVar

from pydantic import BaseModel, Field, field_serializer, field_validator

from crust.runtime_handler.handler import VolumeView

GUEST_CONTAINERS = "/run/crust/containers"
VM_GONE_EXIT_CODE = 255


class ProcessRecord(BaseModel):
    exec_id: str = ""
    args: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    cwd: str = "/"
    uid: int = 0
    gid: int = 0
    additional_gids: list[int] | None = None   # an exec's, when it names them (else the container's)
    pid: int = 0                # the agent's pid for it; 0 until started
    exit_code: int | None = None
    exited_at_ns: int = 0
    reason: str = ""            # why it stopped, when not by itself
    terminal: bool = False      # runs on a terminal (its output one stream)
    stdin: bool = False         # reads a standard input (WriteInput)
    oom_killed: bool = False    # the container's own process, once stopped: the OOM killer struck
    on_port: bool = False       # started by the guest's agent: its output, input and exit on its port


class GuestContainer(BaseModel):
    """What the guest's OCI runtime is given for a container (crust.kata.pod.container_spec)."""
    spec: dict = Field(default_factory=dict)
    sysctls: dict[str, str] = Field(default_factory=dict)
    hostname: str = ""
    # The guest's agent places the root and the binds' sources
    # (crust.guest.places): spec's are empty, sources names them (a
    # CreateContainerRequest's rootfs, binds and pod_pid_namespace).
    placed_by_agent: bool = False
    pod_pid_namespace: bool = False
    sources: dict = Field(default_factory=dict)
    bind_names: list[str] = Field(default_factory=list)   # each bind as the pod's spec says it


class ContainerRecord(BaseModel):
    container_id: str
    bundle: str
    # Deferred volumes (the pod record's keys) -> this container's views.
    volumes: dict[str, list[VolumeView]] = Field(default_factory=dict)
    processes: dict[str, ProcessRecord] = Field(default_factory=dict)  # by exec id, "" the container's own
    readonly_root: bool = False
    # Run by crun in the guest, from this spec.
    oci: GuestContainer | None = None
    # crun mounts its root and binds in the container's namespace.
    runtime_mounts: bool = False
    # The guest's agent made it (CreateContainer): its own process is the
    # agent's (container, "") and starts with StartContainer. False only in
    # the record of a container whose create failed half way.
    created_on_port: bool = False

    @field_serializer("processes", mode="wrap")
    def _own_process_only(self, processes: dict[str, ProcessRecord], write):
        return write({k: p for k, p in processes.items() if k == ""})

    @field_validator("processes")
    @classmethod
    def _no_execs(cls, processes: dict[str, ProcessRecord]) -> dict[str, ProcessRecord]:
        # A record an older crust wrote with its execs: the agent's list is
        # what a restarted handler takes them from.
        return {k: p for k, p in processes.items() if k == ""}

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
    # The guest's OCI runtime ("crun").
    guest_runtime: str = ""
    created_at: float = Field(default_factory=time.time)
