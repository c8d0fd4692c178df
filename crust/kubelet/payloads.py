"""What files a configMap, secret, projected or downwardAPI volume holds,
as kubelet's plugins make their payload (pkg/volume/configmap, secret,
projected, downwardapi; fieldpath for the downward API's values): each
file's bytes, mode and owner, for crust.kubelet.atomic_writer to write."""

from __future__ import annotations

import os

from crust.kubelet.atomic_writer import FileProjection
from crust.kubelet.pod import (
    ConfigMap,
    DownwardAPI,
    Pod,
    Projected,
    Secret,
    ServiceAccountToken,
)

# The API server's default for defaultMode of configMap, secret,
# projected and downwardAPI volumes.
DEFAULT_MODE = 0o644
TOKEN_MODE_WITH_OWNER = 0o600
_GO_ESCAPES = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v",
               "\\": "\\\\", '"': '\\"'}


class VolumeError(Exception):
    """A volume could not be set up, used or torn down (kubelet's wording)."""


def go_quote(text: str) -> str:
    """Go's %q of a string (strconv.Quote), as kubelet formats label values."""
    out = ['"']
    for ch in text:
        if ch in _GO_ESCAPES:
            out.append(_GO_ESCAPES[ch])
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    out.append('"')
    return "".join(out)


def format_map(values: dict[str, str]) -> str:
    """fieldpath.FormatMap: key="value" lines, sorted by key."""
    return "\n".join(f"{key}={go_quote(values[key])}" for key in sorted(values))


def field_value(pod: Pod, field_path: str) -> str:
    """fieldpath.ExtractFieldPathAsString for the fields a downward API
    volume may name."""
    for prefix, values in (("metadata.labels", pod.labels), ("metadata.annotations", pod.annotations)):
        if field_path == prefix:
            return format_map(values)
        if field_path.startswith(prefix + "['") and field_path.endswith("']"):
            return values.get(field_path[len(prefix) + 2:-2], "")
    simple = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "metadata.uid": pod.uid}
    if field_path in simple:
        return simple[field_path]
    raise VolumeError(f"unsupported fieldPath: {field_path}")


def fs_user_of(pod: Pod) -> int | None:
    """FsUserFrom: the runAsUser every container of the pod runs as (the
    container's, else the pod's), or None when one has none or they differ."""
    user = None
    for container in pod.all_containers():
        effective = container.run_as_user if container.run_as_user is not None else pod.run_as_user
        if effective is None or (user is not None and user != effective):
            return None
        user = effective
    return user


def _aggregate(errors: list[str]) -> str:
    """utilerrors.NewAggregate's message."""
    return errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"


def payload(pod: Pod, source: ConfigMap | Secret | Projected | DownwardAPI) -> dict[str, FileProjection]:
    """The files of the volume, as the plugin's makePayload/collectData."""
    if isinstance(source, Projected):
        return _projected_payload(pod, source)
    mode = source.default_mode if source.default_mode is not None else DEFAULT_MODE
    if isinstance(source, DownwardAPI):
        return _downward_payload(pod, source.items, mode)
    return _keys_payload(source, mode)


def _keys_payload(source: ConfigMap | Secret, default_mode: int) -> dict[str, FileProjection]:
    if isinstance(source, ConfigMap):
        values = {k: v.encode() for k, v in source.data.items()} | dict(source.binary_data)
        missing = "configmap references non-existent config key: {}"
    else:
        values = dict(source.data)
        missing = "references non-existent secret key: {}"
    if not source.items:
        return {key: FileProjection(value, default_mode) for key, value in values.items()}
    payload = {}
    for item in source.items:
        if item.key not in values:
            if source.optional:
                continue
            raise VolumeError(missing.format(item.key))
        payload[item.path] = FileProjection(values[item.key], item.mode if item.mode is not None else default_mode)
    return payload


def _downward_payload(pod: Pod, items, default_mode: int) -> dict[str, FileProjection]:
    payload, errors = {}, []
    for item in items:
        try:
            value = "\n".join(sorted(field_value(pod, item.field_path).split("\n")))
        except VolumeError as exc:
            errors.append(str(exc))
            value = ""
        payload[os.path.normpath(item.path)] = FileProjection(
            value.encode(), item.mode if item.mode is not None else default_mode)
    if errors:
        raise VolumeError(_aggregate(errors))
    return payload


def _projected_payload(pod: Pod, source: Projected) -> dict[str, FileProjection]:
    mode = source.default_mode if source.default_mode is not None else DEFAULT_MODE
    payload, errors = {}, []
    for projection in source.sources:
        try:
            if isinstance(projection, ServiceAccountToken):
                fs_user = fs_user_of(pod)
                # With an owner or a group the token is 0600, and the
                # group's read bit comes from the fsGroup walk.
                token_mode = TOKEN_MODE_WITH_OWNER if fs_user is not None or pod.fs_group is not None else mode
                payload[projection.path] = FileProjection(projection.token.encode(), token_mode, fs_user)
            elif isinstance(projection, DownwardAPI):
                payload.update(_downward_payload(pod, projection.items, mode))
            else:
                payload.update(_keys_payload(projection, mode))
        except VolumeError as exc:
            errors.append(str(exc))
    if errors:
        raise VolumeError(_aggregate(errors))
    return payload
