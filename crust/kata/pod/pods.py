"""Pods in one microVM: what PodRuntime (specs/handler.proto) asks of the
microVM handler, for containerd's crust shim.

One VM per pod (a KataSandbox without a process of its own: the sandbox
container is the VM), every container of the pod inside it. The pod has two
shared directories (crust.kata.vmm.share), each served by a virtiofsd of the
VM and mounted once by the guest: the share, and the live share for the
volumes kubelet's atomic writer updates (their lookups never cached):

- a container's root, its binds and its volumes: crust.kata.pod.containers,
  each bind's kind decided first by crust.kata.pod.mount_plan (a pure function);
- a container's process runs under crun in the guest, from the spec
  containerd wrote rewritten for the guest (crust.kata.pod.container_spec: its
  user and groups, capabilities, no_new_privs, seccomp, masked and
  read-only paths, rlimits and cgroup limits hold as under runc; what the
  guest cannot honour is refused at CreateContainer); an exec is `crun
  exec` with the container's process settings. Both are started by the
  guest's agent over its virtio-serial port (crust.kata.agent.calls,
  specs/agent.proto): one call starts one, its output is read as written
  (the reads wait in the guest), its exit comes from a WaitProcess that
  waits in the guest, so nothing is polled and execs run side by side.
  A process on a terminal runs on one crun makes in the container, its
  master the agent's (crust.guest.terminal);
- a process with a standard input (CRI's stdin, an exec with stdin) reads
  it from the agent's pipe (WriteInput: WriteStdin); the OOM killer's kills
  in a container's cgroup (memory.events) make its exit OOMKilled; its
  cgroup's numbers answer ContainerStats.

A pod is a sandbox of the RuntimeHandler (its record, its volumes, stats,
expansion, the reaper, adoption after a restart are the handler's); what
only pods have (containers, processes) is in a PodRecord beside it. When
the VM dies, every process that had not exited is STOPPED with exit code
255 and a reason; the handler's reaper releases the claims.

As containerd's runc shim has a service, its containers and their
processes, the pod runtime is objects, each given what it uses
(crust.kata.pod.service puts them together): Pods (this module: a pod's
VM, shares and network, its watch and teardown), Containers
(crust.kata.pod.containers), Processes (crust.kata.pod.processes), the
pod's volumes (crust.kata.pod.volumes) and network (crust.kata.pod.network),
all finding pods, their locks and VMs in the PodRegistry
(crust.kata.pod.registry).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from crust.api import handler_pb2
from crust.common import cri_annotations
from crust.common.errors import (
    AlreadyExists,
    CrustError,
    FailedPrecondition,
    InvalidArgument,
)
from crust.common.recordstore import KEY_RULE, valid_key
from crust.contract.volumes_dir import check_sandbox_id
from crust.kata.agent import calls
from crust.kata.pod import container_spec, guest_memory
from crust.kata.agent import stop_bound
from crust.kata.pod.containers import raw_spec
from crust.kata.pod.network import PodNetworks
from crust.kata.pod.processes import Processes
from crust.kata.pod.records import PodNetwork, PodRecord
from crust.kata.pod.registry import PodRegistry
from crust.kata.vmm.share import PodShare, ShareError
from crust.kata.pod.volumes import PodVolumes
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.kata.supply.source import VmSource
from crust.kata.vmm.devices import Nic
from crust.kata.vmm.qemu import SharedDir
from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord
from crust.sys import mount as mounts
from crust.sys import podnet

log = logging.getLogger(__name__)

# containerd's annotation on a pod sandbox's spec (its CRI plugin) naming
# the pod's log directory.
SANDBOX_LOG_DIRECTORY = "io.kubernetes.cri.sandbox-log-directory"


def _sandbox_spec(bundle: str) -> dict:
    """The pod sandbox's spec (containerd's for the pause container), or
    nothing when the bundle has none to read."""
    if not bundle or not (Path(bundle) / "config.json").is_file():
        return {}
    return raw_spec(bundle)


def network_namespace(spec: dict) -> str:
    """The path of the pod's network namespace in the sandbox's spec, ""
    when it names none or the pod is on the host's network (the VM keeps
    its own network). CRI-O names one for a host-network pod too (the
    host's, pinned): its annotation says which pods those are."""
    if cri_annotations.host_network(spec):
        return ""
    for ns in (spec.get("linux") or {}).get("namespaces") or []:
        if ns.get("type") == "network":
            return str(ns.get("path") or "")
    return ""


def pod_uid(spec: dict) -> str:
    """The pod's uid kubelet gave in RunPodSandbox, from the CRI runtime's
    annotations on the sandbox's spec (the uid itself; else, containerd's,
    the last part of the pod's log directory, <namespace>_<name>_<uid>); ""
    when neither names one."""
    annotations = cri_annotations.annotations_of(spec)
    uid = cri_annotations.pod_uid(spec)
    if not uid and cri_annotations.keys_of(annotations) is cri_annotations.CONTAINERD:
        log_dir = str(annotations.get(SANDBOX_LOG_DIRECTORY) or "").rstrip("/")
        name = log_dir.rsplit("/", 1)[-1]
        uid = name.rsplit("_", 1)[-1] if name.count("_") >= 2 else ""
    return uid if uid and "/" not in uid and uid not in (".", "..") else ""


class Pods:
    """The pods themselves: made (a VM, its shares, its network), watched,
    stopped and deleted; their containers and processes are
    crust.kata.pod.containers' and crust.kata.pod.processes'."""

    def __init__(self, handler: RuntimeHandler, registry: PodRegistry, processes: Processes, volumes: PodVolumes,
                 networks: PodNetworks, vm_source: VmSource):
        self.handler = handler
        self.registry = registry
        self.processes = processes
        self.volumes = volumes
        self.networks = networks
        self.vm_source = vm_source   # a pod's VM: pooled, restored or booted (crust.kata.supply.source)
        handler.set_before_teardown(self._before_teardown)
        self._watcher: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """After the handler recovered its sandboxes: a pod whose VM was
        adopted gets its execs (from the guest's agent) and its port
        forwarding back."""
        for pod_id, pod in self.registry.pods.items():
            sandbox = self.registry.sandbox(pod_id)
            if sandbox is not None and sandbox.alive() and not pod.gone and pod.containers:
                try:
                    taken = await self.processes.adopt_execs(pod, sandbox)
                except CrustError as exc:
                    log.error("the guest's execs not taken back", extra={"fields": {
                        "sandbox": pod_id, "error": exc.message}})
                else:
                    log.info("execs taken back from the guest", extra={"fields": {
                        "sandbox": pod_id, "execs": taken}})
            if sandbox is not None and sandbox.alive() and pod.network is not None and not pod.gone:
                try:
                    await self.networks.forward_ports(pod_id, pod.network)
                except (podnet.PodNetworkError, OSError) as exc:
                    log.error("port forwarding not restored", extra={"fields": {
                        "sandbox": pod_id, "error": str(exc)}})
        self.processes.all_taken_back()
        self._watcher = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self.volumes.close()
        await self.processes.close()
        await self.networks.close()

    async def _watch_forever(self, interval: float = 1.0) -> None:
        """A pod whose VM died: its processes are stopped (the handler's
        reaper releases its claims). A VM whose file server died is killed
        first (crust.kata.vmm.qemu.Vm.lose_file_server)."""
        while True:
            await asyncio.sleep(interval)
            for pod_id in list(self.registry.pods):
                sandbox = self.registry.sandbox(pod_id)
                lost = sandbox.vm.dead_file_server() if sandbox is not None else None
                if lost is not None:
                    log.error("a pod's file server is gone", extra={"fields": {
                        "sandbox": pod_id, "virtiofsd": lost.name, "cache": lost.cache}})
                    try:
                        await sandbox.vm.lose_file_server(lost)
                    except Exception:   # this watch must go on for every other pod
                        log.exception("could not kill the VM of a lost file server", extra={"fields": {
                            "sandbox": pod_id}})
                if (sandbox is None or not sandbox.alive()) and not self.handler.inflight.busy(pod_id):
                    try:
                        await self.registry.mark_gone(pod_id, self.registry.death_reason(pod_id, sandbox))
                    except (CrustError, OSError) as exc:
                        # Its record could not be written (a full disk): the
                        # processes are stopped in memory; written next time.
                        log.error("could not record a pod's death", extra={"fields": {
                            "sandbox": pod_id, "error": str(exc)}})

    async def _before_teardown(self, sandbox_id: str) -> None:
        """The handler is about to stop a pod's VM and release its volumes
        (DeletePod, DeleteSandbox, the reaper): the containers' processes and
        mounts go first, so the guest can let the volumes' disks go."""
        pod = self.registry.pods.get(sandbox_id)
        if pod is None:
            return
        sandbox = self.registry.sandbox(sandbox_id)
        for c in pod.containers.values():
            if sandbox is None or not sandbox.alive():
                break   # gone, or killed meanwhile: its agent was silent
            try:
                with stop_bound.bounded(stop_bound.POD_STOP):
                    await self.processes.stop_all(sandbox, pod, c)
                    if c.created_on_port:   # its namespace's hold, before the volumes are unmounted
                        await calls.remove_container(await sandbox.port(), c.container_id)
            except CrustError as exc:
                log.warning("could not unmount a container before stopping its pod", extra={"fields": {
                    "sandbox": sandbox_id, "container": c.container_id, "error": str(exc)[:500]}})
        alive = sandbox is not None and sandbox.alive()
        await self.registry.mark_gone(sandbox_id, f"the pod {sandbox_id} was stopped" if alive
                                      else self.registry.death_reason(sandbox_id, sandbox))

    # -- pods --------------------------------------------------------------------------------

    async def create_pod(self, sandbox_id: str, bundle: str) -> int:
        sandbox_id = check_sandbox_id(sandbox_id)
        if not valid_key(sandbox_id):
            raise InvalidArgument(f"sandbox_id {sandbox_id!r} must be {KEY_RULE}")
        if bundle and not bundle.startswith("/"):
            raise InvalidArgument("bundle must be an absolute path")
        async with self.registry.locks[sandbox_id]:
            with self.handler.inflight.hold(sandbox_id):
                pod = self.registry.pods.get(sandbox_id)
                if pod is not None:
                    if pod.gone:
                        raise FailedPrecondition(f"pod {sandbox_id} exists and {pod.gone}: delete it first")
                    return self.handler.entry(sandbox_id)[0].pid
                if self.handler.entry(sandbox_id) is not None:
                    raise AlreadyExists(f"sandbox_id {sandbox_id!r} is a sandbox of this handler, not a pod")
                await self.handler.registration.wait_registered(f"pod {sandbox_id}")
                sandbox_spec = _sandbox_spec(bundle)
                sysctls, hostname = container_spec.pod_settings(sandbox_spec)
                interface = await self.networks.interface(sandbox_id, network_namespace(sandbox_spec))
                shares = self.registry.shares(sandbox_id)
                limits, overhead = guest_memory.requested(sandbox_spec)
                taken = await self.vm_source.take(sandbox_id, self.registry.workdir(sandbox_id))
                sandbox = taken.sandbox
                floor = sandbox.vm.config.memory_mib
                plug_mib = guest_memory.guest_mib(limits, overhead, floor,
                                                  max(floor, sandbox.vm.config.max_memory_mib)) - floor
                record = SandboxRecord(sandbox_id=sandbox_id, bundle=bundle)
                pod = PodRecord(sandbox_id=sandbox_id, bundle=bundle, guest_runtime="crun")
                if interface is not None:
                    pod.network = PodNetwork(netns=network_namespace(sandbox_spec), interface=interface.name,
                                             address=interface.ipv4)
                tap = -1
                recorded = False
                try:
                    shared = []
                    for share in shares:
                        served = await asyncio.to_thread(share.set_up)
                        shared.append(SharedDir(share.tag, served, share.cache))
                    nic = None
                    if interface is not None:
                        tap = await self.networks.open_tap(sandbox_id, pod.network, interface)
                        nic = Nic(tap, interface.mac)
                    await self.vm_source.run(taken, shared, nic)
                    if tap >= 0:
                        os.close(tap)   # QEMU's now: the tap lives as long as QEMU
                        tap = -1
                    await self._configure_guest(sandbox, shares, plug_mib, sysctls, hostname, interface)
                    if interface is not None:
                        await self.networks.forward_ports(sandbox_id, pod.network)
                    record.pid = sandbox.pid
                    identity = sandbox.identity
                    record.pid_start = identity.start if identity is not None else 0
                    recorded = True
                    await self.registry.add(pod)
                    await self.handler.adopt(sandbox, record)
                except BaseException:
                    if tap >= 0:
                        os.close(tap)
                    await self._undo_create(sandbox, pod, recorded)
                    raise
        log.info("pod running", extra={"fields": {"sandbox": sandbox_id, "pid": record.pid}})
        uid = pod_uid(sandbox_spec)
        if uid:
            self.volumes.mount_ahead(sandbox_id, uid)
        return record.pid

    @staticmethod
    async def _configure_guest(sandbox: KataSandbox, shares: tuple[PodShare, PodShare], plug_mib: int,
                               sysctls: dict[str, str], hostname: str, interface: podnet.Interface | None) -> None:
        """The pod's shares mounted in the guest, its memory beyond the
        VM's plugged (crust.kata.pod.guest_memory), its sysctls, hostname
        and interface set there."""
        # The guest's agent is connected now (a VM is ready once it answers).
        client = await sandbox.port()
        for share in shares:
            await calls.mount_share(client, share.tag)
        await guest_memory.plug(sandbox.vm, client, plug_mib, sandbox.id)
        if sysctls or hostname:
            # The pod sandbox's, in the guest (the VM is the pod: its
            # network, IPC and UTS namespaces are the guest's own). One the
            # guest's kernel refuses fails the pod.
            await calls.configure_guest(client, sysctls, hostname)
        if interface is not None:
            await calls.configure_interface(
                client, interface.mac, interface.mtu, list(interface.addresses),
                [(r.destination, r.gateway) for r in interface.routes])

    async def _undo_create(self, sandbox: KataSandbox, pod: PodRecord, recorded: bool) -> None:
        """What a CreatePod that failed made, undone: the VM stopped, the
        pod's network namespace as CNI left it, its shares and records
        gone. QEMU's reason is in the error; its logs go with the pod that
        never was."""
        sandbox_id = pod.sandbox_id
        self.registry.forget(sandbox_id)
        await sandbox.stop()
        await self.networks.disconnect(sandbox_id, pod.network)
        await asyncio.to_thread(self._tear_down_share, sandbox_id)
        if recorded:
            await self.registry.remove(sandbox_id)
            await self.handler.forget(sandbox_id)
        await asyncio.to_thread(self._remove_workdir, sandbox_id)

    async def delete_pod(self, sandbox_id: str) -> None:
        await self.volumes.settled(sandbox_id)
        async with self.registry.locks[sandbox_id]:
            pod = self.registry.pods.get(sandbox_id)
            if self.handler.entry(sandbox_id) is not None:
                with stop_bound.bounded(stop_bound.POD_STOP):
                    await self.handler.delete_sandbox(sandbox_id)   # before_teardown, VM stopped, claims released
            if pod is None:
                return
            await self.networks.disconnect(sandbox_id, pod.network)
            await self.registry.mark_gone(sandbox_id, f"the pod {sandbox_id} was deleted")
            await asyncio.to_thread(shutil.rmtree, self.registry.workdir(sandbox_id) / "containers", True)
            try:
                for share in self.registry.shares(sandbox_id):
                    await asyncio.to_thread(share.tear_down)
            except (ShareError, OSError) as exc:
                raise FailedPrecondition(f"pod {sandbox_id}: its shared directory: {exc}") from None
            await self.registry.remove(sandbox_id)
            await asyncio.to_thread(self._remove_workdir, sandbox_id)
        log.info("pod deleted", extra={"fields": {"sandbox": sandbox_id}})

    def _remove_workdir(self, sandbox_id: str) -> None:
        """The pod's work directory (the VM's logs, its daemons' logs), once
        its VM, shares and records are gone; never through a mount (one
        left below it is logged, and the directory kept)."""
        workdir = self.registry.workdir(sandbox_id)
        left = [m.mount_point for m in mounts.mounts()
                if m.mount_point == str(workdir) or m.mount_point.startswith(f"{workdir}/")]
        if left:
            log.error("a deleted pod's work directory still has mounts below it; kept", extra={"fields": {
                "sandbox": sandbox_id, "mounts": left[:5]}})
            return
        shutil.rmtree(workdir, ignore_errors=True)

    def _tear_down_share(self, sandbox_id: str) -> None:
        try:
            for share in self.registry.shares(sandbox_id):
                share.tear_down()
        except (ShareError, OSError) as exc:
            log.error("could not remove a pod's shared directory", extra={"fields": {
                "sandbox": sandbox_id, "error": str(exc)}})

    def list_pods(self) -> list[handler_pb2.PodInfo]:
        out = []
        for pod_id, pod in sorted(self.registry.pods.items()):
            entry = self.handler.entry(pod_id)
            out.append(handler_pb2.PodInfo(
                sandbox_id=pod_id, pid=entry[1].pid if entry else 0,
                alive=bool(entry and entry[0].alive() and not pod.gone),
                container_ids=sorted(pod.containers),
                target_paths=sorted(v.target_path for v in entry[1].volumes.values()) if entry else []))
        return out
