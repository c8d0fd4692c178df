"""The proxy's read of a pod over HTTPS, as a real API server serves it:
a certificate authority to verify, a bearer token (rotated in its file) or
a client certificate, from the policy or from a kubeconfig; refusals name
what is wrong."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import yaml

from crust.proxy.config import KubernetesAccess
from crust.proxy.kube import PodFacts, PodLookup, PodLookupError
from tests.harness.kube_api import KubeAPI, pki, serving  # noqa: F401 - pki: a fixture

TOKEN = "token-one"


@pytest.fixture
def api(pki):  # noqa: F811
    servers = []

    def start(**kw) -> KubeAPI:
        server = KubeAPI(**kw).start()
        server.add("team", "vm", "kata", fs_group=2000, change_policy="OnRootMismatch")
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def kubeconfig(path: Path, server: str, cluster: dict, user: dict) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "here",
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "here", "context": {"cluster": "c", "user": "u"}}],
    }))
    return path


WANTED = PodFacts(runtime_class="kata", fs_group="2000", fs_group_change_policy="OnRootMismatch")


def test_api_server_token_file_and_ca_from_the_policy(api, pki, tmp_path):  # noqa: F811
    server = api(tls=serving(pki), token=TOKEN)
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    lookup = PodLookup(KubernetesAccess(api_server=server.url, token_file=str(token), ca_file=str(pki / "ca.crt")))
    assert lookup._read("team", "vm") == WANTED
    # Kubelet rotates the token: the next request reads the file again.
    server.token = "token-two"
    token.write_text("token-two")
    assert lookup._read("team", "vm") == WANTED
    with pytest.raises(PodLookupError, match="answered 404"):
        lookup._read("team", "nobody")


def test_kubeconfig_with_ca_data_and_a_token(api, pki, tmp_path):  # noqa: F811
    server = api(tls=serving(pki), token=TOKEN)
    ca = base64.b64encode((pki / "ca.crt").read_bytes()).decode()
    path = kubeconfig(tmp_path / "config", server.url, {"certificate-authority-data": ca}, {"token": TOKEN})
    assert PodLookup(KubernetesAccess(kubeconfig=str(path)))._read("team", "vm") == WANTED
    wrong = kubeconfig(tmp_path / "wrong-token", server.url, {"certificate-authority-data": ca}, {"token": "nope"})
    with pytest.raises(PodLookupError, match="answered 401"):
        PodLookup(KubernetesAccess(kubeconfig=str(wrong)))._read("team", "vm")


def test_kubeconfig_with_a_client_certificate_relative_to_it(api, pki, tmp_path):  # noqa: F811
    server = api(tls=serving(pki, client_cert=True))
    for name in ("ca.crt", "client.crt", "client.key"):
        (tmp_path / name).write_bytes((pki / name).read_bytes())
    path = kubeconfig(tmp_path / "config", server.url, {"certificate-authority": "ca.crt"},
                      {"client-certificate": "client.crt", "client-key": "client.key"})
    assert PodLookup(KubernetesAccess(kubeconfig=str(path)))._read("team", "vm") == WANTED
    inline = kubeconfig(tmp_path / "inline", server.url, {"certificate-authority": "ca.crt"},
                        {"client-certificate-data": base64.b64encode((pki / "client.crt").read_bytes()).decode(),
                         "client-key-data": base64.b64encode((pki / "client.key").read_bytes()).decode()})
    assert PodLookup(KubernetesAccess(kubeconfig=str(inline)))._read("team", "vm") == WANTED
    anonymous = kubeconfig(tmp_path / "anonymous", server.url, {"certificate-authority": "ca.crt"}, {})
    with pytest.raises(PodLookupError):
        PodLookup(KubernetesAccess(kubeconfig=str(anonymous)))._read("team", "vm")


def test_refusals_say_what_is_wrong(api, pki, tmp_path):  # noqa: F811
    server = api(tls=serving(pki), token=TOKEN)
    other_ca = kubeconfig(tmp_path / "other-ca", server.url, {"certificate-authority": str(pki / "other.crt")},
                          {"token": TOKEN})
    with pytest.raises(PodLookupError, match="CERTIFICATE_VERIFY_FAILED"):
        PodLookup(KubernetesAccess(kubeconfig=str(other_ca)))._read("team", "vm")
    plugin = kubeconfig(tmp_path / "exec", server.url, {}, {"exec": {"command": "aws"}})
    with pytest.raises(PodLookupError, match="exec or auth-provider plugin"):
        PodLookup(KubernetesAccess(kubeconfig=str(plugin)))._read("team", "vm")
    with pytest.raises(PodLookupError, match="no access to the Kubernetes API"):
        PodLookup(KubernetesAccess(kubeconfig=str(tmp_path / "missing")))._read("team", "vm")
