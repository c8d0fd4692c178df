"""What the CRI runtime that made a container's spec says of it in the
spec's annotations: whether it is its pod's sandbox (the pause container),
which pod it belongs to, the pod's uid.

containerd's CRI plugin and CRI-O each write keys of their own. A spec is
read with the keys of the one that made it, never a mix: CRI-O marks every
spec it writes with its own container type, and copies the pod's
annotations, which the pod's author chose, into its specs. Under CRI-O a
containerd key can only have come from the pod's author, and is ignored.
(containerd copies a pod's annotations only when its operator lists them.)

Imports nothing: crust-runc and the shim's `start` read these on a pod's
start path.
"""

from __future__ import annotations

SANDBOX = "sandbox"
CONTAINER = "container"


class Keys:
    def __init__(self, container_type: str, sandbox_id: str, pod_uid: str, host_network: str = ""):
        self.container_type = container_type
        self.sandbox_id = sandbox_id
        self.pod_uid = pod_uid
        self.host_network = host_network   # "" where the runtime writes none


CONTAINERD = Keys("io.kubernetes.cri.container-type", "io.kubernetes.cri.sandbox-id",
                  "io.kubernetes.cri.sandbox-uid")
CRIO = Keys("io.kubernetes.cri-o.ContainerType", "io.kubernetes.cri-o.SandboxID", "io.kubernetes.pod.uid",
            "io.kubernetes.cri-o.HostNetwork")


def annotations_of(spec: dict) -> dict:
    annotations = spec.get("annotations") if isinstance(spec, dict) else None
    return annotations if isinstance(annotations, dict) else {}


def keys_of(annotations: dict) -> Keys:
    """The keys of the CRI runtime that wrote these annotations."""
    return CRIO if CRIO.container_type in annotations else CONTAINERD


def _value(annotations: dict, key: str) -> str:
    value = annotations.get(key) if key else None
    return value if isinstance(value, str) else ""


def container_type(spec: dict) -> str:
    """"sandbox" or "container"; a spec no CRI runtime wrote (`ctr run`)
    is a pod of its own: "sandbox"."""
    annotations = annotations_of(spec)
    return _value(annotations, keys_of(annotations).container_type) or SANDBOX


def sandbox_id(spec: dict) -> str:
    """The pod sandbox's id the container belongs to (the sandbox's own id
    for the sandbox), "" when the spec names none."""
    annotations = annotations_of(spec)
    return _value(annotations, keys_of(annotations).sandbox_id)


def pod_uid(spec: dict) -> str:
    """The pod's uid, as kubelet gave it, "" when the spec names none."""
    annotations = annotations_of(spec)
    return _value(annotations, keys_of(annotations).pod_uid)


def host_network(spec: dict) -> bool | None:
    """Whether the pod is on the host's network, where the runtime says so
    (CRI-O); None where it does not (containerd: a host-network pod's spec
    names no network namespace)."""
    annotations = annotations_of(spec)
    key = keys_of(annotations).host_network
    if not key or key not in annotations:
        return None
    return _value(annotations, key) == "true"
