"""A container's bundle as crust's OCI runtime reads and writes it: its
config.json checked in the shape the runtime reads it, the binds whose
source is a kubelet CSI target, and what `create` leaves once the handler
claimed them (config.json rewritten for runc, the original kept, the
runtime's marker). Used by crust-oci-runtime on each call and by the
handler's PrepareBundle (crust.runtime_handler.containers) for crust-runc:
os, json and the runtime's own small modules only, so each call of the
runtime pays little for it."""

from __future__ import annotations

import json
import os

from crust.common import cri_annotations
from crust.oci_runtime.client import RuntimeFailure
from crust.oci_runtime.runc_log import log_line

CSI_SOURCE_MARK = "/kubernetes.io~csi/"
ORIGINAL_CONFIG = "config.crust-original.json"


def deferred_candidates(spec: dict) -> list[dict]:
    """Bind mounts whose source lies below a kubelet CSI volume, by its text
    or by its real path (a symbolic link on the way: the handler refuses a
    link that leads to a deferred volume, which runc would follow)."""
    found = []
    for mount in spec.get("mounts") or []:
        options = mount.get("options") or []
        source = mount.get("source") or ""
        is_bind = mount.get("type") == "bind" or "bind" in options or "rbind" in options
        if is_bind and source.startswith("/") and (CSI_SOURCE_MARK in source
                                                   or CSI_SOURCE_MARK in os.path.realpath(source) + "/"):
            found.append(mount)
    return found


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")


def check_spec(spec, path: str) -> dict:
    """What this runtime reads of config.json, in the shape it reads it (runc
    checks the rest): an object; `mounts` a list of objects whose
    destination, type and source are strings and whose options a list of
    strings; `annotations` an object of strings. RuntimeFailure names the
    field otherwise."""
    if not isinstance(spec, dict):
        raise RuntimeFailure(f"{path}: config.json must hold a JSON object (an OCI runtime spec), "
                             f"not {_json_kind(spec)}")
    mounts = spec.get("mounts")
    if mounts is not None and not isinstance(mounts, list):
        raise RuntimeFailure(f"{path}: mounts must be a list of objects, not {_json_kind(mounts)}")
    for i, mount in enumerate(mounts or []):
        if not isinstance(mount, dict):
            raise RuntimeFailure(f"{path}: mounts[{i}] must be an object, not {_json_kind(mount)}")
        for key in ("destination", "type", "source"):
            if mount.get(key) is not None and not isinstance(mount[key], str):
                raise RuntimeFailure(f"{path}: mounts[{i}].{key} must be a string, not {_json_kind(mount[key])}")
        options = mount.get("options")
        if options is not None and not (isinstance(options, list) and all(isinstance(o, str) for o in options)):
            raise RuntimeFailure(f"{path}: mounts[{i}].options must be a list of strings")
    annotations = spec.get("annotations")
    if annotations is not None and not (isinstance(annotations, dict)
                                        and all(isinstance(v, str) for v in annotations.values())):
        raise RuntimeFailure(f"{path}: annotations must be an object of strings")
    return spec


def load_spec(bundle: str) -> dict:
    """config.json, or the original kept by an earlier create of this bundle."""
    for name in (ORIGINAL_CONFIG, "config.json"):
        path = os.path.join(bundle, name)
        try:
            with open(path) as f:
                spec = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise RuntimeFailure(f"cannot read {path}: {exc}") from None
        return check_spec(spec, path)
    raise RuntimeFailure(f"{bundle} has no config.json")


def rewrite(spec: dict, deferred) -> dict:
    """The spec with each deferred bind replaced by its device mount, in place
    (same position, same destination)."""
    by_destination = {(m.destination, m.target_path): m for m in deferred}
    mounts = []
    for mount in spec.get("mounts") or []:
        replacement = None
        for (destination, target), described in by_destination.items():
            source = os.path.normpath(mount.get("source") or "")
            if mount.get("destination") == destination and source == target:
                replacement = described
        if replacement is None:
            mounts.append(mount)
        else:
            mounts.append({"destination": replacement.destination, "type": replacement.fs_type,
                           "source": replacement.device, "options": list(replacement.options)})
    updated = dict(spec)
    updated["mounts"] = mounts
    annotations = dict(spec.get("annotations") or {})
    annotations["dev.crust.deferred-volumes"] = json.dumps(
        [{"destination": m.destination, "target": m.target_path, "device": m.device, "fstype": m.fs_type}
         for m in deferred], separators=(",", ":"))
    updated["annotations"] = annotations
    return updated


def sandbox_of(spec: dict, container_id: str) -> str:
    """The pod the container belongs to (the claims' sandbox), from the
    CRI runtime's annotation; the container itself outside any pod."""
    return cri_annotations.sandbox_id(spec) or container_id


def write_bundle(bundle: str, state_dir: str, container_id: str, sandbox_id: str, spec: dict, deferred,
                 flags: dict[str, str]) -> None:
    """What `create` leaves once the handler claimed the deferred binds:
    the marker that `delete` looks for, the original spec kept (once: a
    retried create reads it again), config.json rewritten for runc, and a
    line per deferred mount in runc's log. The crust handler does the same
    for crust-runc (PrepareBundle)."""
    from crust.common.private import make_dirs  # (os and pathlib only: no start-up cost)

    make_dirs(state_dir)  # 0700, its parents too, whatever containerd's umask
    write_file(os.path.join(state_dir, container_id),
               json.dumps({"sandbox_id": sandbox_id, "bundle": bundle}).encode(), 0o600)
    original = os.path.join(bundle, ORIGINAL_CONFIG)
    config = os.path.join(bundle, "config.json")
    mode = os.stat(config).st_mode & 0o777
    if not os.path.exists(original):
        write_file(original, json.dumps(spec).encode(), mode)
    write_file(config, json.dumps(rewrite(spec, deferred)).encode(), mode)
    for m in deferred:
        log_line(flags, "info", f"crust: {m.destination}: {m.fs_type} on {m.device}, the deferred volume "
                                f"{m.target_path}, mounted in the container only")


def write_file(path: str, data: bytes, mode: int) -> None:
    """Replace path atomically (rename). No fsync: a bundle and the markers
    are run-time state (under /run on a node), gone after a reboot anyway."""
    temporary = f"{path}.crust-{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temporary, path)
