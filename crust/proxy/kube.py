"""Pod facts from the Kubernetes API (runtime class, fsGroup), via the
official kubernetes client. Only used when the policy needs them; kubelet
passes the pod's name and namespace in volume_context when the CSIDriver
object sets podInfoOnMount."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from crust.proxy.config import KubernetesAccess

log = logging.getLogger(__name__)

POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"


@dataclass(frozen=True)
class PodFacts:
    runtime_class: str
    fs_group: str
    fs_group_change_policy: str


class PodLookupError(Exception):
    pass


class PodLookup:
    def __init__(self, access: KubernetesAccess):
        self.access = access
        self._api = None

    def _make_api(self):
        from kubernetes import client, config

        if self.access.api_server:
            cfg = client.Configuration()
            cfg.host = self.access.api_server
            if self.access.token_file:
                cfg.api_key = {"authorization": "Bearer " + Path(self.access.token_file).read_text().strip()}
            if self.access.ca_file:
                cfg.ssl_ca_cert = self.access.ca_file
            return client.CoreV1Api(client.ApiClient(cfg))
        if self.access.kubeconfig:
            return client.CoreV1Api(config.new_client_from_config(config_file=self.access.kubeconfig))
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.CoreV1Api()

    def _read(self, namespace: str, name: str) -> PodFacts:
        from kubernetes.client.exceptions import ApiException

        if self._api is None:
            try:
                self._api = self._make_api()
            except Exception as exc:  # noqa: BLE001 - config loaders raise many types
                raise PodLookupError(f"pod {namespace}/{name}: no access to the Kubernetes API ({exc}); set "
                                     "kubernetes.apiServer or kubernetes.kubeconfig in the policy file")
        try:
            pod = self._api.read_namespaced_pod(name, namespace, _request_timeout=self.access.timeout_seconds)
        except ApiException as exc:
            raise PodLookupError(f"pod {namespace}/{name}: the API server answered {exc.status} {exc.reason}")
        except Exception as exc:  # noqa: BLE001 - network errors come in many types
            raise PodLookupError(f"pod {namespace}/{name}: {exc}")
        sc = pod.spec.security_context
        return PodFacts(
            runtime_class=pod.spec.runtime_class_name or "",
            fs_group=str(sc.fs_group) if sc is not None and sc.fs_group is not None else "",
            fs_group_change_policy=(sc.fs_group_change_policy or "") if sc is not None else "",
        )

    async def pod(self, namespace: str, name: str) -> PodFacts:
        return await asyncio.to_thread(self._read, namespace, name)
