"""The part of kustomize that deploy/kubernetes uses, to render it in tests
without kubectl: `resources` (files, or directories with a kustomization),
`namespace`, and `patches` given by `path` (strategic merge: maps merge,
lists of named items merge by name, other lists are replaced). Any other
kustomization key is refused, so a manifest can never rely on a feature this
renderer would silently skip."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "namespace", "resources", "patches"}
# Kinds without a namespace (the `namespace` key leaves them alone).
CLUSTER_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CSIDriver", "StorageClass",
                 "VolumeSnapshotClass", "RuntimeClass", "PriorityClass"}


def _identity(doc: dict) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


def strategic_merge(base, patch):
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and all(
            isinstance(i, dict) and "name" in i for i in base + patch):
        merged = [copy.deepcopy(i) for i in base]
        index = {item["name"]: n for n, item in enumerate(merged)}
        for item in patch:
            if item["name"] in index:
                merged[index[item["name"]]] = strategic_merge(merged[index[item["name"]]], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def load_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: keys this renderer does not know: {sorted(unknown)}")
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += render(path) if path.is_dir() else load_documents(path)
    for patch_entry in kustomization.get("patches", []):
        for patch in load_documents(directory / patch_entry["path"]):
            matches = [n for n, d in enumerate(docs) if _identity(d) == _identity(patch)]
            if len(matches) != 1:
                raise ValueError(f"patch {patch_entry['path']} matches {len(matches)} resources")
            docs[matches[0]] = strategic_merge(docs[matches[0]], patch)
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] not in CLUSTER_KINDS:
                doc["metadata"]["namespace"] = namespace
            for subject in doc.get("subjects", []):
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace
    seen: set[tuple[str, str, str, str]] = set()
    for doc in docs:
        key = _identity(doc) + (doc["metadata"].get("namespace", ""),)
        if key in seen:
            raise ValueError(f"{key} is defined twice")
        seen.add(key)
    return docs
