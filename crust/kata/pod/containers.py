"""The containers of a microVM pod, as PodRuntime (specs/handler.proto)
asks for them: create and delete. The pods, their records, locks and VMs
are the PodRegistry's (crust.kata.pod.registry); the containers' processes
are crust.kata.pod.processes', the pod's volumes crust.kata.pod.volumes'.

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
- every destination is resolved inside the container's root by crun (as
  runc resolves it: a link in the image never leads a bind out of it),
  each subPath opened below its source by descriptors in the guest;
- the guest's agent makes the container (CreateContainer) from the
  rewritten spec and each source named by what it is (crust.guest.places);
- no container's exit unmounts a virtio-fs submount: when the last mount
  of one went with a file's release still in flight (the guest kernel
  releases virtio-fs files asynchronously), Debian 12's 6.1 kernel stopped
  at `VFS: Busy inodes after unmount` (a BUG) and the exiting process
  never left. So the agent looks up the container's root, each share bind
  and each mount below a bind that does not follow the host before crun
  runs (mounted in the agent's namespace, the container's holds copies),
  and holds the container's mount namespace until RemoveContainer, which
  releases it long after the exit (and before the container's volumes are
  unmounted: the namespace holds their binds too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path

from crust.api import agent_pb2, handler_pb2
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
from crust.common.recordstore import KEY_RULE, valid_key
from crust.kata.agent import calls, volume_calls
from crust.kata.pod import container_spec, mount_plan
from crust.kata.agent import stop_bound
from crust.kata.pod.mount_plan import PlannedBind, SourceFacts, in_pod_terms, placement
from crust.kata.pod.processes import Processes
from crust.kata.pod.records import (
    GUEST_CONTAINERS,
    ContainerRecord,
    GuestContainer,
    PodRecord,
    ProcessRecord,
)
from crust.kata.vmm.agent_port import AGENT_START_WAIT
from crust.kata.agent.calls import SHM_TMPFS
from crust.kata.pod.registry import PodRegistry
from crust.kata.pod.volumes import PodVolumes
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.kata.vmm.share import ShareError, cached_in_guest, is_atomic_writer_volume_root
from crust.runtime_handler.handler import RuntimeHandler, SandboxRecord, VolumeView
from crust.runtime_handler.oci import load_requested_bundle

log = logging.getLogger("crust.kata.pod.pods")

Status = handler_pb2.ProcessState.Status

# What the guest's agent lists when it makes a container from its named sources.
PLACING = ("container.oci", "container.pod-pid", "container.terminal", "share.virtiofs", "tmpfs.pod",
           "subpath.beneath", "mirror.atomic-writer")


def raw_spec(bundle: str) -> dict:
    """The bundle's config.json as written (load_requested_bundle checked it
    reads; its model keeps only the fields crust itself uses)."""
    try:
        return json.loads((Path(bundle) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"bundle {bundle}: config.json: {exc}") from None


def _make_mount_points(rootfs: Path, binds: list[PlannedBind]) -> None:
    """Each bind's mount point made in the container's root file system on
    the host, before the guest sees it (crust.common.inroot: resolved
    inside the root, as runc makes them): a directory, a file for a host
    file, only the directories above it for a volume's subpath (which the
    guest knows)."""
    for m, kind, what in binds:
        if kind == mount_plan.VOLUME:
            shape = "parents" if what[0].subpath else "dir"
        elif kind == mount_plan.HOST:
            shape = "dir" if os.path.isdir(m.source) else "file"
        else:
            shape = "dir"
        try:
            inroot.make_mount_point(str(rootfs), m.destination, shape)
        except OSError as exc:
            raise FailedPrecondition(f"mount {m.destination}: no mount point can be made in the container's "
                                     f"root file system: {exc.strerror or exc}") from None


class Containers:
    def __init__(self, registry: PodRegistry, handler: RuntimeHandler, processes: Processes, volumes: PodVolumes):
        self.registry = registry
        self.handler = handler
        self.processes = processes
        self.volumes = volumes
        self._creating: set[str] = set()   # container ids whose CreateContainer runs

    async def create_container(self, sandbox_id: str, container_id: str, bundle: str, stdin: bool = False) -> None:
        if not valid_key(container_id):
            raise InvalidArgument(f"container_id {container_id!r} must be {KEY_RULE}")
        spec = load_requested_bundle(bundle)
        rootfs = Path(bundle) / (spec.root.path if spec.root else "rootfs")
        if not rootfs.is_dir():
            raise InvalidArgument(f"bundle {bundle}: its root file system {rootfs} is no directory")
        spec_dict = raw_spec(bundle)
        early = self.registry.sandbox(sandbox_id)
        if early is not None and early.alive():
            # crun makes the container through the guest's agent, for
            # which a VM booted a moment ago waits here (without the pod's
            # lock), before anything of the container is placed.
            await early.vm.port.ready(wait=AGENT_START_WAIT)
        async with self.registry.locks[sandbox_id]:
            try:
                pod, existing = self.registry.find(container_id)
            except NotFound:
                existing = None
            if existing is not None:
                if pod.sandbox_id == sandbox_id and existing.bundle == bundle:
                    return  # made already (a retried call)
                raise AlreadyExists(f"container_id {container_id!r} exists in pod {pod.sandbox_id}")
            if container_id in self._creating:
                raise Aborted(f"container_id {container_id!r} is being created; retry later")
            sandbox, _, pod = self.registry.live(sandbox_id)
            if sandbox.vm.port.details is None:
                raise Unavailable(f"pod {sandbox_id}: its guest's agent is not connected")
            missing = [name for name in PLACING if not sandbox.vm.port.has(name)]
            if not pod.guest_runtime or missing:
                raise FailedPrecondition(f"pod {sandbox_id}: its guest's agent does not make containers "
                                         f"({', '.join(missing) or 'no OCI runtime'} missing): delete the pod and "
                                         f"run it again")
            guest, sysctls, hostname = container_spec.guest_spec(
                spec_dict, f"{GUEST_CONTAINERS}/{container_id}/rootfs", container_id)
            oci = GuestContainer(spec=guest, sysctls=sysctls, hostname=hostname, placed_by_agent=True,
                                 pod_pid_namespace=container_spec.needs_pod_pid_namespace(spec_dict))
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
                                             terminal=bool(guest["process"]["terminal"]), stdin=stdin)})
            started = time.monotonic()
            await self.volumes.settled(sandbox_id)
            async with self.registry.locks[sandbox_id]:
                sandbox, record, pod = self.registry.live(sandbox_id)
                with self.handler.inflight.hold(sandbox_id, container_id):
                    await self._attach_container(sandbox, record, pod, c, rootfs, binds)
            async with self.registry.locks[sandbox_id]:
                sandbox, record, pod = self.registry.live(sandbox_id)
                if pod.containers.get(container_id) is c:
                    with self.handler.inflight.hold(sandbox_id, container_id):
                        await self._create_on_port(sandbox, record, pod, c)
        finally:
            self._creating.discard(container_id)
        log.info("container created", extra={"fields": {
            "sandbox": sandbox_id, "container": container_id, "seconds": round(time.monotonic() - started, 3),
            "volumes": len(c.volumes), "binds": len(binds)}})

    async def _plan(self, spec) -> list[PlannedBind]:
        """The spec's binds planned (crust.kata.pod.mount_plan) from what the
        handler and the host say of each source, gathered first: a
        deferred target published a moment ago is waited for (without the
        pod's lock), an unseen one refused, before anything is touched."""
        facts: dict[str, SourceFacts] = {}
        for source in mount_plan.bind_sources(spec.mounts):
            if source in facts:
                continue
            volume, direct = await self.handler.find_volume(source)
            facts[source] = SourceFacts(volume=volume, direct=direct) if volume is not None else \
                await asyncio.to_thread(mount_plan.host_facts, source)
        return mount_plan.plan(spec.mounts, facts)

    async def _attach_container(self, sandbox: KataSandbox, record: SandboxRecord, pod: PodRecord,
                                c: ContainerRecord, rootfs: Path, binds: list[PlannedBind]) -> None:
        """The container's root and binds made ready for the guest, each named
        as the guest's agent knows it (crust.guest.places); undone on failure."""
        container_id = c.container_id
        share, live = self.registry.shares(pod.sandbox_id, sandbox)
        if live.tag not in sandbox.vm.virtiofsds:
            live = share   # a pod started before the live share (its VM has none)
        pod.containers[container_id] = c   # recorded before the guest sees it: a delete knows what to undo
        await self.registry.save(pod)
        new_volumes: list[str] = []
        try:
            client = await sandbox.port()
            await asyncio.to_thread(_make_mount_points, rootfs, binds)
            try:
                guest_rootfs = await asyncio.to_thread(share.add_rootfs, container_id, rootfs)
            except (ShareError, OSError) as exc:
                raise FailedPrecondition(f"container {container_id}: its root file system {rootfs} cannot be "
                                         f"shared with the VM: {exc}") from None
            # In the spec's order: a later bind may land inside an earlier
            # one. Each source is made ready first (bound in a share, copied
            # in the guest, the pod's tmpfs, a volume hot-plugged and
            # mounted), then crun binds them all when CreateContainer makes
            # the container.
            named: list[agent_pb2.Source] = []   # each source as the agent knows it
            modes: list[bool] = []   # read-only in the guest
            told: list[str] = []   # each as the pod's spec says it, for the agent's refusals
            views: list[tuple[str, VolumeView]] = []   # (volume key, its view)
            for m, kind, what in binds:
                readonly = "ro" in m.options
                if kind == mount_plan.HOST:
                    try:
                        into = share if cached_in_guest(m.source) else live
                        follow = bool({"rslave", "rshared", "slave", "shared"} & set(m.options))
                        shared = await asyncio.to_thread(into.add_bind, m.source, readonly, "rbind" in m.options,
                                                         follow)
                    except (ShareError, OSError) as exc:
                        raise FailedPrecondition(f"mount {m.destination}: {m.source} cannot be shared with the "
                                                 f"VM: {exc}") from None
                    told.append(f"mount {m.destination}: {m.source}")
                    if readonly and into is not share and is_atomic_writer_volume_root(m.source) \
                            and not shared.submounts:
                        name = shared.guest.rsplit("/", 1)[1]
                        await calls.start_mirror(client, name, into.tag,
                                                        os.path.relpath(shared.guest, into.guest))
                        named.append(agent_pb2.Source(mirror=name))
                        modes.append(True)
                        continue
                    # Read-only at the top on the host (virtiofsd writes as the
                    # host's mounts allow); in the guest only when nothing is
                    # below it: the guest mounts what is below on first use,
                    # and a mount there takes the flags of the one it is in,
                    # so a read-only bind would make the submounts read-only
                    # too (a non-recursive read-only bind keeps their mode).
                    # A followed bind's mounts are not named: held in the
                    # guest for the pod's life, the host could not unmount them.
                    named.append(agent_pb2.Source(share=agent_pb2.SharePath(
                        tag=into.tag, path=os.path.relpath(shared.guest, into.guest),
                        submounts=[] if follow else [os.path.relpath(b, shared.guest) for b in shared.below])))
                    modes.append(readonly and not (shared.submounts or follow))
                    continue
                if kind == mount_plan.TMPFS:
                    name, subpath, size = what
                    await calls.mount_pod_tmpfs(client, name, size)
                    named.append(agent_pb2.Source(pod_tmpfs=name, subpath=subpath))
                    modes.append(readonly)
                    told.append(f"mount {m.destination}: subPath {subpath!r} of the emptyDir {name}"
                                if name != SHM_TMPFS else f"mount {m.destination}: the pod's /dev/shm")
                    continue
                resolved, direct = what
                key = resolved.digest
                view = VolumeView(destination=c.root + m.destination, subpath=resolved.subpath, readonly=readonly)
                if key in record.volumes and not record.volumes[key].ready:
                    # A mount (ahead of the pod's containers, or of one that
                    # failed) that could not be undone then: undone now.
                    await self.volumes.give_back(sandbox, record, key)
                if key not in record.volumes:
                    new_volumes.append(key)
                    await self.handler.mount_volume(sandbox, record, key, resolved.info, [], direct)
                    await self.handler.save(record)
                volume = record.volumes[key]
                views.append((key, view))
                named.append(agent_pb2.Source(volume_id=volume_calls.volume_id(volume.mount_point),
                                              subpath=view.subpath, strict=True))
                modes.append(view.readonly or volume.readonly)
                told.append(f"mount {m.destination}: subpath {view.subpath!r} of volume "
                            f"{resolved.info.volume_id}" if view.subpath else
                            f"mount {m.destination}: volume {resolved.info.volume_id}")
            c.oci.sources = placement(c.oci.spec, agent_pb2.SharePath(
                tag=share.tag, path=os.path.relpath(guest_rootfs, share.guest)),
                list(zip(named, modes)), c.oci.pod_pid_namespace)
            c.oci.bind_names = told
            c.runtime_mounts = True
            for key, view in views:
                record.volumes[key].views.append(view)
                c.volumes.setdefault(key, []).append(view)
            await self.handler.save(record)
            await self.registry.save(pod)
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
        """crun makes the container now, through the guest's agent
        (CreateContainer: held before its process's exec), so that its
        start is only what comes after."""
        p = c.processes[""]
        c.created_on_port = p.on_port = True   # recorded first: a failed create is removed on the port
        await self.registry.save(pod)
        try:
            client = await sandbox.port()
            if c.oci.sysctls or c.oci.hostname:
                await calls.configure_guest(client, c.oci.sysctls, c.oci.hostname)
            try:
                await calls.create_container(client, c.container_id, c.oci.spec, p.stdin, c.oci.sources)
            except CrustError as exc:
                raise in_pod_terms(exc, c.oci.bind_names) from None
        except BaseException as exc:
            log.warning("container create failed; undoing it", extra={"fields": {
                "sandbox": pod.sandbox_id, "container": c.container_id, "error": str(exc)[:500]}})
            try:
                await self._remove_container(sandbox, record, pod, c)
            except CrustError as undo:
                log.error("could not undo a failed container create", extra={"fields": {
                    "sandbox": pod.sandbox_id, "container": c.container_id, "error": undo.message}})
            raise

    async def _remove_container(self, sandbox: KataSandbox | None, record: SandboxRecord | None, pod: PodRecord,
                                c: ContainerRecord) -> None:
        """The container removed in the guest (its processes, crun's state,
        its cgroup, its root and subPaths), the volumes no other container
        of the pod uses given back, its binds taken out of the share. Every
        step may run again."""
        errors: list[str] = []
        alive = sandbox is not None and sandbox.alive()
        if sandbox is not None:
            sandbox.counters.forget(c.container_id)
        if alive and c.created_on_port:
            try:
                await calls.remove_container(await sandbox.port(), c.container_id)
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
                        await self.volumes.give_back(sandbox if alive else None, record, key)
                    except CrustError as exc:
                        errors.append(exc.message)
                        continue
                c.volumes.pop(key, None)
            if self.handler.entry(pod.sandbox_id) is not None:
                await self.handler.save(record)
        if not errors:
            try:
                for share in self.registry.shares(pod.sandbox_id, sandbox if alive else None):
                    await asyncio.to_thread(share.remove_container, c.container_id)
            except (ShareError, OSError) as exc:
                errors.append(f"its binds in the pod's shared directory: {exc}")
        if errors:
            await self.registry.save(pod)
            raise FailedPrecondition(f"container {c.container_id} cleaned up with errors: {'; '.join(errors)}")
        if alive:
            await self.processes.forget_on_port(sandbox, c)
        self.processes.forget_container(c.container_id)
        pod.containers.pop(c.container_id, None)
        await self.registry.save(pod)

    async def delete_container(self, container_id: str) -> handler_pb2.ProcessState:
        try:
            pod, c = self.registry.find(container_id)
        except NotFound:
            return handler_pb2.ProcessState(status=Status.STOPPED, reason="no such container (deleted already)")
        await self.handler.reaped(pod.sandbox_id)   # a VM that died: its teardown first
        async with self.registry.locks[pod.sandbox_id]:
            if container_id not in pod.containers:
                return handler_pb2.ProcessState(status=Status.STOPPED, reason="deleted already")
            entry = self.handler.entry(pod.sandbox_id)
            sandbox, record = entry if entry is not None else (None, None)
            with self.handler.inflight.hold(pod.sandbox_id, container_id):
                if sandbox is not None and sandbox.alive():
                    with stop_bound.bounded(stop_bound.POD_STOP):
                        await self.processes.stop_all(sandbox, pod, c)
                state = await self.processes.state(pod, c, c.processes[""])
                await self._remove_container(sandbox, record, pod, c)
        log.info("container deleted", extra={"fields": {"sandbox": pod.sandbox_id, "container": container_id}})
        return state
