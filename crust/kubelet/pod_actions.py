"""What one SyncPod of kubelet does to a pod, from the pod and its status
(pkg/kubelet/kuberuntime/kuberuntime_manager.go: computePodActions,
computeInitContainerActions with sidecars; ShouldContainerBeRestarted),
probes, resizing and changed specs aside. Pure: crust.kubelet.cri reads the
status from the runtime and carries the actions out."""

from __future__ import annotations

from dataclasses import dataclass, field

from crust.api import cri_pb2 as cri
from crust.kubelet.pod import Container, Pod


@dataclass
class PodStatus:
    """kubecontainer.PodStatus: the pod's sandboxes (newest first) and containers."""

    sandboxes: list[cri.PodSandboxStatus] = field(default_factory=list)
    containers: list[cri.ContainerStatus] = field(default_factory=list)

    def latest(self, name: str) -> cri.ContainerStatus | None:
        """The newest container of this name (kubelet's FindContainerStatusByName)."""
        found = [c for c in self.containers if c.metadata.name == name]
        return max(found, key=lambda c: c.created_at) if found else None

    def ready_sandbox(self) -> cri.PodSandboxStatus | None:
        return self.sandboxes[0] if self.sandboxes and self.sandboxes[0].state == cri.SANDBOX_READY else None


@dataclass
class PodActions:
    """computePodActions' answer: what one SyncPod does."""

    create_sandbox: bool = False
    sandbox_id: str = ""
    attempt: int = 0
    kill_pod: bool = False
    # The init container whose failure ends the pod (restartPolicy Never).
    failed: cri.ContainerStatus | None = None
    containers_to_kill: list[cri.ContainerStatus] = field(default_factory=list)
    init_to_start: list[Container] = field(default_factory=list)
    containers_to_start: list[Container] = field(default_factory=list)
    # Every init container done (sidecars running): the containers may run.
    initialized: bool = False


def _should_start(pod: Pod, status: cri.ContainerStatus | None) -> bool:
    """ShouldContainerBeRestarted for a container that is not running."""
    if status is None or status.state in (cri.CONTAINER_CREATED, cri.CONTAINER_UNKNOWN):
        return True
    if pod.restart_policy == "Never":
        return False
    if pod.restart_policy == "OnFailure":
        return status.exit_code != 0
    return True


def regular_container_created(pod: Pod, status: PodStatus) -> bool:
    """hasAnyRegularContainerCreated: the pod went past its init containers."""
    return any((s := status.latest(c.name)) is not None and s.state in (
        cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING, cri.CONTAINER_EXITED) for c in pod.containers)


def compute_pod_actions(pod: Pod, status: PodStatus) -> PodActions:
    """computePodActions (probes, resizing and changed specs aside)."""
    sandbox = status.ready_sandbox()
    if sandbox is None:
        actions = PodActions(create_sandbox=True, kill_pod=bool(status.sandboxes),
                             attempt=status.sandboxes[0].metadata.attempt + 1 if status.sandboxes else 0)
        if pod.restart_policy == "Never" and actions.attempt != 0 and status.containers:
            # Its containers ran and none may run again: no new sandbox.
            actions.create_sandbox = False
            return actions
        to_start = [c for c in pod.containers if not (
            pod.restart_policy == "OnFailure" and (s := status.latest(c.name)) is not None
            and s.state == cri.CONTAINER_EXITED and s.exit_code == 0)]
        if regular_container_created(pod, status) and not to_start:
            actions.create_sandbox = False
            return actions
        # A new sandbox starts from the beginning: the first init container.
        if pod.init_containers:
            actions.init_to_start = [pod.init_containers[0]]
        else:
            actions.containers_to_start, actions.initialized = to_start, True
        return actions
    actions = PodActions(sandbox_id=sandbox.id, attempt=sandbox.metadata.attempt)
    actions.initialized = _init_container_actions(pod, status, actions)
    if actions.kill_pod or not actions.initialized:
        return actions
    actions.containers_to_start = [c for c in pod.containers if (s := status.latest(c.name)) is None
                                   or (s.state != cri.CONTAINER_RUNNING and _should_start(pod, s))]
    return actions


def _init_container_actions(pod: Pod, status: PodStatus, actions: PodActions) -> bool:
    """computeInitContainerActions (with sidecars); True once the pod is
    initialized. Walks the init containers from the last, as kubelet
    does: the newest one with a status tells how far the pod got (older
    ones may have been removed)."""
    inits = pod.init_containers
    if not inits:
        return True
    initialized = any((s := status.latest(c.name)) is not None
                      and s.state in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING) for c in pod.containers)
    previously_initialized = initialized
    restart_on_failure = pod.restart_policy != "Never"
    to_start: list[int] = []
    last = len(inits) - 1
    for index in range(last, -1, -1):
        container = inits[index]
        current = status.latest(container.name)
        if current is None:
            if previously_initialized and container.is_sidecar:
                to_start.append(index)  # a sidecar whose container went: start it again
            continue
        if previously_initialized and not container.is_sidecar:
            continue  # done long ago; only sidecars are kept running
        if current.state == cri.CONTAINER_CREATED:
            to_start.append(index)  # created but never started: start it
        elif current.state == cri.CONTAINER_RUNNING:
            if container.is_sidecar:
                if index == last:
                    initialized = True
                elif not previously_initialized:
                    to_start.append(index + 1)  # started: the next one may start
            # a running init container: wait for it to end
        elif current.state == cri.CONTAINER_EXITED:
            if container.is_sidecar:
                to_start.append(index)
            elif current.exit_code != 0:
                if not restart_on_failure:
                    actions.kill_pod, actions.failed = True, current
                    return False
                to_start.append(index)
            elif index == last:
                initialized = True
            else:
                to_start.append(index + 1)
        else:  # unknown: stop it, then start it again (unless the pod may not restart it)
            if not container.is_sidecar and not restart_on_failure:
                actions.kill_pod, actions.failed = True, current
                return False
            actions.containers_to_kill.append(current)
            to_start.append(index)
        previously_initialized = True
    if not previously_initialized:
        to_start.append(0)
    actions.init_to_start = [inits[i] for i in reversed(to_start)]
    return initialized
