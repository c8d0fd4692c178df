"""What the handler records of each container crust-runc runs
(crust.runtime_handler.containers): its pod, the runtime preparing it, its
init and mount namespace once created, and its deferred volumes' mounts.
One JSON record per container (crust.common.recordstore), read back by a
restarted handler."""

from __future__ import annotations

import time

from pydantic import BaseModel, Field

from crust.sys import proc

# A container's record: made before `runc create`, created after it.
PREPARED, CREATED = "prepared", "created"


class ContainerMount(BaseModel):
    destination: str
    target_path: str
    device: str
    fs_type: str
    options: list[str] = Field(default_factory=list)
    readonly: bool = False
    device_major: int = 0
    device_minor: int = 0
    fs_group: str = ""
    fs_group_change_policy: str = ""


class ContainerRecord(BaseModel):
    container_id: str
    sandbox_id: str
    bundle: str = ""
    state: str = PREPARED
    runtime_pid: int = 0
    runtime_pid_start: int = 0
    # The pod's sandbox process (0: the spec named none, or it came through
    # PrepareContainer, which sends no spec).
    pod_pid: int = 0
    pod_pid_start: int = 0
    pid: int = 0
    pid_start: int = 0
    # The container's mount namespace ("mnt:[inode]"), read from its init.
    mount_namespace: str = ""
    mounts: list[ContainerMount] = Field(default_factory=list)
    created_at: float = Field(default_factory=time.time)

    def init(self) -> proc.ProcessId | None:
        return proc.ProcessId(self.pid, self.pid_start) if self.pid and self.pid_start else None

    def runtime(self) -> proc.ProcessId | None:
        return proc.ProcessId(self.runtime_pid, self.runtime_pid_start) if self.runtime_pid_start else None

    def pod(self) -> proc.ProcessId | None:
        return proc.ProcessId(self.pod_pid, self.pod_pid_start) if self.pod_pid_start else None

    def targets(self) -> list[str]:
        return sorted({m.target_path for m in self.mounts})
