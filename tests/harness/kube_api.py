"""A stand-in for the Kubernetes API server: GET of a pod, over HTTP or HTTPS.

The proxy's runtime-class rule and `crust` reading a pod's fsGroup look
pods up with the official kubernetes client; KubeAPI answers them from a
table the test fills (its pods, or an HTTP error for one), records every
request path, and can require TLS (a client certificate too) and a bearer
token. It runs in a thread of the test's process on 127.0.0.1.

The fixture pki (module scope) makes a CA, a server certificate for
127.0.0.1 and a client certificate with openssl; serving(pki) is the
server's TLS context. A module that uses pki imports it.
"""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


def pod_json(namespace: str, name: str, runtime_class: str | None, fs_group: int | None = None,
             change_policy: str | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "x"}]}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if fs_group is not None:
        spec["securityContext"] = {"fsGroup": fs_group}
        if change_policy:
            spec["securityContext"]["fsGroupChangePolicy"] = change_policy
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"}, "spec": spec}


def status_json(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class KubeAPI:
    """GET /api/v1/namespaces/<ns>/pods/<name> like the API server: the pod's
    JSON, a 404 Status for an unknown pod, or the HTTP error set for it.
    With tls, HTTPS (tls may require a client certificate); with token, a 401
    for any other bearer token."""

    PATH = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/?]+)$")

    def __init__(self, tls: ssl.SSLContext | None = None, token: str = "") -> None:
        self.tls = tls
        self.token = token
        self.pods: dict[tuple[str, str], dict] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.requests: list[str] = []
        self.server: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"

    def add(self, namespace: str, name: str, runtime_class: str | None, fs_group: int | None = None,
            change_policy: str | None = None) -> None:
        self.pods[(namespace, name)] = pod_json(namespace, name, runtime_class, fs_group, change_policy)

    def start(self) -> "KubeAPI":
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                api.requests.append(self.path)
                if api.token and self.headers.get("Authorization") != f"Bearer {api.token}":
                    return self._answer(401, status_json(401, "Unauthorized", "Unauthorized"))
                match = KubeAPI.PATH.match(self.path.split("?", 1)[0])
                if match is None:
                    return self._answer(404, status_json(404, "NotFound", "the server could not find the resource"))
                key = (match.group(1), match.group(2))
                if key in api.errors:
                    code = api.errors[key]
                    return self._answer(code, status_json(code, "InternalError", "etcdserver: request timed out"))
                if key not in api.pods:
                    return self._answer(404, status_json(404, "NotFound", f'pods "{key[1]}" not found'))
                return self._answer(200, api.pods[key])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)
            self.server = None

    def asked(self, namespace: str, name: str) -> int:
        return self.requests.count(f"/api/v1/namespaces/{namespace}/pods/{name}")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(extension + "\n")
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.crt"))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=other-ca",
            "-keyout", str(d / "other.key"), "-out", str(d / "other.crt"))
    return d


def serving(pki: Path, client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "server.crt", pki / "server.key")
    if client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki / "ca.crt")
    return context
