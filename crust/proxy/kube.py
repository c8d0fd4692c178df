"""Pod facts from the Kubernetes API (runtime class, fsGroup and its change
policy): the proxy's one read of the cluster, GET of a pod. Only used when
the policy needs them; kubelet passes the pod's name and namespace in
volume_context when the CSIDriver object sets podInfoOnMount.

One HTTPS GET needs no client library: this module speaks it with the
standard library (the official client would be a third of the node image).
Where the credentials come from, in order:
1. the policy's kubernetes.apiServer (with tokenFile and caFile);
2. the policy's kubernetes.kubeconfig;
3. in a pod: the service account (KUBERNETES_SERVICE_HOST, its token and CA);
4. the kubeconfig of $KUBECONFIG or ~/.kube/config.
From a kubeconfig: the current context's server, certificate authority (file
or data, or insecure-skip-tls-verify) and user (token, tokenFile, or a client
certificate and key as files or data). Exec and auth-provider plugins are
refused with a message saying so. Token files are read again for every
request: kubelet rotates service account tokens.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from crust.proxy.config import KubernetesAccess

POD_NAME = "csi.storage.k8s.io/pod.name"
POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
# Every request crust makes of the API server (its RBAC in
# deploy/kubernetes/rbac.yaml grants exactly these; tests/unit/test_deploy.py checks).
READ_POD = ("GET", "/api/v1/namespaces/{namespace}/pods/{name}")
API_CALLS = [READ_POD]


@dataclass(frozen=True)
class PodFacts:
    runtime_class: str
    fs_group: str
    fs_group_change_policy: str


class PodLookupError(Exception):
    pass


@dataclass
class Connection:
    server: str
    context: ssl.SSLContext | None
    token: str = ""
    token_file: str = ""

    def authorization(self) -> dict[str, str]:
        token = Path(self.token_file).read_text().strip() if self.token_file else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}


def _tls(server: str, ca_file: str = "", ca_data: bytes = b"", insecure: bool = False,
         cert: tuple[bytes, bytes] | None = None) -> ssl.SSLContext | None:
    if not server.startswith("https://"):
        return None
    context = ssl.create_default_context(cafile=ca_file or None, cadata=ca_data.decode() if ca_data else None)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert is not None:
        # ssl loads a client certificate from files only: a private temporary
        # directory, removed as soon as it is loaded.
        with tempfile.TemporaryDirectory(prefix="crust-kube-") as directory:
            cert_path, key_path = Path(directory) / "client.crt", Path(directory) / "client.key"
            for path, data in ((cert_path, cert[0]), (key_path, cert[1])):
                path.write_bytes(data)
                path.chmod(0o600)
            context.load_cert_chain(cert_path, key_path)
    return context


def _file_or_data(entry: dict, key: str, base: Path) -> bytes:
    """A kubeconfig's `key` (a path, relative to the kubeconfig) or `key-data` (base64)."""
    if entry.get(f"{key}-data"):
        return base64.b64decode(entry[f"{key}-data"])
    if entry.get(key):
        return (base / entry[key]).read_bytes()
    return b""


def from_kubeconfig(path: Path) -> Connection:
    config = yaml.safe_load(path.read_text()) or {}
    current = config.get("current-context", "")
    contexts = {c["name"]: c.get("context", {}) for c in config.get("contexts") or []}
    if current not in contexts:
        raise ValueError(f"{path}: current-context {current!r} is not among its contexts")
    context = contexts[current]
    clusters = {c["name"]: c.get("cluster", {}) for c in config.get("clusters") or []}
    users = {u["name"]: u.get("user", {}) for u in config.get("users") or []}
    cluster, user = clusters.get(context.get("cluster"), {}), users.get(context.get("user"), {})
    if not cluster.get("server"):
        raise ValueError(f"{path}: the cluster of context {current!r} has no server")
    if "exec" in user or "auth-provider" in user:
        raise ValueError(f"{path}: the user of context {current!r} uses an exec or auth-provider plugin; give "
                         "crust a token, a token file or a client certificate")
    base = path.parent
    cert = _file_or_data(user, "client-certificate", base)
    key = _file_or_data(user, "client-key", base)
    token_file = str(base / user["tokenFile"]) if user.get("tokenFile") else ""
    return Connection(
        server=cluster["server"].rstrip("/"),
        context=_tls(cluster["server"], ca_data=_file_or_data(cluster, "certificate-authority", base),
                     insecure=bool(cluster.get("insecure-skip-tls-verify")), cert=(cert, key) if cert else None),
        token=user.get("token", ""), token_file=token_file)


def connect(access: KubernetesAccess) -> Connection:
    """Where and how to reach the API server (the order in the module's doc)."""
    if access.api_server:
        server = access.api_server.rstrip("/")
        return Connection(server, _tls(server, ca_file=access.ca_file), token_file=access.token_file)
    if access.kubeconfig:
        return from_kubeconfig(Path(access.kubeconfig))
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if host and (SERVICE_ACCOUNT / "token").exists():
        server = f"https://{host}:{port}" if ":" not in host else f"https://[{host}]:{port}"
        return Connection(server, _tls(server, ca_file=str(SERVICE_ACCOUNT / "ca.crt")),
                          token_file=str(SERVICE_ACCOUNT / "token"))
    default = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
    return from_kubeconfig(Path(default))


class PodLookup:
    def __init__(self, access: KubernetesAccess):
        self.access = access
        self._connection: Connection | None = None

    def _read(self, namespace: str, name: str) -> PodFacts:
        if self._connection is None:
            try:
                self._connection = connect(self.access)
            except (OSError, ValueError, KeyError, TypeError, ssl.SSLError, yaml.YAMLError) as exc:
                raise PodLookupError(f"pod {namespace}/{name}: no access to the Kubernetes API ({exc}); set "
                                     "kubernetes.apiServer or kubernetes.kubeconfig in the policy file")
        c = self._connection
        url = c.server + READ_POD[1].format(namespace=urllib.parse.quote(namespace, safe=""),
                                            name=urllib.parse.quote(name, safe=""))
        try:
            request = urllib.request.Request(url, headers={"Accept": "application/json", **c.authorization()})
            with urllib.request.urlopen(request, timeout=self.access.timeout_seconds, context=c.context) as answer:
                pod = json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise PodLookupError(f"pod {namespace}/{name}: the API server answered {exc.code} {exc.reason}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PodLookupError(f"pod {namespace}/{name}: {getattr(exc, 'reason', exc)}")
        spec = pod.get("spec") or {}
        security = spec.get("securityContext") or {}
        group = security.get("fsGroup")
        return PodFacts(
            runtime_class=spec.get("runtimeClassName") or "",
            fs_group=str(group) if group is not None else "",
            fs_group_change_policy=security.get("fsGroupChangePolicy") or "",
        )

    async def pod(self, namespace: str, name: str) -> PodFacts:
        return await asyncio.to_thread(self._read, namespace, name)
