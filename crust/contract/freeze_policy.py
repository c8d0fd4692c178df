"""`crust.dev/freeze`: what a snapshot of a deferred volume asks of a freeze.

Set in a VolumeSnapshotClass (CreateSnapshot's parameters) or a
StorageClass (CreateVolume's parameters, kept in the volume's context,
which the proxy holds for a deferred volume); the snapshot class's value
wins. `best-effort` (the default): a freeze that cannot be done leaves the
snapshot crash-consistent; `required`: such a snapshot fails; `never`: no
freeze.
"""

from __future__ import annotations

from crust.common.errors import InvalidArgument

PARAMETER = "crust.dev/freeze"
REQUIRED, BEST_EFFORT, NEVER = "required", "best-effort", "never"
MODES = (REQUIRED, BEST_EFFORT, NEVER)


def of(parameters, field: str = "parameters", default: str = BEST_EFFORT) -> str:
    """The mode parameters name; INVALID_ARGUMENT naming the field for another value."""
    value = parameters.get(PARAMETER, default)
    if value not in MODES and not (value == "" and default == ""):
        raise InvalidArgument(f'{field}["{PARAMETER}"] must be one of {", ".join(MODES)}, not {value!r}')
    return value


def of_volume(policy: str, volume_context) -> str:
    """The mode for one volume: the snapshot's policy, else the volume's, else the default."""
    if policy:
        return policy
    value = volume_context.get(PARAMETER, BEST_EFFORT)
    return value if value in MODES else BEST_EFFORT
