"""crust.kubelet.containerd's config for each containerd release: the format
it reads natively, the CRI settings where that format keeps them, and the
release read from `containerd --version`."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from crust.kubelet.containerd import Containerd, ContainerdError, config_format, version_of

RUNTIMES = {"runc": "", "crust-runc": "/usr/local/bin/crust-runc"}


def config_for(tmp_path: Path, release: tuple[int, int]) -> dict:
    containerd = Containerd(tmp_path, sandbox_image="localhost/pause:1", runtimes=RUNTIMES,
                            shim_runtimes={"crust": "io.containerd.crust.v2"},
                            shim_options={"crust": {"ConfigPath": "/etc/crust/shim.toml"}})
    containerd._release = release
    return tomllib.loads(containerd.config())


@pytest.mark.parametrize(("release", "form"), [((1, 6), 2), ((1, 7), 2), ((2, 0), 3), ((2, 2), 3), ((2, 3), 4),
                                               ((3, 0), 4)])
def test_each_release_gets_the_format_it_reads(release, form):
    assert config_format(release) == form


def test_containerd_1_keeps_every_cri_setting_in_one_plugin(tmp_path):
    config = config_for(tmp_path, (1, 6))
    assert config["version"] == 2
    assert config["grpc"]["address"] == str(tmp_path / "containerd.sock")
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "localhost/pause:1"
    assert cri["registry"]["config_path"] == str(tmp_path / "certs.d")
    assert cri["cni"]["bin_dir"] == "/usr/lib/cni"
    runtimes = cri["containerd"]["runtimes"]
    assert runtimes["crust-runc"]["options"]["BinaryName"] == RUNTIMES["crust-runc"]
    assert runtimes["crust"] == {"runtime_type": "io.containerd.crust.v2",
                                 "options": {"ConfigPath": "/etc/crust/shim.toml"}}
    assert "sandboxer" not in runtimes["runc"]


@pytest.mark.parametrize(("release", "form"), [((2, 0), 3), ((2, 1), 3), ((2, 3), 4)])
def test_containerd_2_splits_images_runtime_and_streaming(tmp_path, release, form):
    config = config_for(tmp_path, release)
    assert config["version"] == form
    plugins = config["plugins"]
    images, runtime = plugins["io.containerd.cri.v1.images"], plugins["io.containerd.cri.v1.runtime"]
    assert images["pinned_images"]["sandbox"] == "localhost/pause:1"
    assert images["registry"]["config_path"] == str(tmp_path / "certs.d")
    assert runtime["netns_mounts_under_state_dir"] is True
    # bin_dirs from 2.1; 2.0 reads bin_dir alone.
    cni = runtime["cni"]
    assert cni == ({"bin_dir": "/usr/lib/cni"} if release == (2, 0) else {"bin_dirs": ["/usr/lib/cni"]}) | {
        "conf_dir": str(tmp_path / "cni")}
    runtimes = runtime["containerd"]["runtimes"]
    assert {name: r["sandboxer"] for name, r in runtimes.items()} == dict.fromkeys(RUNTIMES | {"crust": ""},
                                                                                  "podsandbox")
    assert runtimes["crust"]["options"] == {"ConfigPath": "/etc/crust/shim.toml"}
    # Our own sockets, never the host's: format 4 reads them from its server
    # plugins alone (a top-level [grpc] left it on /run/containerd's).
    socket = str(tmp_path / "containerd.sock")
    if form == 4:
        assert "grpc" not in config and "ttrpc" not in config
        assert (plugins["io.containerd.server.v1.grpc"], plugins["io.containerd.server.v1.ttrpc"]) == (
            {"address": socket}, {"address": socket + ".ttrpc"})
    else:
        assert (config["grpc"], config["ttrpc"]) == ({"address": socket}, {"address": socket + ".ttrpc"})
    # Streaming stays with the CRI service; nothing of 1.x's layout is left.
    assert plugins["io.containerd.grpc.v1.cri"] == {"stream_server_address": "127.0.0.1", "stream_server_port": "0"}


def script(directory: Path, printed: str) -> str:
    path = directory / "containerd"
    path.write_text(f"#!/bin/sh\necho '{printed}'\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(("printed", "release"), [
    ("containerd github.com/containerd/containerd/v2 v2.3.4 0123abc", (2, 3)),
    ("containerd containerd.io 1.6.20~ds1 1.6.20~ds1-1+b1", (1, 6)),
    ("containerd github.com/containerd/containerd 1.7.24 88c3d9bc", (1, 7)),
])
def test_the_release_comes_from_containerds_version_line(tmp_path, printed, release):
    assert version_of(script(tmp_path, printed)) == release


def test_a_version_line_without_a_release_is_an_error(tmp_path):
    with pytest.raises(ContainerdError, match="names no release"):
        version_of(script(tmp_path, "containerd dev"))
