"""Which microVM handler a shim talks to and which pods share a shim
process, from what containerd or CRI-O gives it: the runtime's options (a
google.protobuf.Any of runtimeoptions.v1.Options) name a TOML file whose
`handler_endpoint` is the handler's socket (without one,
$CRUST_KATA_HANDLER_ENDPOINT, else the handler's default socket) and whose
`shim_group` says `node` or `pod` (else $CRUST_SHIM_GROUP, else `node`).
`start` keeps the endpoint it used in the bundle (ENDPOINT_FILE), so
`delete` after a dead shim reaches the same handler.
Where the shims' sockets are: containerd 2.3's BootstrapParams name the
directory, older containerd none (SOCKET_DIR).

`start` is on the path of every container start: this module imports only
the standard library and the shim's own wire-format reader.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from crust.containerd_shim.bootstrap import OPTIONS_TYPE, message_strings

DEFAULT_HANDLER_ENDPOINT = "unix:///run/crust/kata-handler.sock"
ENV_HANDLER_ENDPOINT = "CRUST_KATA_HANDLER_ENDPOINT"
ENV_SHIM_GROUP = "CRUST_SHIM_GROUP"
# One shim process for the node's pods (of one containerd namespace and one
# handler), or one per pod.
NODE, POD = "node", "pod"
SHIM_GROUPS = (NODE, POD)
# containerd 1.6 keeps its own shims' sockets here; ours share the directory
# with names of their own (a hash with a crust prefix in its input).
SOCKET_DIR = Path("/run/containerd/s")
# In each bundle: the handler endpoint `start` was given (for `delete`).
ENDPOINT_FILE = "crust-handler-endpoint"


def configured_settings(options: bytes) -> dict:
    """The TOML table of the file the runtime options (a
    google.protobuf.Any of runtimeoptions.v1.Options, serialized) name as
    their ConfigPath; {} when they name none. containerd hands the options
    to `start` (crust.containerd_shim.bootstrap.read_start_input); CRI-O
    (its handler's runtime_config_path) only in the sandbox's
    CreateTaskRequest."""
    if not options:
        return {}
    try:
        wrapped = message_strings(options)   # google.protobuf.Any: type_url 1, value 2
        if wrapped.get(1, b"").decode().endswith(OPTIONS_TYPE):
            config_path = message_strings(wrapped.get(2, b"")).get(2, b"").decode()   # Options.config_path
            if config_path:
                import tomllib

                with open(config_path, "rb") as handle:
                    return tomllib.load(handle)
    except Exception as exc:  # a broken option must not hide the default
        print(f"crust shim: runtime options not used: {exc}", file=sys.stderr)
    return {}


def configured_endpoint(options: bytes) -> str:
    """`handler_endpoint` of the runtime options' file; "" for none."""
    return str(configured_settings(options).get("handler_endpoint") or "")


def handler_endpoint(options: bytes = b"", settings: dict | None = None) -> str:
    """The handler's socket: the runtime's ConfigPath file, the environment, the default."""
    settings = configured_settings(options) if settings is None else settings
    return str(settings.get("handler_endpoint") or "") or os.environ.get(ENV_HANDLER_ENDPOINT) or \
        DEFAULT_HANDLER_ENDPOINT


def shim_group(settings: dict) -> str:
    """Which pods share a shim process: NODE (every pod of a containerd
    namespace and handler) or POD (each its own); `shim_group` in the
    runtime options' file, else $CRUST_SHIM_GROUP, else NODE. ValueError
    for another value."""
    value = settings.get("shim_group") or os.environ.get(ENV_SHIM_GROUP) or NODE
    if value not in SHIM_GROUPS:
        raise ValueError(f"shim_group: {value!r} is not one of {', '.join(SHIM_GROUPS)}")
    return value


def keep_endpoint(bundle: Path, endpoint: str) -> None:
    """The endpoint used for the bundle's container, kept for `delete`."""
    (bundle / ENDPOINT_FILE).write_text(endpoint)


def kept_endpoint(bundle: Path) -> str:
    """The endpoint `start` (or the sandbox's Create) kept in the bundle,
    else the one the environment or the default names."""
    try:
        return (bundle / ENDPOINT_FILE).read_text().strip() or handler_endpoint()
    except OSError:
        return handler_endpoint()
