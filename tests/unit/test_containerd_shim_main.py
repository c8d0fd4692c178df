"""The shim's runtime options, read without the protobuf library
(crust.containerd_shim.main).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_shim_reads_the_runtime_options_as_protobuf_does(tmp_path):
    """`start` decodes containerd's runtime options (an Any around Options)
    without the protobuf library: the same fields as protobuf's parser,
    unknown fields of every wire type skipped, a broken message refused."""
    from google.protobuf import any_pb2

    from crust.api import containerd_runtimeoptions_pb2 as runtimeoptions
    from crust.containerd_shim.bootstrap import message_strings
    from crust.containerd_shim.options import handler_endpoint

    settings = tmp_path / "shim.toml"
    settings.write_text('handler_endpoint = "unix:///run/elsewhere.sock"\n')
    inner = runtimeoptions.Options(type_url="x", config_path=str(settings)).SerializeToString()
    wrapped = any_pb2.Any(type_url="runtimeoptions.v1.Options", value=inner).SerializeToString()
    assert message_strings(wrapped) == {1: b"runtimeoptions.v1.Options", 2: inner}
    assert message_strings(inner) == {1: b"x", 2: str(settings).encode()}
    assert handler_endpoint(wrapped) == "unix:///run/elsewhere.sock"
    # Fields protobuf would skip (a varint, a fixed64, a fixed32 of numbers
    # it does not know) and a string given twice (the last one counts).
    unknown = bytes([0x18, 0x96, 0x01, 0x21, *b"\0" * 8, 0x2D, *b"\0" * 4])
    twice = runtimeoptions.Options(config_path="/first").SerializeToString() + inner
    parsed = runtimeoptions.Options()
    parsed.ParseFromString(unknown + twice)
    assert message_strings(unknown + twice)[2].decode() == parsed.config_path == str(settings)
    long_value = "a" * 300   # a two-byte length
    assert message_strings(runtimeoptions.Options(config_path=long_value).SerializeToString()) == \
        {2: long_value.encode()}
    for broken in (b"\x12\x05ab", b"\x12", b"\x80", b"\x0b", b"\x00\x01", b"\x21\x00"):
        with pytest.raises(ValueError):
            message_strings(broken)
    # Options of another type, or none: the environment's endpoint, then the default.
    other = any_pb2.Any(type_url="other.Options", value=inner).SerializeToString()
    assert handler_endpoint(other) == handler_endpoint(b"") == handler_endpoint(b"\x12\x05ab")


def test_the_shim_daemon_imports_no_grpc_and_sends_input_in_the_handlers_field_size():
    """What `serve` imports (the task service, its handler client, events,
    logs) leaves grpc out: the shim lives as long as its pod, and grpc
    would be a third of its memory. Its stdin pieces are what the handler
    takes in one bytes field."""
    code = ("import sys\n"
            "import crust.containerd_shim.main, crust.containerd_shim.pods, crust.containerd_shim.events\n"
            "import crust.common.logs, crust.sys.memory, crust.sys.openfiles\n"
            "print(sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
    from crust.common.limits import MAX_STRING
    from crust.containerd_shim.process import INPUT_CHUNK

    assert INPUT_CHUNK == MAX_STRING


def test_which_pods_share_a_shim(tmp_path, monkeypatch):
    """`shim_group` in the runtime options' file, else $CRUST_SHIM_GROUP,
    else one shim for the node's pods; another value is refused naming the setting. A
    shim per pod is the pod's (the sandbox id of CRI's annotation); a
    shared one is the handler's: two handlers' pods never share one."""
    import json

    from crust.containerd_shim.main import group_of
    from crust.containerd_shim.options import ENV_SHIM_GROUP, NODE, POD, shim_group

    monkeypatch.delenv(ENV_SHIM_GROUP, raising=False)
    assert shim_group({}) == NODE
    monkeypatch.setenv(ENV_SHIM_GROUP, "pod")
    assert shim_group({}) == POD and shim_group({"shim_group": "node"}) == NODE
    with pytest.raises(ValueError, match=r"^shim_group: 'cluster' is not one of node, pod$"):
        shim_group({"shim_group": "cluster"})
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"annotations": {
        "io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-id": "pod-a"}}))
    assert group_of(bundle, "c-1") == "pod-a"
    assert group_of(tmp_path, "c-2") == "c-2"   # no config: a pod of its own
    assert group_of(bundle, "c-1", shared=True, endpoint="unix:///a.sock") == \
        group_of(tmp_path, "c-2", shared=True, endpoint="unix:///a.sock") != \
        group_of(bundle, "c-1", shared=True, endpoint="unix:///b.sock")
