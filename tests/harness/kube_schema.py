"""A Kubernetes object checked against the API schemas of a recent release
(kubernetes-validate ships them, nothing is fetched): the built-in kinds by
their schema, the custom resources deploy/kubernetes uses by their CRD's
required fields and enums."""

from __future__ import annotations

import kubernetes_validate

KUBERNETES = "1.35"
# Custom resources: kubernetes-validate knows only the built-in API, so
# these get the checks of their CRD's required fields and enums here.
CRDS = {("snapshot.storage.k8s.io/v1", "VolumeSnapshotClass"): {
    "required": {"driver", "deletionPolicy"}, "enums": {"deletionPolicy": {"Delete", "Retain"}}}}


def validate(doc: dict) -> None:
    crd = CRDS.get((doc["apiVersion"], doc["kind"]))
    if crd is None:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        return
    missing = crd["required"] - set(doc)
    if missing:
        raise ValueError(f"{doc['kind']} {doc['metadata']['name']}: missing {sorted(missing)}")
    for key, allowed in crd["enums"].items():
        if doc[key] not in allowed:
            raise ValueError(f"{doc['kind']}.{key}: {doc[key]!r} is not one of {sorted(allowed)}")
