"""Pods in one microVM: what PodRuntime (specs/handler.proto) asks of the
microVM handler, for containerd's crust shim.

One VM per pod (a KataSandbox without a process of its own: the sandbox
container is the VM), every container of the pod inside it. The pod has two
shared directories (crust.kata.share), each served by a virtiofsd of the
VM and mounted once by the guest: the share, and the live share for the
volumes kubelet's atomic writer updates (their lookups never cached):

- a container's root file system is a bind of the bundle's rootfs
  (containerd's snapshot) in the share, bound by the guest at
  /run/crust/containers/<id>/rootfs, with /proc and a small /dev:
  nothing is copied, and the container's writes land where runc's would;
- a host-path bind (emptyDir, configMap, secret, projected, downward API,
  hostPath, /etc/hosts and the like) is a bind in a share, one per path
  and mode for the whole pod, read-only where the mount says so, and bound
  into the container by the guest: every
  container of the pod sees the same directory, the host's updates (the
  atomic writer's renamed ..data) arrive and the container's writes reach
  the host;
- an emptyDir of medium Memory and the pod's /dev/shm are tmpfs in the
  guest, one per pod, shared by its containers (no host memory);
- a bind whose source is a deferred volume (or a Kata direct volume) is
  resolved, claimed for the pod, device-checked, hot-plugged and mounted by
  the guest once per pod (the handler's own machinery), then bound into the
  container's root; the share never holds a deferred target or a block
  device's file system;
- every destination is resolved inside the container's root (the agent's
  secure_join: a link in the image never leads a bind out of it);
- no container's exit unmounts a virtio-fs submount: when the last mount
  of one went with a file's release still in flight (the guest kernel
  releases virtio-fs files asynchronously), Debian 12's 6.1 kernel stopped
  at `VFS: Busy inodes after unmount` (a BUG) and the exiting process
  never left. So the agent looks up the container's root, each share
  bind and each mount below a bind that does not follow the host
  (`reach`) before crun runs: they are mounted in the agent's namespace
  first, the container's namespace holds copies (the root's is unmounted
  in the agent's when the container is removed). What a container mounts
  itself on first use (a mount the host made below a followed bind,
  which must stay the host's to unmount) is in its own namespace only:
  the agent holds that namespace from the container's start until it is
  removed (agent 14), so the unmount happens then, long after the exit
  (and before the container's volumes are unmounted: the namespace holds
  their binds too);
- a container's process runs under crun in the guest, from the spec
  containerd wrote rewritten for the guest (crust.kata.guest_oci: its
  user and groups, capabilities, no_new_privs, seccomp, masked and
  read-only paths, rlimits and cgroup limits hold as under runc; what the
  guest cannot honour is refused at CreateContainer); an exec is `crun
  exec` with the container's process settings. Both are started by the
  guest's Python agent over its virtio-serial port (crust.kata.port_process,
  specs/agent.proto): one call starts one, its output is read as written
  (the reads wait in the guest), its exit comes from a WaitProcess that
  waits in the guest, so nothing is polled and execs run side by side.
  A process on a terminal, and any process of a VM without the port
  (started by an earlier crust), go through the shell
  agent instead: the command written as a script into the share, its
  stdout and stderr written to files in the guest, read back by offset
  (ReadOutput), its exit found by the pod's process watch. A container of
  a pod started before the guest had crun keeps running as it started
  (`env -i <env> unshare --root=<root> ...`);
- a process with a standard input (CRI's stdin, an exec with stdin) reads
  it from the Python agent's pipe (WriteInput: WriteStdin), or, as a shell
  agent's process, from a fifo that the guest's feed.sh fills from a file
  the handler appends to in the live share (not cached, so the guest sees
  each append at once); one that asks for a terminal
  runs on one made in the guest (guest_oci); the OOM killer's kills in a
  container's cgroup (memory.events) make its exit OOMKilled; its cgroup's
  numbers answer ContainerStats.

A pod is a sandbox of the RuntimeHandler (its record, its volumes, stats,
expansion, the reaper, adoption after a restart are the handler's); what
only pods have (containers, processes) is in a PodRecord beside it. When
the VM dies, every process that had not exited is STOPPED with exit code
255 and a reason; the handler's reaper releases the claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path

from crust.api import handler_pb2
from crust.common import inroot
from crust.common.errors import (
    Aborted,
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
from crust.kata import guest_oci, port_process
from crust.kata.agent import (
    AGENT_REACH,
    AGENT_SUBPATH,
    SHM_TMPFS,
    AgentError,
    GuestGone,
)
from crust.kata.pod_processes import POLL, PORT_WAIT, PodProcesses
from crust.kata.pod_records import (
    GUEST_CONTAINERS,
    VM_GONE_EXIT_CODE,
    ContainerRecord,
    GuestContainer,
    PodNetwork,
    PodRecord,
    ProcessRecord,
    output_name,
)
from crust.kata.pool import VmPool
from crust.kata.port_agent import AGENT_START_WAIT
from crust.kata.portforward import PortForwarder
from crust.kata.process_watch import ProcessWatch
from crust.kata.qemu import Nic, SharedDir, Vm, VmError
from crust.kata.qmp import QmpError, QmpGone, QmpTimeout
from crust.kata.sandbox import KataSandbox
from crust.kata.share import (
    PodShare,
    ShareError,
    cached_in_guest,
    is_atomic_writer_volume_root,
    tag_of,
)
from crust.kata.template import VmTemplate, restore_config
from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord, VolumeView
from crust.runtime_handler.oci import load_requested_bundle
from crust.runtime_handler.resolve import CSI_DIR, SubpathEscapes, pod_volumes
from crust.sys import mount as mounts
from crust.sys import podnet

log = logging.getLogger(__name__)

Status = handler_pb2.ProcessState.Status
Stream = handler_pb2.OutputChunk.Stream

# Mounts the OCI spec lists that the guest gives the container itself
# (/proc, /dev) or that a VM has no use for.
PSEUDO_TYPES = {"proc", "sysfs", "tmpfs", "devpts", "mqueue", "cgroup", "cgroup2", "shm"}
# kubelet's directories (crust/kubelet/volumes.py has the layout).
EMPTY_DIR = "kubernetes.io~empty-dir"
SUBPATHS = "volume-subpaths"
TAP = "crust0"                # the VM's tap in the pod's network namespace
# containerd's annotations on a pod sandbox's spec (its CRI plugin).
SANDBOX_UID = "io.kubernetes.cri.sandbox-uid"
SANDBOX_LOG_DIRECTORY = "io.kubernetes.cri.sandbox-log-directory"


def _sandbox_spec(bundle: str) -> dict:
    """The pod sandbox's spec (containerd's for the pause container), or
    nothing when the bundle has none to read."""
    if not bundle or not (Path(bundle) / "config.json").is_file():
        return {}
    return _raw_spec(bundle)


def network_namespace(spec: dict) -> str:
    """The path of the pod's network namespace in the sandbox's spec, ""
    when it names none (a host-network pod: the VM keeps its own network)."""
    for ns in (spec.get("linux") or {}).get("namespaces") or []:
        if ns.get("type") == "network":
            return str(ns.get("path") or "")
    return ""


def pod_uid(spec: dict) -> str:
    """The pod's uid kubelet gave in RunPodSandbox, from containerd's
    annotations on the sandbox's spec (the uid itself; else the last part
    of the pod's log directory, <namespace>_<name>_<uid>); "" when neither
    names one."""
    annotations = spec.get("annotations") or {}
    uid = str(annotations.get(SANDBOX_UID) or "")
    if not uid:
        log_dir = str(annotations.get(SANDBOX_LOG_DIRECTORY) or "").rstrip("/")
        name = log_dir.rsplit("/", 1)[-1]
        uid = name.rsplit("_", 1)[-1] if name.count("_") >= 2 else ""
    return uid if uid and "/" not in uid and uid not in (".", "..") else ""


def _raw_spec(bundle: str) -> dict:
    """The bundle's config.json as written (load_requested_bundle checked it
    reads; its model keeps only the fields crust itself uses)."""
    try:
        return json.loads((Path(bundle) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"bundle {bundle}: config.json: {exc}") from None


def _is_bind(m) -> bool:
    return m.type == "bind" or "bind" in m.options or "rbind" in m.options


def _tmpfs_size(entry) -> str:
    return next((o.split("=", 1)[1] for o in entry.super_options if o.startswith("size=")), "")


def memory_empty_dir(source: str) -> tuple[str, str, str] | None:
    """(name, subpath, size) when source is an emptyDir of medium Memory (a
    tmpfs kubelet mounted at pods/<uid>/volumes/kubernetes.io~empty-dir/<name>)
    or kubelet's bind of a subPath of one (pods/<uid>/volume-subpaths/<name>/
    <container>/<index>, a bind of a directory in that tmpfs); size is the
    tmpfs's size= option (kubelet's sizeLimit or the node's bound), which
    the guest's tmpfs keeps."""
    parts = source.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] != "pods":
            continue
        pod_dir, rest = "/".join(parts[: i + 1]), parts[i + 1:]
        if len(rest) >= 3 and rest[0] == "volumes" and rest[1] == EMPTY_DIR:
            top = mounts.at(f"{pod_dir}/volumes/{EMPTY_DIR}/{rest[2]}")
            if top is not None and top.fs_type == "tmpfs":
                return rest[2], "/".join(rest[3:]), _tmpfs_size(top)
        elif len(rest) == 4 and rest[0] == SUBPATHS:
            top = mounts.at(f"{pod_dir}/volumes/{EMPTY_DIR}/{rest[1]}")
            bound = mounts.at(source)
            if (top is not None and bound is not None and top.fs_type == "tmpfs"
                    and (bound.major, bound.minor) == (top.major, top.minor)):
                inside = os.path.relpath(bound.root, top.root)
                if inside == ".." or inside.startswith("../"):
                    return None
                return rest[1], "" if inside == "." else inside, _tmpfs_size(top)
        return None
    return None


def _make_mount_points(rootfs: Path, binds: list[tuple]) -> None:
    """Each bind's mount point made in the container's root file system on
    the host, before the guest sees it (crust.common.inroot: resolved
    inside the root, as runc makes them): a directory, a file for a host
    file, only the directories above it for a volume's subpath (which the
    guest knows)."""
    for m, kind, what in binds:
        if kind == "volume":
            shape = "parents" if what[0].subpath else "dir"
        elif kind == "host":
            shape = "dir" if os.path.isdir(m.source) else "file"
        else:
            shape = "dir"
        try:
            inroot.make_mount_point(str(rootfs), m.destination, shape)
        except OSError as exc:
            raise FailedPrecondition(f"mount {m.destination}: no mount point can be made in the container's "
                                     f"root file system: {exc.strerror or exc}") from None


class Pods(PodProcesses):
    def __init__(self, handler: RuntimeHandler, pool: VmPool | None = None, template: VmTemplate | None = None):
        self.handler = handler
        self.pool = pool   # VMs booted ahead (crust.kata.pool); a pod takes one when it can
        self.template = template   # a VM saved once (crust.kata.template); restored when the pool has none
        self.handler_nice = os.getpriority(os.PRIO_PROCESS, 0)   # what a taken VM runs at
        self.records = RecordStore(handler.state_dir / "pods", PodRecord, self._belongs)
        self.pods: dict[str, PodRecord] = dict(self.records.load_all())
        self.locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._creating: set[str] = set()   # container ids whose CreateContainer runs
        self._unwritten: set[str] = set()  # pods stopped in memory whose record is not written yet
        self.forwarders: dict[str, PortForwarder] = {}   # by pod, for those with a network
        self.watches: dict[str, ProcessWatch] = {}   # by pod: one look per interval at its waited-on processes
        self._ahead: dict[str, asyncio.Task] = {}   # by pod: its deferred volumes being mounted ahead
        self.exits = port_process.ExitWatches()   # the port processes' WaitProcess calls
        handler.before_teardown = self._before_teardown
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
        adopted gets back what it had (a root file system disk of a pod
        started before the share, in the VM's table)."""
        for pod_id, pod in self.pods.items():
            sandbox = self._sandbox(pod_id)
            if sandbox is not None and sandbox.alive():
                for c in pod.containers.values():
                    if c.serial:
                        sandbox.vm.disks[c.serial] = Vm._disk(c.serial, c.image, readonly=False)
                if pod.network is not None and not pod.gone:
                    try:
                        await self._forward_ports(pod_id, pod.network)
                    except (podnet.PodNetworkError, OSError) as exc:
                        log.error("port forwarding not restored", extra={"fields": {
                            "sandbox": pod_id, "error": str(exc)}})
        self._watcher = asyncio.create_task(self._watch_forever())

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._ahead:
            # A mount ahead ends with its volume recorded (or given back):
            # the next handler adopts it like any other.
            await asyncio.wait(list(self._ahead.values()), timeout=30)
        for watch in self.watches.values():
            watch.close()
        await self.exits.close()
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
        first (crust.kata.qemu.Vm.lose_file_server)."""
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
        return f"the VM of pod {pod_id} is gone ({sandbox.vm.agent.dead or 'QEMU exited'})"

    async def _mark_gone(self, pod_id: str, reason: str) -> None:
        pod = self.pods.get(pod_id)
        if pod is None or (pod.gone and pod_id not in self._unwritten):
            return
        pod.gone = pod.gone or reason
        now = time.time_ns()
        for c in pod.containers.values():
            for p in c.processes.values():
                if p.pid and p.exit_code is None:
                    p.exit_code, p.exited_at_ns, p.reason = VM_GONE_EXIT_CODE, now, pod.gone
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
        if sandbox is not None and sandbox.alive():
            for c in pod.containers.values():
                try:
                    await self._stop_processes(sandbox, pod, c)
                    if not c.runtime_mounts:
                        await sandbox.vm.agent.umount_all(c.root)
                    if c.oci is not None:   # its namespace's hold, before the volumes are unmounted
                        await sandbox.vm.agent.container_forget(c.container_id)
                except (AgentError, CrustError) as exc:
                    log.warning("could not unmount a container before stopping its pod", extra={"fields": {
                        "sandbox": sandbox_id, "container": c.container_id, "error": str(exc)}})
        alive = sandbox is not None and sandbox.alive()
        await self._mark_gone(sandbox_id, f"the pod {sandbox_id} was stopped" if alive
                              else self._death_reason(sandbox_id, sandbox))

    # -- lookups ---------------------------------------------------------------------------

    def _sandbox(self, pod_id: str) -> KataSandbox | None:
        entry = self.handler.sandboxes.get(pod_id)
        return entry[0] if entry is not None else None

    def _watch(self, pod_id: str) -> ProcessWatch:
        """The pod's ProcessWatch, asking whichever agent its VM has now;
        made on first use, never again for a pod that was deleted (a wait
        still looping then learns it from GuestGone)."""
        watch = self.watches.get(pod_id)
        if watch is not None:
            return watch
        if pod_id not in self.pods:
            raise GuestGone(f"pod {pod_id} was deleted")

        def agent():
            sandbox = self._sandbox(pod_id)
            if sandbox is None:
                raise GuestGone(f"pod {pod_id} has no VM")
            return sandbox.vm.agent
        # Up to twice POLL while nothing changes: a process that exits on
        # its own is seen at most 0.4 s later (kubelet relists every 1 s).
        watch = self.watches[pod_id] = ProcessWatch(agent, POLL, longest=2 * POLL)
        return watch

    def _live(self, pod_id: str) -> tuple[KataSandbox, SandboxRecord, PodRecord]:
        pod = self.pods.get(pod_id)
        if pod is None:
            raise NotFound(f"sandbox_id {pod_id!r}: no such pod")
        entry = self.handler.sandboxes.get(pod_id)
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
        return self.handler._workdir(pod_id)

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
                    return self.handler.sandboxes[sandbox_id][0].pid
                if sandbox_id in self.handler.sandboxes:
                    raise AlreadyExists(f"sandbox_id {sandbox_id!r} is a sandbox of this handler, not a pod")
                await self.handler.registration.wait_registered(f"pod {sandbox_id}")
                sandbox_spec = _sandbox_spec(bundle)
                sysctls, hostname = guest_oci.pod_settings(sandbox_spec)
                interface = await self._pod_interface(sandbox_id, network_namespace(sandbox_spec))
                shares = self._shares(sandbox_id)
                pooled = await self._take_pooled_vm(sandbox_id)
                saved = self.template.saved() if pooled is None and self.template is not None else None
                sandbox = self.handler.make_sandbox(sandbox_id, self._workdir(sandbox_id), None, None, vm=pooled)
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
                    for share in shares:
                        await sandbox._agent(sandbox.vm.agent.share_mount(share.guest, share.tag))
                    await self._apply_pod_settings(sandbox, sandbox_id, sysctls, hostname)
                    if interface is not None:
                        await sandbox._agent(sandbox.vm.agent.network(
                            interface.mac, interface.mtu, list(interface.addresses),
                            [r.word() for r in interface.routes]))
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
                    self.handler.sandboxes[sandbox_id] = (sandbox, record)
                    await self.handler.records.put(sandbox_id, record)
                except BaseException:
                    self.pods.pop(sandbox_id, None)
                    self.handler.sandboxes.pop(sandbox_id, None)
                    await sandbox.stop()
                    await self._disconnect(sandbox_id, pod.network)
                    await asyncio.to_thread(self._tear_down_share, sandbox_id)
                    await self.records.delete(sandbox_id)
                    await self.handler.records.delete(sandbox_id)
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
                        await self.handler._mount_volume(sandbox, record, key, resolved.info, [])
                        await self.handler.records.put(sandbox_id, record)
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
                    await self.handler.records.put(sandbox_id, record)
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

    @staticmethod
    async def _apply_pod_settings(sandbox: KataSandbox, sandbox_id: str, sysctls: dict[str, str],
                                  hostname: str) -> None:
        """The pod sandbox's sysctls and hostname, in the guest (the VM is the
        pod: its network, IPC and UTS namespaces are the guest's own). One
        the guest's kernel refuses fails the pod, naming it."""
        if not sysctls and not hostname:
            return
        agent = sandbox.vm.agent
        name = output_name(sandbox_id, "", "pod-settings")
        pid = await sandbox._agent(agent.spawn(name, guest_oci.sysctl_lines(sysctls, hostname)))
        code = await sandbox._agent(agent.wait_exit(pid, timeout=30))
        if code != 0:
            err, _ = await sandbox._agent(agent.readout(name, "err", 0, 4096))
            raise FailedPrecondition(f"pod {sandbox_id}: linux.sysctl/hostname: "
                                     f"{err.decode(errors='replace').strip() or f'exit code {code}'}")
        await agent.forget_output(name)

    async def delete_pod(self, sandbox_id: str) -> None:
        await self._ahead_settled(sandbox_id)
        async with self.locks[sandbox_id]:
            pod = self.pods.get(sandbox_id)
            if sandbox_id in self.handler.sandboxes:
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
            watch = self.watches.pop(sandbox_id, None)
            if watch is not None:
                watch.close()
            await self.records.delete(sandbox_id)
            await asyncio.to_thread(self._remove_workdir, sandbox_id)
        self.locks.pop(sandbox_id, None)
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
            entry = self.handler.sandboxes.get(pod_id)
            out.append(handler_pb2.PodInfo(
                sandbox_id=pod_id, pid=entry[1].pid if entry else 0,
                alive=bool(entry and entry[0].alive() and not pod.gone),
                container_ids=sorted(pod.containers),
                target_paths=sorted(v.target_path for v in entry[1].volumes.values()) if entry else []))
        return out

    # -- containers --------------------------------------------------------------------------

    async def create_container(self, sandbox_id: str, container_id: str, bundle: str, stdin: bool = False) -> None:
        if not valid_key(container_id):
            raise InvalidArgument(f"container_id {container_id!r} must be {KEY_RULE}")
        spec = load_requested_bundle(bundle)
        rootfs = Path(bundle) / (spec.root.path if spec.root else "rootfs")
        if not rootfs.is_dir():
            raise InvalidArgument(f"bundle {bundle}: its root file system {rootfs} is no directory")
        async with self.locks[sandbox_id]:
            try:
                pod, existing = self._find(container_id)
            except NotFound:
                existing = None
            if existing is not None:
                if pod.sandbox_id == sandbox_id and existing.bundle == bundle:
                    return  # made already (a retried call)
                raise AlreadyExists(f"container_id {container_id!r} exists in pod {pod.sandbox_id}")
            if container_id in self._creating:
                raise Aborted(f"container_id {container_id!r} is being created; retry later")
            sandbox, _, pod = self._live(sandbox_id)
            oci = None
            spec_dict = _raw_spec(bundle)
            terminal = bool((spec_dict.get("process") or {}).get("terminal"))
            if (stdin or terminal) and not pod.guest_runtime:
                raise FailedPrecondition(f"pod {sandbox_id} runs a guest without an OCI runtime: its containers "
                                         f"have no {'terminal' if terminal else 'standard input'}")
            if pod.guest_runtime:
                pod_pid = ""
                if guest_oci.needs_pod_pid_namespace(spec_dict):
                    pod_pid = await sandbox._agent(sandbox.vm.agent.pod_pid_namespace())
                guest, sysctls, hostname = guest_oci.guest_spec(
                    spec_dict, f"{GUEST_CONTAINERS}/{container_id}/rootfs", container_id, pod_pid)
                oci = GuestContainer(spec=guest, sysctls=sysctls, hostname=hostname)
            self._creating.add(container_id)
        try:
            # Resolving (up to ENTRY_WAIT for a new entry) without the pod's
            # lock: the other containers' starts, execs and deletes go on meanwhile.
            binds = await self._plan(spec)
            user = spec.process.user
            c = ContainerRecord(
                container_id=container_id, bundle=bundle, readonly_root=bool(spec.root and spec.root.readonly), oci=oci,
                processes={"": ProcessRecord(args=spec.process.args, env=spec.process.env, cwd=spec.process.cwd,
                                             uid=user.uid if user else 0, gid=user.gid if user else 0,
                                             terminal=terminal, stdin=stdin)})
            started = time.monotonic()
            await self._ahead_settled(sandbox_id)
            async with self.locks[sandbox_id]:
                sandbox, record, pod = self._live(sandbox_id)
                with self.handler.inflight.hold(sandbox_id, container_id):
                    await self._attach_container(sandbox, record, pod, c, rootfs, binds)
            if oci is not None and not terminal:
                # crun makes the container through the guest's Python agent,
                # for which a VM booted a moment ago waits here (without the
                # pod's lock), not at the container's start.
                await sandbox.vm.port.ready(wait=AGENT_START_WAIT)
                async with self.locks[sandbox_id]:
                    sandbox, record, pod = self._live(sandbox_id)
                    if pod.containers.get(container_id) is c:
                        with self.handler.inflight.hold(sandbox_id, container_id):
                            await self._create_on_port(sandbox, record, pod, c)
        finally:
            self._creating.discard(container_id)
        log.info("container created", extra={"fields": {
            "sandbox": sandbox_id, "container": container_id, "seconds": round(time.monotonic() - started, 3),
            "volumes": len(c.volumes), "binds": len(binds)}})

    async def _plan(self, spec) -> list[tuple]:
        """The binds in the spec's order, each (mount, kind, what): kind
        "volume" (what: the resolved deferred volume and whether it is a
        Kata direct volume), "tmpfs" (what: the pod tmpfs's name and a
        subpath in it) or "host" (what: None, a bind through the share).
        Refuses a deferred target that has no entry, and a host path that
        leads to a CSI volume's path, before anything is touched."""
        binds = []
        for m in spec.mounts:
            if not _is_bind(m):
                if m.type not in PSEUDO_TYPES:
                    log.info("mount type not given to a guest container", extra={"fields": {
                        "destination": m.destination, "type": m.type}})
                continue
            if not m.source.startswith("/"):
                raise InvalidArgument(f"mount {m.destination}: source {m.source!r} must be an absolute path")
            try:
                resolved, direct = self.handler._resolve(m.source)
                if resolved is None and CSI_DIR in m.source.split("/"):
                    resolved, direct = await self.handler._wait_resolve(m.source)
            except SubpathEscapes as exc:
                raise InvalidArgument(str(exc)) from None
            if resolved is not None:
                binds.append((m, "volume", (resolved, direct)))
                continue
            if CSI_DIR in m.source.split("/"):
                self.handler._refuse_unseen_deferred(m.source)
            if not os.path.lexists(m.source):
                raise FailedPrecondition(f"mount {m.destination}: source {m.source} does not exist")
            real = os.path.realpath(m.source)
            if CSI_DIR in real.split("/"):
                # A link (or a bind of kubelet's) to a CSI volume's path: that
                # is a deferred volume's target or its placeholder, which
                # reaches a container only as the volume, through its claim.
                raise InvalidArgument(f"mount {m.destination}: source {m.source} leads to a CSI volume's path "
                                      f"({real}); a CSI volume is mounted by its own path only")
            if m.destination == "/dev/shm":
                binds.append((m, "tmpfs", (SHM_TMPFS, "", "")))
                continue
            memory = memory_empty_dir(m.source)
            binds.append((m, "tmpfs", memory) if memory is not None else (m, "host", None))
        return binds

    async def _attach_container(self, sandbox: KataSandbox, record: SandboxRecord, pod: PodRecord,
                                c: ContainerRecord, rootfs: Path, binds: list[tuple]) -> None:
        """The container's root and binds into the share and the guest; undone on failure."""
        container_id = c.container_id
        share, live = self._shares(pod.sandbox_id, sandbox)
        if live.tag not in sandbox.vm.virtiofsds:
            live = share   # a pod started before the live share (its VM has none)
        agent = sandbox.vm.agent
        pod.containers[container_id] = c   # recorded before the guest sees it: a delete knows what to undo
        await self.records.put(pod.sandbox_id, pod)
        new_volumes: list[str] = []
        # crun mounts the container's root and binds (agent 11 makes its
        # sources ready: reach); an older guest's agent binds them itself.
        runtime_mounts = c.oci is not None and agent.version >= AGENT_REACH
        if c.oci is not None and not runtime_mounts:
            guest_oci.leave_binds_to_agent(c.oci.spec)
        try:
            if runtime_mounts:
                await asyncio.to_thread(_make_mount_points, rootfs, binds)
            try:
                guest_rootfs = await asyncio.to_thread(share.add_rootfs, container_id, rootfs)
            except (ShareError, OSError) as exc:
                raise FailedPrecondition(f"container {container_id}: its root file system {rootfs} cannot be "
                                         f"shared with the VM: {exc}") from None
            if not runtime_mounts:
                await sandbox._agent(agent.bind(guest_rootfs, c.root, readonly=False))
                await sandbox._agent(agent.container_setup(c.root))
            # In the spec's order: a later bind may land inside an earlier
            # one. Each source is made ready first (bound in a share, copied
            # in the guest, the pod's tmpfs, a volume hot-plugged and
            # mounted), then all are bound in the container: by crun when it
            # starts it (guest_oci.place_mounts), else by the agent, in one
            # request.
            planned: list[tuple[str, str, bool]] = []   # guest source, destination, read-only
            shared_sources: list[str] = []   # the share's binds and the mounts below them, pinned
            views: list[tuple[int, str, VolumeView]] = []   # (index in planned, volume key, its view)
            for index, (m, kind, what) in enumerate(binds):
                readonly = "ro" in m.options
                if kind == "host":
                    try:
                        into = share if cached_in_guest(m.source) else live
                        follow = bool({"rslave", "rshared", "slave", "shared"} & set(m.options))
                        shared = await asyncio.to_thread(into.add_bind, m.source, readonly, "rbind" in m.options,
                                                         follow)
                    except (ShareError, OSError) as exc:
                        raise FailedPrecondition(f"mount {m.destination}: {m.source} cannot be shared with the "
                                                 f"VM: {exc}") from None
                    if readonly and into is not share and is_atomic_writer_volume_root(m.source) \
                            and not shared.submounts:
                        planned.append((await self._mirror(sandbox, shared.guest), m.destination, True))
                        continue
                    # Read-only at the top on the host (virtiofsd writes as the
                    # host's mounts allow); in the guest only when nothing is
                    # below it: the guest mounts what is below on first use,
                    # and a mount there takes the flags of the one it is in,
                    # so a read-only bind would make the submounts read-only
                    # too (a non-recursive read-only bind keeps their mode).
                    guest_readonly = readonly and not (shared.submounts or follow)
                    planned.append((shared.guest, m.destination, guest_readonly))
                    # A followed bind's mounts are not: held in the guest for
                    # the pod's life, the host could not unmount them.
                    shared_sources += [shared.guest, *(() if follow else shared.below)]
                    continue
                if kind == "tmpfs":
                    name, subpath, size = what
                    source = await sandbox._agent(agent.pod_tmpfs(name, size))
                    if subpath:
                        source = await self._subpath(sandbox, source, subpath, container_id, index, strict=False,
                                                     what=f"mount {m.destination}: subPath {subpath!r} of the "
                                                          f"emptyDir {name}")
                    planned.append((source, m.destination, readonly))
                    continue
                resolved, direct = what
                key = resolved.digest
                view = VolumeView(destination=c.root + m.destination, subpath=resolved.subpath, readonly=readonly)
                if key in record.volumes and not record.volumes[key].ready:
                    # A mount (ahead of the pod's containers, or of one that
                    # failed) that could not be undone then: undone now.
                    await self._give_back(sandbox, record, key)
                if key not in record.volumes:
                    new_volumes.append(key)
                    await self.handler._mount_volume(sandbox, record, key, resolved.info, [], direct)
                    await self.handler.records.put(pod.sandbox_id, record)
                volume = record.volumes[key]
                source = volume.mount_point
                if view.subpath:
                    source = await self._subpath(sandbox, volume.mount_point, view.subpath, container_id, index,
                                                 strict=True, what=f"mount {m.destination}: subpath "
                                                                   f"{view.subpath!r} of volume {resolved.info.volume_id}")
                views.append((len(planned), key, view))
                planned.append((source, m.destination, view.readonly or volume.readonly))
            if runtime_mounts:
                # The root too (the module docstring: no exit unmounts a submount).
                await sandbox._agent(agent.reach(sorted({guest_rootfs, *shared_sources})))
                guest_oci.place_mounts(c.oci.spec, guest_rootfs, [(source, ro) for source, _, ro in planned])
                c.runtime_mounts = True
            else:
                targets = await self._bind_all(sandbox, c.root, planned)
                for index, _, view in views:
                    view.destination = targets[index]
            for _, key, view in views:
                record.volumes[key].views.append(view)
                c.volumes.setdefault(key, []).append(view)
            if c.readonly_root and not c.runtime_mounts:
                # This mount of the root only, once every mount point below
                # it was made: the binds and /proc, /dev keep their modes.
                await sandbox._agent(agent.remount_readonly(c.root))
            await self.handler.records.put(pod.sandbox_id, record)
            await self.records.put(pod.sandbox_id, pod)
        except BaseException as exc:
            log.warning("container create failed; undoing it", extra={"fields": {
                "sandbox": pod.sandbox_id, "container": container_id, "error": str(exc)[:500]}})
            for key in new_volumes:   # also those that failed half way (claimed, not mounted)
                c.volumes.setdefault(key, [])
            try:
                await self._remove_container(sandbox, record, pod, c)
            except CrustError as undo:
                log.error("could not undo a failed container create", extra={"fields": {
                    "sandbox": pod.sandbox_id, "container": container_id, "error": undo.message}})
            raise

    async def _create_on_port(self, sandbox: KataSandbox, record: SandboxRecord, pod: PodRecord,
                              c: ContainerRecord) -> None:
        """crun makes the container now, through the guest's Python agent
        (CreateContainer: held before its process's exec), so that its
        start is only what comes after. Not for a process on a terminal, nor
        when the agent is not connected or cannot: the container's script
        runs crun at its start then."""
        p = c.processes[""]
        port = sandbox.vm.port
        client = port.client
        if not c.runtime_mounts or p.terminal or client is None or client.closed or \
                not port.has("container.create"):
            return
        c.created_on_port = p.on_port = True   # recorded first: a failed create is removed on the port
        await self.records.put(pod.sandbox_id, pod)
        try:
            if c.oci.sysctls or c.oci.hostname:
                await port_process.configure_guest(client, c.oci.sysctls, c.oci.hostname)
            await port_process.create_container(client, c.container_id, c.oci.spec, p.stdin)
        except BaseException as exc:
            log.warning("container create failed; undoing it", extra={"fields": {
                "sandbox": pod.sandbox_id, "container": c.container_id, "error": str(exc)[:500]}})
            try:
                await self._remove_container(sandbox, record, pod, c)
            except CrustError as undo:
                log.error("could not undo a failed container create", extra={"fields": {
                    "sandbox": pod.sandbox_id, "container": c.container_id, "error": undo.message}})
            raise

    @staticmethod
    async def _subpath(sandbox: KataSandbox, root: str, subpath: str, container_id: str, index: int, strict: bool,
                       what: str) -> str:
        """The guest path of subpath below root, bound by the agent from a
        descriptor opened without leaving root (another container of the
        pod may swap a name in a shared volume for a symlink meanwhile); a
        subpath that leaves its volume is refused, naming it."""
        agent = sandbox.vm.agent
        if agent.version < AGENT_SUBPATH:
            raise FailedPrecondition(f"{what}: the pod's guest agent ({agent.version}) cannot bind a subPath from "
                                     f"a descriptor (agent {AGENT_SUBPATH} can): start the pod again")
        try:
            return await sandbox._agent(agent.subpath(root, subpath, container_id, index, strict))
        except FailedPrecondition as exc:
            raise InvalidArgument(f"{what}: {exc.message}") from None

    @staticmethod
    async def _bind_all(sandbox: KataSandbox, root: str, planned: list[tuple[str, str, bool]]) -> list[str]:
        """Each (guest source, destination, read-only) bound in the container
        whose root is mounted at root, in order; the guest paths bound. A
        guest whose agent predates cbinds (a VM booted before agent 8) binds
        them one request at a time."""
        if not planned:
            return []
        agent = sandbox.vm.agent
        try:
            return await sandbox._agent(agent.container_binds(root, planned))
        except CrustError as exc:
            if "unknown command" not in exc.message:
                raise
        return [await sandbox._agent(agent.container_bind(root, source, destination, readonly))
                for source, destination, readonly in planned]

    @staticmethod
    async def _mirror(sandbox: KataSandbox, shared: str) -> str:
        """The guest's copy of an atomic-writer volume bound in the live share
        at shared (agent 7); a guest whose agent has no mirror (a VM booted
        before it) reads the share itself."""
        try:
            return await sandbox._agent(sandbox.vm.agent.mirror(shared.rsplit("/", 1)[1], shared))
        except CrustError as exc:
            if "unknown command" in exc.message:
                return shared
            raise

    async def _remove_container(self, sandbox: KataSandbox | None, record: SandboxRecord | None, pod: PodRecord,
                                c: ContainerRecord) -> None:
        """Unmount the container's root and binds in the guest, give back the
        volumes no other container of the pod uses, take its binds out of the
        share. Every step may run again."""
        errors: list[str] = []
        alive = sandbox is not None and sandbox.alive()
        if alive and not c.runtime_mounts:
            try:
                await sandbox._agent(sandbox.vm.agent.umount_all(c.root))
            except CrustError as exc:
                errors.append(exc.message)
        if alive and c.created_on_port:
            # Its processes killed and forgotten, crun's state and its cgroup
            # gone: by the agent that made it.
            try:
                client = await sandbox.vm.port.ready(wait=PORT_WAIT)
                if client is None:
                    raise Unavailable(f"container {c.container_id}: the guest's agent port is not open")
                await port_process.remove_container(client, c.container_id)
            except CrustError as exc:
                errors.append(exc.message)
        if alive and c.oci is not None:
            # First: the agent holds the container's mount namespace until
            # then, and with it the container's binds of its volumes, whose
            # file systems must be unmounted everywhere before their disks go.
            try:
                await sandbox._agent(sandbox.vm.agent.container_forget(c.container_id))
            except CrustError as exc:
                errors.append(exc.message)
        if record is not None:
            for key in list(c.volumes):
                volume = record.volumes.get(key)
                if volume is not None:
                    volume.views = [v for v in volume.views if not v.destination.startswith(c.root + "/")]
                others = any(key in o.volumes for o in pod.containers.values() if o is not c)
                if volume is not None and not others:
                    try:
                        await self._give_back(sandbox if alive else None, record, key)
                    except CrustError as exc:
                        errors.append(exc.message)
                        continue
                c.volumes.pop(key, None)
            if pod.sandbox_id in self.handler.sandboxes:
                await self.handler.records.put(pod.sandbox_id, record)
        if alive:
            # The root's mount in the agent's namespace (pinned there while
            # the container lived); the container's own copies went with it.
            try:
                root = self._share(pod.sandbox_id, sandbox=sandbox).guest_rootfs(c.container_id)
                await sandbox._agent(sandbox.vm.agent.umount_all(root))
            except CrustError as exc:
                errors.append(exc.message)
            if sandbox.vm.agent.version >= AGENT_SUBPATH:
                try:
                    await sandbox._agent(sandbox.vm.agent.subpath_drop(c.container_id))
                except CrustError as exc:
                    errors.append(exc.message)
        if alive and c.serial and c.serial in sandbox.vm.disks:
            try:
                await sandbox._agent(sandbox.vm.detach_disk(c.serial))
            except (CrustError, VmError) as exc:
                errors.append(getattr(exc, "message", str(exc)))
        if not errors:
            try:
                for share in self._shares(pod.sandbox_id, sandbox if alive else None):
                    await asyncio.to_thread(share.remove_container, c.container_id)
            except (ShareError, OSError) as exc:
                errors.append(f"its binds in the pod's shared directory: {exc}")
        if errors:
            await self.records.put(pod.sandbox_id, pod)
            raise FailedPrecondition(f"container {c.container_id} cleaned up with errors: {'; '.join(errors)}")
        if c.image:
            await asyncio.to_thread(shutil.rmtree, Path(c.image).parent, True)
        if alive:
            for p in c.processes.values():
                if p.name:
                    try:
                        await sandbox.vm.agent.forget_output(p.name)
                    except AgentError:
                        pass
            await self._forget_on_port(sandbox, pod.sandbox_id, c)
        self.exits.forget(c.container_id)
        pod.containers.pop(c.container_id, None)
        await self.records.put(pod.sandbox_id, pod)

    async def _forget_on_port(self, sandbox: KataSandbox, pod_id: str, c: ContainerRecord) -> None:
        """The container's execs in the Python agent's table (their exits
        and unread output): the guest keeps them until told."""
        execs = [p for p in c.processes.values() if p.on_port and p.pid]
        client = await sandbox.vm.port.ready() if execs else None
        for p in execs if client is not None else ():
            try:
                await port_process.remove_process(client, c.container_id, p.exec_id)
            except CrustError as exc:
                log.warning("exec not forgotten in the guest", extra={"fields": {
                    "container": c.container_id, "exec": p.exec_id, "error": exc.message}})
        if c.processes[""].on_port and not c.created_on_port:
            # The spec its script wrote in the guest for crun.
            try:
                await sandbox.vm.agent.forget_output(output_name(pod_id, c.container_id, ""))
            except AgentError:
                pass

    async def _give_back(self, sandbox: KataSandbox | None, record: SandboxRecord, key: str) -> None:
        """Unmount a volume of the pod in the guest (sandbox None: the VM is
        gone), unplug it, release its claim, forget it. Every step may run
        again."""
        volume = record.volumes.get(key)
        if volume is None:
            return
        if sandbox is not None:
            await sandbox.unmount(volume.mount_point)
            if volume.encrypted_name:
                await sandbox.close_encrypted(volume.encrypted_name)
            await sandbox.detach(volume.device)
        await self.handler._release(volume, record.sandbox_id, "")
        record.volumes.pop(key, None)

    async def delete_container(self, container_id: str) -> handler_pb2.ProcessState:
        try:
            pod, c = self._find(container_id)
        except NotFound:
            return handler_pb2.ProcessState(status=Status.STOPPED, reason="no such container (deleted already)")
        async with self.locks[pod.sandbox_id]:
            if container_id not in pod.containers:
                return handler_pb2.ProcessState(status=Status.STOPPED, reason="deleted already")
            entry = self.handler.sandboxes.get(pod.sandbox_id)
            sandbox, record = entry if entry is not None else (None, None)
            with self.handler.inflight.hold(pod.sandbox_id, container_id):
                if sandbox is not None and sandbox.alive():
                    await self._stop_processes(sandbox, pod, c)
                state = await self.state(pod, c, c.processes[""])
                await self._remove_container(sandbox, record, pod, c)
        log.info("container deleted", extra={"fields": {"sandbox": pod.sandbox_id, "container": container_id}})
        return state

    async def _stop_processes(self, sandbox: KataSandbox, pod: PodRecord, c: ContainerRecord,
                              timeout: float = 10.0) -> None:
        """SIGKILL every process of the container (its cgroup in the guest;
        for a container of an older pod, all whose root is its root), then
        wait for their exit codes and for none to be left. Also when its own
        processes all exited: what they left running in the background (in
        a shared PID namespace nothing ends it with them)
        would keep the container's mounts busy."""
        await self._signal_all(sandbox, c, 9)
        deadline = time.monotonic() + timeout
        for p in c.processes.values():
            while p.pid and p.exit_code is None and time.monotonic() < deadline:
                await self._refresh(pod, c, p)
                if p.exit_code is None:
                    await asyncio.sleep(POLL)
        while time.monotonic() < deadline and await self._signal_all(sandbox, c, 0):
            await asyncio.sleep(POLL)

    @staticmethod
    async def _signal_all(sandbox: KataSandbox, c: ContainerRecord, signal: int) -> int:
        """Every process of the container: those in its cgroup (crun's), or
        for a container of an older pod, those whose root is its root."""
        if c.oci is not None:
            return await sandbox._agent(sandbox.vm.agent.container_signal(c.container_id, signal))
        return await sandbox._agent(sandbox.vm.agent.signal_root(c.root, signal))
