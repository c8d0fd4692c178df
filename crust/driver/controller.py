"""CSI Controller service of the loop driver.

Works on files only (backing files in the node pools, records in the
catalog); it never touches a device, so it can run where no loop device
exists (`--mode controller`). Its snapshot calls are
crust.driver.snapshots', the list calls' paging crust.driver.paging's.
"""

from __future__ import annotations

import logging
from typing import Iterable


from crust.api import csi_pb2, csi_pb2_grpc
from crust.common import csi_input
from crust.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
)
from crust.common.formats import NewerFormat, decode
from crust.common.inflight import InFlight
from crust.contract import encryption
from crust.driver.backend import loop as backend
from crust.driver.catalog import Catalog
from crust.driver.config import TOPOLOGY_KEY, DriverConfig
from crust.driver.paging import paged
from crust.driver.snapshots import SnapshotCalls
from crust.driver.records import (
    ContentSource,
    ControllerPublish,
    Lifecycle,
    NodeVolumeRecord,
    PoolRecord,
    VolumeRecord,
    node_records_dir,
)
from crust.sys import fs, loop

log = logging.getLogger(__name__)

GIB = 1024**3
MIB = 1024**2
DEFAULT_SIZE = 1 * GIB
# Sizes are whole MiB: loop devices and both file systems are happy with that,
# and a requested size that is already a MiB multiple is honoured exactly.
ALIGN = MIB
MIN_SIZE = 16 * MIB

# StorageClass parameters this driver understands. Keys with the
# csi.storage.k8s.io/ prefix are the external-provisioner's own and ignored.
PARAM_PROVISIONING = "provisioning"  # thin (default) | thick
PARAM_FS_TYPE = "fsType"
# luks2: the volume is encrypted, opened only inside a microVM guest
# (crust.contract.encryption); kept in the volume context for the node side.
PARAM_ENCRYPTION = encryption.PARAMETER
# hmac-sha256: LUKS2 with authenticated encryption (needs PARAM_ENCRYPTION).
PARAM_INTEGRITY = encryption.INTEGRITY_PARAMETER
PARAMETERS = {PARAM_PROVISIONING, PARAM_FS_TYPE, PARAM_ENCRYPTION, PARAM_INTEGRITY}
MUTABLE_PARAMETERS = {PARAM_PROVISIONING}
PROVISIONING_VALUES = ("thin", "thick")

RPC = csi_pb2.ControllerServiceCapability.RPC
CAPABILITIES = [
    RPC.CREATE_DELETE_VOLUME,
    RPC.PUBLISH_UNPUBLISH_VOLUME,
    RPC.LIST_VOLUMES,
    RPC.GET_CAPACITY,
    RPC.CREATE_DELETE_SNAPSHOT,
    RPC.LIST_SNAPSHOTS,
    RPC.CLONE_VOLUME,
    RPC.PUBLISH_READONLY,
    RPC.EXPAND_VOLUME,
    RPC.LIST_VOLUMES_PUBLISHED_NODES,
    RPC.VOLUME_CONDITION,
    RPC.GET_VOLUME,
    RPC.SINGLE_NODE_MULTI_WRITER,
    RPC.MODIFY_VOLUME,
    RPC.GET_SNAPSHOT,
]
ALPHA_CAPABILITIES = [RPC.GET_NODE_INFO]
DISTRIBUTED_WITHOUT = {RPC.PUBLISH_UNPUBLISH_VOLUME, RPC.PUBLISH_READONLY, RPC.LIST_VOLUMES_PUBLISHED_NODES,
                       RPC.EXPAND_VOLUME}

def _check_parameters(params: dict[str, str], field: str, allowed: set[str]) -> dict[str, str]:
    for key, value in params.items():
        if key.startswith("csi.storage.k8s.io/"):
            continue
        if key not in allowed:
            raise InvalidArgument(f"{field}: unknown key {key!r}; known keys: {', '.join(sorted(allowed))}")
        if key == PARAM_PROVISIONING and value not in PROVISIONING_VALUES:
            raise InvalidArgument(f"{field}[{key!r}] must be one of {', '.join(PROVISIONING_VALUES)}, got {value!r}")
        if key == PARAM_FS_TYPE and value not in fs.SUPPORTED:
            raise InvalidArgument(f"{field}[{key!r}] must be one of {', '.join(fs.SUPPORTED)}, got {value!r}")
        if key == PARAM_ENCRYPTION:
            encryption.of_context(params, field)
        if key == PARAM_INTEGRITY:
            encryption.integrity_of(params, field)
    return {k: v for k, v in params.items() if not k.startswith("csi.storage.k8s.io/")}


class ControllerService(SnapshotCalls, csi_pb2_grpc.ControllerServicer):
    def __init__(self, config: DriverConfig, catalog: Catalog):
        self.config = config
        self.catalog = catalog
        self.inflight = InFlight()
        self.supported_modes = set(csi_input.SINGLE_NODE_MODES)

    # -- helpers --------------------------------------------------------------

    def _capabilities(self, caps: Iterable[csi_pb2.VolumeCapability], field: str) -> list[str]:
        caps = list(caps)
        if not caps:
            raise InvalidArgument(f"{field} is required (at least one)")
        return [
            csi_input.capability(c, f"{field}[{i}]", self.supported_modes, fs.SUPPORTED)
            for i, c in enumerate(caps)
        ]

    def _volume(self, volume_id: str, field: str = "volume_id") -> VolumeRecord:
        csi_input.required(volume_id, field)
        volume = self.catalog.volumes.get(volume_id)
        if volume is None:
            raise NotFound(f"volume {volume_id!r} does not exist")
        return volume

    def _topology(self, node_id: str) -> csi_pb2.Topology:
        return csi_pb2.Topology(segments={TOPOLOGY_KEY: node_id})

    def _csi_volume(self, v: VolumeRecord) -> csi_pb2.Volume:
        source = None
        if v.content_source.snapshot_id:
            source = csi_pb2.VolumeContentSource(
                snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=v.content_source.snapshot_id))
        elif v.content_source.volume_id:
            source = csi_pb2.VolumeContentSource(
                volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=v.content_source.volume_id))
        context = {PARAM_PROVISIONING: self._provisioning(v)}
        if PARAM_FS_TYPE in v.parameters:
            context[PARAM_FS_TYPE] = v.parameters[PARAM_FS_TYPE]
        for key in (PARAM_ENCRYPTION, PARAM_INTEGRITY):
            if v.parameters.get(key):
                context[key] = v.parameters[key]
        return csi_pb2.Volume(
            volume_id=v.volume_id,
            capacity_bytes=v.capacity_bytes,
            volume_context=context,
            content_source=source,
            accessible_topology=[self._topology(v.node)],
        )

    @staticmethod
    def _provisioning(v: VolumeRecord) -> str:
        return v.mutable_parameters.get(PARAM_PROVISIONING) or v.parameters.get(PARAM_PROVISIONING, "thin")

    def _condition(self, v: VolumeRecord) -> csi_pb2.VolumeCondition:
        path = self.catalog.volume_file(v)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return csi_pb2.VolumeCondition(abnormal=True, message=f"backing file of {v.volume_id} is missing")
        if size < v.capacity_bytes:
            return csi_pb2.VolumeCondition(
                abnormal=True, message=f"backing file is {size} bytes, expected {v.capacity_bytes}")
        return csi_pb2.VolumeCondition(abnormal=False, message="backing file present and complete")

    def _place(self, req: csi_pb2.CreateVolumeRequest, size: int, near: str | None,
               pools: dict[str, PoolRecord]) -> PoolRecord:
        """Pick the pool (node) for a new volume.

        Requisite topologies restrict the candidates; preferred ones order
        them (first match wins); without preferences the source's node comes
        first, then the pool with the most room.
        """
        if not pools:
            raise ResourceExhausted("no node has registered a storage pool yet (start `crust driver --mode node`)")
        reqs = req.accessibility_requirements
        candidates = list(pools.values())
        if reqs.requisite:
            wanted = {t.segments.get(TOPOLOGY_KEY) for t in reqs.requisite}
            for i, t in enumerate(reqs.requisite):
                if TOPOLOGY_KEY not in t.segments:
                    raise InvalidArgument(
                        f"accessibility_requirements.requisite[{i}] lacks the segment {TOPOLOGY_KEY!r}")
            candidates = [p for p in candidates if p.node_id in wanted]
        order: list[str] = [t.segments.get(TOPOLOGY_KEY, "") for t in reqs.preferred]
        if near:
            order.append(near)
        rank = {node: i for i, node in reversed(list(enumerate(order)))}
        candidates.sort(key=lambda p: (rank.get(p.node_id, len(order)), -self.catalog.available(p)))
        for pool in candidates:
            if self.catalog.available(pool) >= size:
                return pool
        if not candidates:
            raise ResourceExhausted("no node matches accessibility_requirements.requisite (this controller "
                                    f"provisions on {', '.join(sorted(pools))})")
        raise ResourceExhausted(
            f"no node in the accessible topology has {size} bytes free "
            f"(most free: {max(self.catalog.available(p) for p in candidates)})")

    # -- capabilities -----------------------------------------------------------

    async def ControllerGetCapabilities(self, request, context):
        caps = CAPABILITIES + (ALPHA_CAPABILITIES if self.config.advertise_alpha else [])
        if self.config.distributed:
            # No attach step (the CSIDriver says attachRequired: false) and
            # growth at the node: the external-attacher and -resizer have no
            # per-node mode, so a sidecar on another node must never need
            # this controller.
            caps = [c for c in caps if c not in DISTRIBUTED_WITHOUT]
        return csi_pb2.ControllerGetCapabilitiesResponse(capabilities=[
            csi_pb2.ControllerServiceCapability(rpc=csi_pb2.ControllerServiceCapability.RPC(type=c)) for c in caps
        ])

    # -- volumes ------------------------------------------------------------------

    async def CreateVolume(self, request: csi_pb2.CreateVolumeRequest, context):
        name = csi_input.name(request.name)
        kinds = self._capabilities(request.volume_capabilities, "volume_capabilities")
        params = _check_parameters(dict(request.parameters), "parameters", PARAMETERS)
        mutable = _check_parameters(dict(request.mutable_parameters), "mutable_parameters", MUTABLE_PARAMETERS)
        fs_types = {c.mount.fs_type for c in request.volume_capabilities if c.HasField("mount") and c.mount.fs_type}
        fs_types.add(params.get(PARAM_FS_TYPE, self.config.default_fs_type) if "mount" in kinds else "")
        minimum = max([MIN_SIZE] + [fs.MIN_SIZE.get(t, 0) for t in fs_types])
        if params.get(PARAM_ENCRYPTION):
            # The file system is made inside the LUKS2 volume, after its
            # header (and with integrity, beside its tags).
            minimum += encryption.room_inside(minimum, params.get(PARAM_INTEGRITY, ""))

        source = ContentSource()
        source_file = None
        source_size = 0
        near = None
        if request.HasField("volume_content_source"):
            src = request.volume_content_source
            kind = src.WhichOneof("type")
            if kind == "snapshot":
                sid = csi_input.required(src.snapshot.snapshot_id, "volume_content_source.snapshot.snapshot_id")
                snap = self.catalog.snapshots.get(sid)
                if snap is None:
                    raise NotFound(f"volume_content_source: snapshot {sid!r} does not exist")
                source = ContentSource(snapshot_id=sid)
                source_file, source_size, near = self.catalog.snapshot_file(snap), snap.size_bytes, snap.node
            elif kind == "volume":
                vid = csi_input.required(src.volume.volume_id, "volume_content_source.volume.volume_id")
                vol = self.catalog.volumes.get(vid)
                if vol is None:
                    raise NotFound(f"volume_content_source: volume {vid!r} does not exist")
                source = ContentSource(volume_id=vid)
                source_file, source_size, near = self.catalog.volume_file(vol), vol.capacity_bytes, vol.node
            else:
                raise InvalidArgument("volume_content_source must name a snapshot or a volume")

        rng = request.capacity_range if request.HasField("capacity_range") else None
        pools = self.catalog.pools()
        largest = max((p.capacity_bytes for p in pools.values()), default=0) or 2**62
        size = csi_input.capacity(rng, default=max(DEFAULT_SIZE, source_size), minimum=max(minimum, source_size),
                                  maximum=largest, align=ALIGN)

        with self.inflight.hold(f"name:{name}"):
            # Idempotency: the same name with compatible arguments returns the
            # volume made the first time; anything else is ALREADY_EXISTS.
            existing = self.catalog.volume_by_name(name)
            if existing is not None:
                req_b = rng.required_bytes if rng else 0
                lim_b = rng.limit_bytes if rng else 0
                if (req_b and existing.capacity_bytes < req_b) or (lim_b and existing.capacity_bytes > lim_b):
                    raise AlreadyExists(
                        f"volume {name!r} exists with {existing.capacity_bytes} bytes, outside the requested capacity_range")
                if existing.parameters != params:
                    raise AlreadyExists(f"volume {name!r} exists with different parameters")
                if existing.content_source != source:
                    raise AlreadyExists(f"volume {name!r} exists with a different volume_content_source")
                if existing.capacity_bytes < minimum:
                    raise AlreadyExists(f"volume {name!r} exists with {existing.capacity_bytes} bytes, too small "
                                        f"for the requested volume_capabilities (at least {minimum})")
                requisite = {t.segments.get(TOPOLOGY_KEY) for t in request.accessibility_requirements.requisite}
                if requisite and existing.node not in requisite:
                    raise AlreadyExists(f"volume {name!r} exists on node {existing.node}, outside "
                                        "accessibility_requirements.requisite")
                return csi_pb2.CreateVolumeResponse(volume=self._csi_volume(existing))

            pool = self._place(request, size, near, pools)
            volume = VolumeRecord(
                volume_id=backend.new_id("vol"),
                name=name,
                node=pool.node_id,
                capacity_bytes=size,
                required_bytes=rng.required_bytes if rng else 0,
                limit_bytes=rng.limit_bytes if rng else 0,
                parameters=params,
                mutable_parameters=mutable,
                content_source=source,
                state=Lifecycle.CREATING,
            )
            thick = self._provisioning(volume) == "thick"

            def make_backing(path):
                self.catalog.pool(pool.node_id).ensure()
                if source_file is None:
                    backend.make_blank(path, size, preallocate=thick)
                elif not source_file.exists():
                    raise FailedPrecondition(f"volume_content_source: the data of the source is missing ({source_file.name})")
                else:
                    backend.make_copy(source_file, path, size, preallocate=thick)

            await self.catalog.create_volume(volume, make_backing)
            log.info("volume created", extra={"fields": {"volume_id": volume.volume_id, "node": pool.node_id,
                                                         "bytes": size}})
            return csi_pb2.CreateVolumeResponse(volume=self._csi_volume(volume))

    async def DeleteVolume(self, request: csi_pb2.DeleteVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        with self.inflight.hold(volume_id):
            volume = self.catalog.volumes.get(volume_id)
            if volume is None:
                # Deleting a volume that does not exist (any more) succeeds.
                return csi_pb2.DeleteVolumeResponse()
            if volume.published:
                raise FailedPrecondition(
                    f"volume {volume_id} is still published to node(s) {', '.join(sorted(volume.published))}")

            def check_detached():
                # A CO that skipped ControllerPublish (or lost track) may still
                # have the volume staged. Only this machine's loop devices are
                # seen, which is where `all` mode and a node sharing the
                # machine would hold it.
                attached = self._attached_device(volume)
                if attached:
                    raise FailedPrecondition(
                        f"volume {volume_id} is still attached as {attached} on node {volume.node}; unstage it first")

            await self.catalog.delete_volume(volume, check_detached)
            return csi_pb2.DeleteVolumeResponse()

    def _attached_device(self, volume: VolumeRecord) -> str | None:
        """A loop device attached over the volume's file, if any.

        The node that holds the volume's pool records the devices it
        attaches, and attaches none without its record (it detaches the
        unrecorded ones at start): its record, checked with one sysfs read
        per device, answers without walking every loop device. Only when
        that record cannot be read are all devices walked."""
        backing = self.catalog.volume_file(volume)
        records = node_records_dir(self.config.data_dir, volume.node)
        path = records / f"{volume.volume_id}.json"
        try:
            rec = decode(NodeVolumeRecord, path.read_bytes(), path)
        except FileNotFoundError:
            if not (records / f"{volume.volume_id}.corrupt").exists():
                return None
            rec = None
        except (ValueError, OSError, NewerFormat):  # a newer node's record is read as unreadable: walked
            rec = None
        if rec is None or not rec.device:  # unreadable, or written before devices were recorded
            found = loop.devices_for(backing)
            return found[0] if found else None
        return next((d for d in rec.devices() if loop.serves(d, backing)), None)

    async def ControllerPublishVolume(self, request: csi_pb2.ControllerPublishVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        node_id = csi_input.required(request.node_id, "node_id")
        if not request.HasField("volume_capability"):
            raise InvalidArgument("volume_capability is required")
        kind = csi_input.capability(request.volume_capability, "volume_capability", self.supported_modes, fs.SUPPORTED)
        volume = self._volume(volume_id)
        pools = self.catalog.pools()
        if node_id not in pools:
            raise NotFound(f"node {node_id!r} is not known (it has no storage pool)")
        with self.inflight.hold(volume_id):
            wanted = ControllerPublish(readonly=request.readonly,
                                       access_mode=request.volume_capability.access_mode.mode, access_type=kind)
            current = volume.published.get(node_id)
            if current is not None:
                if current != wanted:
                    raise AlreadyExists(
                        f"volume {volume_id} is already published to {node_id} with "
                        f"readonly={current.readonly}, {current.access_type}; the request differs")
                return csi_pb2.ControllerPublishVolumeResponse(publish_context={"node": node_id})
            if volume.node != node_id:
                raise FailedPrecondition(
                    f"volume {volume_id} lives on node {volume.node} ({TOPOLOGY_KEY}={volume.node}) "
                    f"and cannot be attached to {node_id}")
            others = [n for n in volume.published if n != node_id]
            if others:
                raise FailedPrecondition(f"volume {volume_id} is published to node {others[0]}; "
                                         "single-node access modes allow one node")
            attached = self.catalog.attached_count(node_id)
            limit = pools[node_id].max_volumes_per_node
            if attached >= limit:
                raise ResourceExhausted(f"node {node_id} already has {attached} volumes attached (limit {limit})")
            # Changed in a copy: the indexed record changes only once the
            # new one is on disk (a full disk leaves both as they were).
            await self.catalog.save_volume(volume.model_copy(
                update={"published": {**volume.published, node_id: wanted}}))
            return csi_pb2.ControllerPublishVolumeResponse(publish_context={"node": node_id})

    async def ControllerUnpublishVolume(self, request: csi_pb2.ControllerUnpublishVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        with self.inflight.hold(volume_id):
            volume = self.catalog.volumes.get(volume_id)
            if volume is None:
                # Nothing is attached for a volume that no longer exists; the
                # CO may retry after a successful delete.
                return csi_pb2.ControllerUnpublishVolumeResponse()
            if request.node_id:
                if request.node_id not in volume.published:
                    return csi_pb2.ControllerUnpublishVolumeResponse()
                published = {n: p for n, p in volume.published.items() if n != request.node_id}
            else:
                published = {}
            await self.catalog.save_volume(volume.model_copy(update={"published": published}))
            return csi_pb2.ControllerUnpublishVolumeResponse()

    async def ValidateVolumeCapabilities(self, request: csi_pb2.ValidateVolumeCapabilitiesRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        if not request.volume_capabilities:
            raise InvalidArgument("volume_capabilities is required (at least one)")
        volume = self._volume(volume_id)
        try:
            self._capabilities(request.volume_capabilities, "volume_capabilities")
            _check_parameters(dict(request.parameters), "parameters", PARAMETERS)
        except InvalidArgument as exc:
            # Unsupported capabilities are an answer here, not an error.
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message=exc.message)
        fs_types = {c.mount.fs_type or volume.parameters.get(PARAM_FS_TYPE, self.config.default_fs_type)
                    for c in request.volume_capabilities if c.HasField("mount")}
        for fs_type in sorted(fs_types):
            if volume.capacity_bytes < fs.MIN_SIZE.get(fs_type, 0):
                return csi_pb2.ValidateVolumeCapabilitiesResponse(
                    message=f"volume_capabilities: a {fs_type} file system needs at least "
                            f"{fs.MIN_SIZE[fs_type]} bytes; the volume has {volume.capacity_bytes}")
        if dict(request.parameters) and _check_parameters(dict(request.parameters), "parameters",
                                                            PARAMETERS) != volume.parameters:
            return csi_pb2.ValidateVolumeCapabilitiesResponse(message="parameters differ from the volume's")
        return csi_pb2.ValidateVolumeCapabilitiesResponse(
            confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=request.volume_context,
                volume_capabilities=request.volume_capabilities,
                parameters=request.parameters,
                mutable_parameters=request.mutable_parameters,
            ))

    async def ListVolumes(self, request: csi_pb2.ListVolumesRequest, context):
        ids = sorted(self.catalog.volumes)
        page, token = paged(ids, request.starting_token, request.max_entries)
        entries = []
        for vid in page:
            v = self.catalog.volumes[vid]
            entries.append(csi_pb2.ListVolumesResponse.Entry(
                volume=self._csi_volume(v),
                status=csi_pb2.ListVolumesResponse.VolumeStatus(
                    published_node_ids=sorted(v.published), volume_condition=self._condition(v)),
            ))
        return csi_pb2.ListVolumesResponse(entries=entries, next_token=token)

    async def ControllerGetVolume(self, request: csi_pb2.ControllerGetVolumeRequest, context):
        v = self._volume(request.volume_id)
        return csi_pb2.ControllerGetVolumeResponse(
            volume=self._csi_volume(v),
            status=csi_pb2.ControllerGetVolumeResponse.VolumeStatus(
                published_node_ids=sorted(v.published), volume_condition=self._condition(v)),
        )

    async def GetCapacity(self, request: csi_pb2.GetCapacityRequest, context):
        for i, cap in enumerate(request.volume_capabilities):
            try:
                csi_input.capability(cap, f"volume_capabilities[{i}]", self.supported_modes, fs.SUPPORTED)
            except InvalidArgument:
                # A capability this driver cannot serve has no capacity.
                return csi_pb2.GetCapacityResponse(available_capacity=0)
        _check_parameters(dict(request.parameters), "parameters", PARAMETERS)
        pools = list(self.catalog.pools().values())
        if request.HasField("accessible_topology"):
            node = request.accessible_topology.segments.get(TOPOLOGY_KEY)
            pools = [p for p in pools if p.node_id == node]
        available = [self.catalog.available(p) for p in pools]
        largest = max(available, default=0)
        return csi_pb2.GetCapacityResponse(
            available_capacity=sum(available),
            maximum_volume_size={"value": largest} if pools else None,
            minimum_volume_size={"value": MIN_SIZE},
        )

    async def ControllerExpandVolume(self, request: csi_pb2.ControllerExpandVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        if not request.HasField("capacity_range"):
            raise InvalidArgument("capacity_range is required")
        size = await self.grow_volume(volume_id, request.capacity_range)
        # The node must refresh the loop device and grow the file system.
        return csi_pb2.ControllerExpandVolumeResponse(capacity_bytes=size, node_expansion_required=True)

    async def grow_volume(self, volume_id: str, rng: csi_pb2.CapacityRange) -> int:
        """Grow the backing file to what rng asks (idempotent); the new size.
        Also the node's way to grow a volume in distributed mode."""
        volume = self._volume(volume_id)
        pool = self.catalog.pools().get(volume.node)
        headroom = volume.capacity_bytes + (self.catalog.available(pool) if pool else 0)
        if rng.required_bytes <= volume.capacity_bytes and (not rng.limit_bytes or rng.limit_bytes >= volume.capacity_bytes):
            return volume.capacity_bytes  # already as large as asked: nothing to do (idempotent retry)
        if volume.parameters.get(PARAM_INTEGRITY):
            # cryptsetup 2.6 resizes no dm-integrity device: the guest could
            # not use the room, which would be billed and never shrink back.
            raise FailedPrecondition(f"volume {volume_id} has {PARAM_INTEGRITY}="
                                     f"{volume.parameters[PARAM_INTEGRITY]}: an integrity-protected volume cannot "
                                     "grow (the guest's cryptsetup resizes no dm-integrity device)")
        size = csi_input.capacity(rng, default=volume.capacity_bytes, minimum=volume.capacity_bytes,
                                  maximum=2**62, align=ALIGN)
        if size > headroom:
            raise OutOfRange(f"capacity_range: growing to {size} bytes needs more than the {headroom} bytes "
                             f"node {volume.node} can still provide")
        with self.inflight.hold(volume_id):
            await backend.grow(self.catalog.volume_file(volume), size,
                               preallocate=self._provisioning(volume) == "thick")
            # A file grown whose record could not say so (a full disk) is
            # grown again by the retry, which then records it.
            await self.catalog.save_volume(volume.model_copy(update={"capacity_bytes": size}))
        return size

    async def ControllerModifyVolume(self, request: csi_pb2.ControllerModifyVolumeRequest, context):
        volume_id = csi_input.name(request.volume_id, "volume_id")
        volume = self._volume(volume_id)
        mutable = _check_parameters(dict(request.mutable_parameters), "mutable_parameters", MUTABLE_PARAMETERS)
        with self.inflight.hold(volume_id):
            if mutable.get(PARAM_PROVISIONING) == "thick" and self._provisioning(volume) != "thick":
                # Thick provisioning reserves every block of the backing file
                # now; switching back to thin keeps what is reserved and only
                # stops reserving on later growth.
                await backend.grow(self.catalog.volume_file(volume), volume.capacity_bytes, preallocate=True)
            await self.catalog.save_volume(volume.model_copy(
                update={"mutable_parameters": {**volume.mutable_parameters, **mutable}}))
        return csi_pb2.ControllerModifyVolumeResponse()

    async def ControllerGetNodeInfo(self, request: csi_pb2.ControllerGetNodeInfoRequest, context):
        node_id = csi_input.required(request.node_id, "node_id")
        pool = self.catalog.pools().get(node_id)
        if pool is None:
            raise NotFound(f"node {node_id!r} is not known (it has no storage pool)")
        return csi_pb2.ControllerGetNodeInfoResponse(
            accessible_topology=csi_pb2.Topology(segments=pool.topology),
            max_volumes_per_node=pool.max_volumes_per_node,
        )

    # -- snapshots ------------------------------------------------------------------
