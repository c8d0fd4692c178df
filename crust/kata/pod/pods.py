"""Pods in one microVM: what PodRuntime (specs/handler.proto) asks of the
microVM handler, for containerd's crust shim.

One VM per pod (a KataSandbox without a process of its own: the sandbox
container is the VM), every container of the pod inside it. The pod has two
shared directories (crust.kata.pod.share), each served by a virtiofsd of the
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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import time
from pathlib import Path

from crust.api import handler_pb2
from crust.common import cri_annotations
from crust.common.aio import KeyedLocks
from crust.common.errors import (
    AlreadyExists,
    CrustError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from crust.common.private import make_dirs
from crust.common.recordstore import KEY_RULE, RecordStore, valid_key
from crust.contract.volumes_dir import check_sandbox_id
from crust.kata.agent import calls
from crust.kata.pod import container_spec, guest_memory, stop_bound
from crust.kata.pod.containers import PodContainers, raw_spec
from crust.kata.pod.records import (
    VM_GONE_EXIT_CODE,
    ContainerRecord,
    PodNetwork,
    PodRecord,
    ProcessRecord,
)
from crust.kata.supply.pool import VmPool
from crust.kata.pod.tcp_forward import PortForwarder
from crust.kata.vmm.qemu import SharedDir, Vm, VmError
from crust.kata.vmm.devices import Nic
from crust.kata.vmm.qmp import QmpError, QmpGone, QmpTimeout
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.kata.pod.share import (
    PodShare,
    ShareError,
    tag_of,
)
from crust.kata.supply.template import VmTemplate, restore_config
from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord
from crust.runtime_handler.resolve import pod_volumes
from crust.sys import mount as mounts
from crust.sys import podnet
from crust.sys.run import rpc_deadline

log = logging.getLogger(__name__)

Status = handler_pb2.ProcessState.Status
Stream = handler_pb2.OutputChunk.Stream

TAP = "crust0"                # the VM's tap in the pod's network namespace
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


class Pods(PodContainers):
    def __init__(self, handler: RuntimeHandler, pool: VmPool | None = None, template: VmTemplate | None = None):
        self.handler = handler
        self.pool = pool   # VMs booted ahead (crust.kata.supply.pool); a pod takes one when it can
        self.template = template   # a VM saved once (crust.kata.supply.template); restored when the pool has none
        self.handler_nice = os.getpriority(os.PRIO_PROCESS, 0)   # what a taken VM runs at
        self.records = RecordStore(handler.state_dir / "pods", PodRecord, self._belongs)
        self.pods: dict[str, PodRecord] = dict(self.records.load_all())
        self.locks = KeyedLocks()   # by pod
        self._creating: set[str] = set()   # container ids whose CreateContainer runs
        self._unwritten: set[str] = set()  # pods stopped in memory whose record is not written yet
        self.forwarders: dict[str, PortForwarder] = {}   # by pod, for those with a network
        self._ahead: dict[str, asyncio.Task] = {}   # by pod: its deferred volumes being mounted ahead
        self.exits = calls.ExitWatches()   # the port processes' WaitProcess calls
        self._forgets: set[asyncio.Task] = set()   # exited execs nobody deleted, being forgotten
        self._expiries: dict[tuple[str, str], asyncio.TimerHandle] = {}   # (container, exec) -> its forgetting
        self.execs_taken_back = asyncio.Event()   # set once start() asked the guests for their execs
        self.kills = stop_bound.KillDeadlines()   # processes sent SIGKILL, exited in time or the VM killed
        handler.set_before_teardown(self._before_teardown)
        self._watcher: asyncio.Task | None = None

    @staticmethod
    def _belongs(key: str, record: PodRecord) -> str:
        if record.sandbox_id != key:
            return f"it describes pod {record.sandbox_id!r}, not {key!r}"
        for cid, c in record.containers.items():
            if c.container_id != cid:
                return f"its container {c.container_id!r} is stored as {cid!r}"
        return ""

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """After the handler recovered its sandboxes: a pod whose VM was
        adopted gets its execs (from the guest's agent) and its port
        forwarding back."""
        for pod_id, pod in self.pods.items():
            sandbox = self._sandbox(pod_id)
            if sandbox is not None and sandbox.alive() and not pod.gone and pod.containers:
                try:
                    taken = await self.adopt_execs(pod, sandbox)
                except CrustError as exc:
                    log.error("the guest's execs not taken back", extra={"fields": {
                        "sandbox": pod_id, "error": exc.message}})
                else:
                    log.info("execs taken back from the guest", extra={"fields": {
                        "sandbox": pod_id, "execs": taken}})
            if sandbox is not None and sandbox.alive() and pod.network is not None and not pod.gone:
                try:
                    await self._forward_ports(pod_id, pod.network)
                except (podnet.PodNetworkError, OSError) as exc:
                    log.error("port forwarding not restored", extra={"fields": {
                        "sandbox": pod_id, "error": str(exc)}})
        self.execs_taken_back.set()
        self._watcher = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._ahead:
            # A mount ahead ends with its volume recorded (or given back):
            # the next handler adopts it like any other.
            await asyncio.wait(list(self._ahead.values()), timeout=30)
        await self.exits.close()
        for task in list(self._forgets):
            task.cancel()
        await self.kills.close()
        for forwarder in self.forwarders.values():
            await forwarder.stop()

    async def _forward_ports(self, sandbox_id: str, network: PodNetwork) -> None:
        if network.address:
            forwarder = PortForwarder(sandbox_id, network.netns, network.address)
            await forwarder.start()
            self.forwarders[sandbox_id] = forwarder

    async def _disconnect(self, sandbox_id: str, network: PodNetwork | None) -> None:
        """The pod's namespace as CNI left it: no port forwarding, no redirect
        (its tap went with QEMU). Nothing to do once the namespace is gone."""
        forwarder = self.forwarders.pop(sandbox_id, None)
        if forwarder is not None:
            await forwarder.stop()
        if network is not None:
            try:
                await podnet.remove_redirect(network.netns)
                await asyncio.to_thread(podnet.restore, network.netns, network.interface)
            except (podnet.PodNetworkError, OSError) as exc:
                log.warning("the pod's network namespace not restored", extra={"fields": {
                    "sandbox": sandbox_id, "error": str(exc)}})

    async def _watch_forever(self, interval: float = 1.0) -> None:
        """A pod whose VM died: its processes are stopped (the handler's
        reaper releases its claims). A VM whose file server died is killed
        first (crust.kata.vmm.qemu.Vm.lose_file_server)."""
        while True:
            await asyncio.sleep(interval)
            for pod_id in list(self.pods):
                sandbox = self._sandbox(pod_id)
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
                        await self._mark_gone(pod_id, self._death_reason(pod_id, sandbox))
                    except (CrustError, OSError) as exc:
                        # Its record could not be written (a full disk): the
                        # processes are stopped in memory; written next time.
                        log.error("could not record a pod's death", extra={"fields": {
                            "sandbox": pod_id, "error": str(exc)}})

    def _death_reason(self, pod_id: str, sandbox: KataSandbox | None) -> str:
        if sandbox is None:
            return f"the VM of pod {pod_id} was stopped"
        # The agent client says why it lost the guest ("QEMU exited with code -9").
        return f"the VM of pod {pod_id} is gone ({sandbox.vm.port.dead or 'QEMU exited'})"

    async def _mark_gone(self, pod_id: str, reason: str) -> None:
        pod = self.pods.get(pod_id)
        if pod is None or (pod.gone and pod_id not in self._unwritten):
            return
        pod.gone = pod.gone or reason
        now = time.time_ns()
        sandbox = self._sandbox(pod_id)
        # Killed by the host (its agent silent in a stop) as runc kills: SIGKILL's status.
        code = stop_bound.VM_KILLED_EXIT_CODE if sandbox is not None and sandbox.vm.unresponsive \
            else VM_GONE_EXIT_CODE
        for c in pod.containers.values():
            for p in c.processes.values():
                if p.pid and p.exit_code is None:
                    p.exit_code, p.exited_at_ns, p.reason = code, now, pod.gone
        if pod_id not in self._unwritten:
            log.warning("pod stopped", extra={"fields": {"sandbox": pod_id, "reason": reason}})
        self._unwritten.add(pod_id)
        await self.records.put(pod_id, pod)
        self._unwritten.discard(pod_id)

    async def _before_teardown(self, sandbox_id: str) -> None:
        """The handler is about to stop a pod's VM and release its volumes
        (DeletePod, DeleteSandbox, the reaper): the containers' processes and
        mounts go first, so the guest can let the volumes' disks go."""
        pod = self.pods.get(sandbox_id)
        if pod is None:
            return
        sandbox = self._sandbox(sandbox_id)
        for c in pod.containers.values():
            if sandbox is None or not sandbox.alive():
                break   # gone, or killed meanwhile: its agent was silent
            try:
                with stop_bound.bounded(stop_bound.POD_STOP):
                    await self._stop_processes(sandbox, pod, c)
                    if c.created_on_port:   # its namespace's hold, before the volumes are unmounted
                        await calls.remove_container(await sandbox.port(), c.container_id)
            except CrustError as exc:
                log.warning("could not unmount a container before stopping its pod", extra={"fields": {
                    "sandbox": sandbox_id, "container": c.container_id, "error": str(exc)[:500]}})
        alive = sandbox is not None and sandbox.alive()
        await self._mark_gone(sandbox_id, f"the pod {sandbox_id} was stopped" if alive
                              else self._death_reason(sandbox_id, sandbox))

    # -- lookups ---------------------------------------------------------------------------

    def _sandbox(self, pod_id: str) -> KataSandbox | None:
        entry = self.handler.entry(pod_id)
        return entry[0] if entry is not None else None

    def _live(self, pod_id: str) -> tuple[KataSandbox, SandboxRecord, PodRecord]:
        pod = self.pods.get(pod_id)
        if pod is None:
            raise NotFound(f"sandbox_id {pod_id!r}: no such pod")
        entry = self.handler.entry(pod_id)
        if entry is None or not entry[0].alive() or pod.gone:
            raise FailedPrecondition(f"pod {pod_id}: {pod.gone or 'its VM is not running'}")
        return entry[0], entry[1], pod

    def _find(self, container_id: str) -> tuple[PodRecord, ContainerRecord]:
        for pod in self.pods.values():
            c = pod.containers.get(container_id)
            if c is not None:
                return pod, c
        raise NotFound(f"container_id {container_id!r}: no such container")

    def _process(self, container_id: str, exec_id: str) -> tuple[PodRecord, ContainerRecord, ProcessRecord]:
        pod, c = self._find(container_id)
        p = c.processes.get(exec_id)
        if p is None:
            raise NotFound(f"exec_id {exec_id!r}: no such process in container {container_id}")
        return pod, c, p

    def _workdir(self, pod_id: str) -> Path:
        return self.handler.workdir(pod_id)

    def _share(self, pod_id: str, name: str = "share", sandbox: KataSandbox | None = None) -> PodShare:
        """One of the pod's shared directories; with the pod's sandbox, the
        virtiofsd serving it, in whose mount namespace its binds are made."""
        server = sandbox.vm.virtiofsds.get(tag_of(name)) if sandbox is not None else None
        return PodShare(self._workdir(pod_id), name, server.identity if server is not None else None)

    def _shares(self, pod_id: str, sandbox: KataSandbox | None = None) -> tuple[PodShare, PodShare]:
        return self._share(pod_id, sandbox=sandbox), self._share(pod_id, "live", sandbox)

    # -- pods --------------------------------------------------------------------------------

    async def create_pod(self, sandbox_id: str, bundle: str) -> int:
        sandbox_id = check_sandbox_id(sandbox_id)
        if not valid_key(sandbox_id):
            raise InvalidArgument(f"sandbox_id {sandbox_id!r} must be {KEY_RULE}")
        if bundle and not bundle.startswith("/"):
            raise InvalidArgument("bundle must be an absolute path")
        async with self.locks[sandbox_id]:
            with self.handler.inflight.hold(sandbox_id):
                pod = self.pods.get(sandbox_id)
                if pod is not None:
                    if pod.gone:
                        raise FailedPrecondition(f"pod {sandbox_id} exists and {pod.gone}: delete it first")
                    return self.handler.entry(sandbox_id)[0].pid
                if self.handler.entry(sandbox_id) is not None:
                    raise AlreadyExists(f"sandbox_id {sandbox_id!r} is a sandbox of this handler, not a pod")
                await self.handler.registration.wait_registered(f"pod {sandbox_id}")
                sandbox_spec = _sandbox_spec(bundle)
                sysctls, hostname = container_spec.pod_settings(sandbox_spec)
                interface = await self._pod_interface(sandbox_id, network_namespace(sandbox_spec))
                shares = self._shares(sandbox_id)
                limits, overhead = guest_memory.requested(sandbox_spec)
                pooled = await self._take_pooled_vm(sandbox_id)
                saved = self.template.saved() if pooled is None and self.template is not None else None
                sandbox = self.handler.make_sandbox(sandbox_id, self._workdir(sandbox_id), None, None, vm=pooled)
                floor = sandbox.vm.config.memory_mib
                plug_mib = guest_memory.guest_mib(limits, overhead, floor,
                                                  max(floor, sandbox.vm.config.max_memory_mib)) - floor
                record = SandboxRecord(sandbox_id=sandbox_id, bundle=bundle)
                pod = PodRecord(sandbox_id=sandbox_id, bundle=bundle, guest_runtime="crun")
                if interface is not None:
                    pod.network = PodNetwork(netns=network_namespace(sandbox_spec), interface=interface.name,
                                             address=interface.ipv4)
                tap = -1
                try:
                    shared = []
                    for share in shares:
                        served = await asyncio.to_thread(share.set_up)
                        shared.append(SharedDir(share.tag, served, share.cache))
                    nic = None
                    if interface is not None:
                        tap = await self._open_tap(sandbox_id, pod.network, interface)
                        nic = Nic(tap, interface.mac)
                    if saved is not None:
                        # Restored (the saved VM's config: no share, no
                        # NIC), then given both as a pooled VM is.
                        sandbox.vm.config = restore_config(sandbox.vm.config)
                        try:
                            await sandbox.start(saved=saved)
                        except Unavailable as exc:
                            self.template.discard(str(exc))
                            raise
                    if pooled is not None or saved is not None:
                        # Booted already, serving the shares that came with
                        # its directory (plugging them is then nothing), or
                        # restored without them: they and the NIC are plugged in.
                        try:
                            for shared_dir in shared:
                                await sandbox.vm.plug_shared_dir(shared_dir)
                            if nic is not None:
                                await sandbox.vm.plug_nic(nic)
                        except (VmError, QmpError, QmpGone, QmpTimeout) as exc:
                            raise Unavailable(f"pod {sandbox_id}: the VM booted for it took no device: {exc}") \
                                from None
                    else:
                        # This VM's own config: the handler's is shared by all its sandboxes.
                        sandbox.vm.config = dataclasses.replace(sandbox.vm.config, shared_dirs=tuple(shared),
                                                                nic=nic)
                        await sandbox.start()
                    if tap >= 0:
                        os.close(tap)   # QEMU's now: the tap lives as long as QEMU
                        tap = -1
                    # The guest's agent is connected now (a VM is ready once
                    # it answers).
                    client = await sandbox.port()
                    for share in shares:
                        await calls.mount_share(client, share.tag)
                    await guest_memory.plug(sandbox.vm, client, plug_mib, sandbox_id)
                    if sysctls or hostname:
                        # The pod sandbox's, in the guest (the VM is the pod:
                        # its network, IPC and UTS namespaces are the guest's
                        # own). One the guest's kernel refuses fails the pod.
                        await calls.configure_guest(client, sysctls, hostname)
                    if interface is not None:
                        await calls.configure_interface(
                            client, interface.mac, interface.mtu, list(interface.addresses),
                            [(r.destination, r.gateway) for r in interface.routes])
                    if interface is not None:
                        await self._forward_ports(sandbox_id, pod.network)
                except BaseException:
                    if tap >= 0:
                        os.close(tap)
                    await sandbox.stop()
                    await self._disconnect(sandbox_id, pod.network)
                    await asyncio.to_thread(self._tear_down_share, sandbox_id)
                    # QEMU's reason is in the error; its logs go with the pod
                    # that never was.
                    await asyncio.to_thread(self._remove_workdir, sandbox_id)
                    raise
                record.pid = sandbox.pid
                identity = sandbox.identity
                record.pid_start = identity.start if identity is not None else 0
                try:
                    await self.records.put(sandbox_id, pod)
                    self.pods[sandbox_id] = pod
                    await self.handler.adopt(sandbox, record)
                except BaseException:
                    self.pods.pop(sandbox_id, None)
                    await sandbox.stop()
                    await self._disconnect(sandbox_id, pod.network)
                    await asyncio.to_thread(self._tear_down_share, sandbox_id)
                    await self.records.delete(sandbox_id)
                    await self.handler.forget(sandbox_id)
                    await asyncio.to_thread(self._remove_workdir, sandbox_id)
                    raise
        log.info("pod running", extra={"fields": {"sandbox": sandbox_id, "pid": record.pid}})
        uid = pod_uid(sandbox_spec)
        if uid:
            task = asyncio.create_task(self._mount_ahead(sandbox_id, uid))
            self._ahead[sandbox_id] = task
            task.add_done_callback(lambda t: self._ahead.pop(sandbox_id, None) if self._ahead.get(sandbox_id) is t
                                   else None)
        return record.pid

    async def _mount_ahead(self, sandbox_id: str, uid: str) -> None:
        """The pod's deferred volumes are published before kubelet runs the
        pod: each is claimed, hot-plugged and mounted in the guest now, while
        kubelet goes on to the pod's containers (their CreateContainer waits
        for this), so a container's start only binds it. A volume that fails
        here is given back and left to the CreateContainer of the container
        that binds it, which mounts it (or fails) as if this had not run."""
        rpc_deadline.set(None)   # this task's own: it outlives the CreatePod that started it
        started = time.monotonic()
        mounted = []
        async with self.locks[sandbox_id]:
            try:
                sandbox, record, _ = self._live(sandbox_id)
            except CrustError:
                return   # stopped or deleted meanwhile
            for resolved in pod_volumes(uid, self.handler.index):
                key = resolved.digest
                if key in record.volumes:
                    continue
                try:
                    with self.handler.inflight.hold(sandbox_id):
                        await self.handler.mount_volume(sandbox, record, key, resolved.info, [])
                        await self.handler.save(record)
                    mounted.append(resolved.info.target_path)
                except Exception as exc:  # noqa: BLE001 - nobody awaits this task: every failure is logged here
                    log.warning("volume not mounted ahead; its container's create mounts it", extra={"fields": {
                        "sandbox": sandbox_id, "target_path": resolved.info.target_path,
                        "error": str(exc)[:500]}})
                    try:
                        await self._give_back(sandbox, record, key)
                    except CrustError as undo:
                        log.error("could not give back a volume whose mount ahead failed", extra={"fields": {
                            "sandbox": sandbox_id, "target_path": resolved.info.target_path,
                            "error": undo.message}})
                    await self.handler.save(record)
        if mounted:
            log.info("volumes mounted ahead", extra={"fields": {
                "sandbox": sandbox_id, "target_paths": mounted, "seconds": round(time.monotonic() - started, 3)}})

    async def _ahead_settled(self, sandbox_id: str) -> None:
        """Wait for the pod's mounts ahead, if they still run."""
        task = self._ahead.get(sandbox_id)
        if task is not None:
            await asyncio.shield(task)

    async def _take_pooled_vm(self, sandbox_id: str) -> Vm | None:
        """A VM the pool booted, moved into the pod's work directory (which
        must not exist yet, or be empty); None without a pool, when it is
        empty, or when the move fails (that VM is discarded)."""
        vm = self.pool.take() if self.pool is not None else None
        if vm is None:
            return None
        workdir = self._workdir(sandbox_id)
        try:
            await asyncio.to_thread(make_dirs, workdir.parent)
            await asyncio.to_thread(os.rename, vm.workdir, workdir)
            vm.relocate(workdir)
            vm.renice(self.handler_nice)
        except (OSError, VmError) as exc:
            log.warning("a pooled VM could not become the pod's; booting one", extra={"fields": {
                "sandbox": sandbox_id, "vm": vm.name, "error": str(exc)}})
            await self.pool.discard(vm)
            return None
        log.info("pod takes a pooled VM", extra={"fields": {"sandbox": sandbox_id, "vm": vm.name, "pid": vm.pid}})
        return vm

    @staticmethod
    async def _pod_interface(sandbox_id: str, netns_path: str) -> podnet.Interface | None:
        """The interface CNI made in the pod's namespace (None: no namespace
        of its own, or only its loopback)."""
        if not netns_path:
            return None
        try:
            return await asyncio.to_thread(podnet.read_interface, netns_path)
        except (podnet.PodNetworkError, OSError) as exc:
            raise FailedPrecondition(f"pod {sandbox_id}: linux.namespaces network {netns_path}: {exc}") from None

    @staticmethod
    async def _open_tap(sandbox_id: str, network: PodNetwork, interface: podnet.Interface) -> int:
        try:
            return await asyncio.to_thread(podnet.open_tap, network.netns, TAP, interface)
        except (podnet.PodNetworkError, OSError) as exc:
            raise FailedPrecondition(f"pod {sandbox_id}: the VM's tap in {network.netns}: {exc}") from None

    async def delete_pod(self, sandbox_id: str) -> None:
        await self._ahead_settled(sandbox_id)
        async with self.locks[sandbox_id]:
            pod = self.pods.get(sandbox_id)
            if self.handler.entry(sandbox_id) is not None:
                with stop_bound.bounded(stop_bound.POD_STOP):
                    await self.handler.delete_sandbox(sandbox_id)   # before_teardown, VM stopped, claims released
            if pod is None:
                return
            await self._disconnect(sandbox_id, pod.network)
            await self._mark_gone(sandbox_id, f"the pod {sandbox_id} was deleted")
            await asyncio.to_thread(shutil.rmtree, self._workdir(sandbox_id) / "containers", True)
            try:
                for share in self._shares(sandbox_id):
                    await asyncio.to_thread(share.tear_down)
            except (ShareError, OSError) as exc:
                raise FailedPrecondition(f"pod {sandbox_id}: its shared directory: {exc}") from None
            self.pods.pop(sandbox_id, None)
            await self.records.delete(sandbox_id)
            await asyncio.to_thread(self._remove_workdir, sandbox_id)
        log.info("pod deleted", extra={"fields": {"sandbox": sandbox_id}})

    def _remove_workdir(self, sandbox_id: str) -> None:
        """The pod's work directory (the VM's logs, its daemons' logs), once
        its VM, shares and records are gone; never through a mount (one
        left below it is logged, and the directory kept)."""
        workdir = self._workdir(sandbox_id)
        left = [m.mount_point for m in mounts.mounts()
                if m.mount_point == str(workdir) or m.mount_point.startswith(f"{workdir}/")]
        if left:
            log.error("a deleted pod's work directory still has mounts below it; kept", extra={"fields": {
                "sandbox": sandbox_id, "mounts": left[:5]}})
            return
        shutil.rmtree(workdir, ignore_errors=True)

    def _tear_down_share(self, sandbox_id: str) -> None:
        try:
            for share in self._shares(sandbox_id):
                share.tear_down()
        except (ShareError, OSError) as exc:
            log.error("could not remove a pod's shared directory", extra={"fields": {
                "sandbox": sandbox_id, "error": str(exc)}})

    def list_pods(self) -> list[handler_pb2.PodInfo]:
        out = []
        for pod_id, pod in sorted(self.pods.items()):
            entry = self.handler.entry(pod_id)
            out.append(handler_pb2.PodInfo(
                sandbox_id=pod_id, pid=entry[1].pid if entry else 0,
                alive=bool(entry and entry[0].alive() and not pod.gone),
                container_ids=sorted(pod.containers),
                target_paths=sorted(v.target_path for v in entry[1].volumes.values()) if entry else []))
        return out
