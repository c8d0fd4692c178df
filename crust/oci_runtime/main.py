"""`crust-oci-runtime` (also `crust runtime`): an OCI runtime with runc's
command line, for containerd's runc shim (`BinaryName`) and CRI-O
(`runtime_path`).

It is runc, except where a container's deferred volumes are concerned:

- `create` of a bundle whose config.json binds a kubelet CSI target path:
  the light handler (`crust handler`, over its socket) resolves each such
  source to its deferred volume, claims it for the pod and describes it;
  the bind is replaced, at the same destination, by a mount of the
  volume's block device with its file system and options; config.json is
  rewritten (the original is kept beside it as config.crust-original.json);
  runc's log gets a line per deferred mount and one with the time each
  step of `create` took;
  runc creates the container, mounting the device inside the container's
  own mount namespace; then the handler records the container's init
  process and applies the pod's fsGroup, before `start`. Any failure fails
  `create` with a message in runc's log, where the shim reads it, and no
  claim stays behind.
  crust-runc, the front end, does this `create` without this program where
  the handler can: the handler does the part before runc (PrepareBundle,
  with crust.oci_runtime.bundle), the front end runs runc and reports the
  container created. This program does it where the handler cannot.
- `delete`: runc deletes, then the handler releases the container's claims.
- everything else (start, state, kill, exec, ps, events, update, pause,
  resume, features, ...), and `create`/`delete` of containers without a
  deferred volume, is runc itself: this process execs runc with the same
  arguments, before importing anything heavy.

Settings come from the environment (containerd passes its own to the shim
and the shim to the runtime), then from a JSON file, then defaults:
  CRUST_RUNC / "runc"                   the real runc (default: runc on PATH)
  CRUST_HANDLER_ENDPOINT / "handlerEndpoint"
                                        the light handler's socket
                                        (default unix:///run/crust/handler.sock)
  CRUST_OCI_RUNTIME_STATE / "stateDir"  one marker per container with
                                        deferred volumes (default
                                        /run/crust/oci-runtime)
  CRUST_OCI_RUNTIME_CONFIG              the JSON file (default
                                        /etc/crust/oci-runtime.json)
The file is read by hand, not through pydantic: this runs on every runc
call, and each import is paid on each call.
"""

from __future__ import annotations

import json
import os
import sys
import time

from crust.oci_runtime.bundle import deferred_candidates, load_spec, sandbox_of, write_bundle
from crust.oci_runtime.client import RuntimeFailure
from crust.oci_runtime.runc_log import log_line

DEFAULTS = {"runc": "", "handlerEndpoint": "unix:///run/crust/handler.sock", "stateDir": "/run/crust/oci-runtime"}
ENVIRONMENT = {"runc": "CRUST_RUNC", "handlerEndpoint": "CRUST_HANDLER_ENDPOINT", "stateDir": "CRUST_OCI_RUNTIME_STATE"}
CONFIG_FILE = "/etc/crust/oci-runtime.json"
# runc's global flags that take a value; the others are booleans.
GLOBAL_VALUE_FLAGS = {"--log", "--log-format", "--root", "--criu", "--rootless"}
# Flags of create and run that take a value.
CREATE_VALUE_FLAGS = {"--bundle", "-b", "--console-socket", "--pid-file", "--preserve-fds"}
RUNC_ROOT = "/run/runc"


# -- settings and the command line ------------------------------------------------------------


def settings(environ=os.environ) -> dict[str, str]:
    values = dict(DEFAULTS)
    path = environ.get("CRUST_OCI_RUNTIME_CONFIG", CONFIG_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        data = {}
    except (OSError, ValueError) as exc:
        raise RuntimeFailure(f"crust-oci-runtime: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise RuntimeFailure(f"crust-oci-runtime: {path} must hold a JSON object")
    for key, value in data.items():
        if key not in DEFAULTS or not isinstance(value, str):
            raise RuntimeFailure(f"crust-oci-runtime: {path}: unknown key or not a string: {key!r} "
                                 f"(keys: {', '.join(DEFAULTS)})")
        values[key] = value
    for key, variable in ENVIRONMENT.items():
        if environ.get(variable):
            values[key] = environ[variable]
    if not values["runc"]:
        values["runc"] = find_runc()
    return values


def find_runc() -> str:
    """runc on PATH, never this program itself (it may be installed as runc)."""
    me = os.path.realpath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    for directory in os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
        candidate = os.path.join(directory or ".", "runc")
        if os.access(candidate, os.X_OK) and os.path.realpath(candidate) != me:
            return candidate
    raise RuntimeFailure("crust-oci-runtime: no runc on PATH (set CRUST_RUNC, or runc in the settings file)")


def split_command_line(args: list[str]) -> tuple[dict[str, str], str, list[str]]:
    """runc's argv (without argv[0]) -> (global flags, command, the rest)."""
    flags: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name, eq, value = args[i].partition("=")
        if name in GLOBAL_VALUE_FLAGS and not eq:
            i += 1
            value = args[i] if i < len(args) else ""
        flags[name] = value if (eq or name in GLOBAL_VALUE_FLAGS) else "true"
        i += 1
    command = args[i] if i < len(args) else ""
    return flags, command, args[i + 1:]


def command_options(rest: list[str], value_flags: set[str]) -> tuple[dict[str, str], str]:
    """A command's flags and its container id (the first positional)."""
    options: dict[str, str] = {}
    i = 0
    while i < len(rest):
        word = rest[i]
        if word == "--":
            i += 1
            break
        if not word.startswith("-"):
            break
        name, eq, value = word.partition("=")
        if name in value_flags and not eq:
            i += 1
            value = rest[i] if i < len(rest) else ""
        options[name] = value if (eq or name in value_flags) else "true"
        i += 1
    return options, rest[i] if i < len(rest) else ""


def process_age_ms() -> float:
    """How long ago this process started (interpreter and imports
    included), to the clock tick."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, (uptime - ticks / os.sysconf("SC_CLK_TCK")) * 1e3)
    except (OSError, ValueError, IndexError):
        return 0.0


# -- commands ----------------------------------------------------------------------------------------


def exec_runc(runc: str, args: list[str]) -> None:
    os.execv(runc, [runc, *args])


def call_runc(runc: str, args: list[str], quiet: bool = False) -> int:
    """runc with args, its exit code (minus the signal that killed it).
    posix_spawn rather than subprocess, whose import (threading, selectors,
    signal, locale) would cost this short-lived process more than the call;
    descriptors not marked close-on-exec stay open for runc, as with
    subprocess's close_fds=False (the shim's console socket, --preserve-fds)."""
    actions = []
    if quiet:
        actions = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                   (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
    try:
        pid = os.posix_spawn(runc, [runc, *args], os.environ, file_actions=actions)
    except OSError as exc:
        raise RuntimeFailure(f"cannot run {runc}: {exc.strerror or exc}") from None
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        except InterruptedError:
            continue


def create(values: dict[str, str], flags: dict[str, str], args: list[str], rest: list[str]) -> int:
    options, container_id = command_options(rest, CREATE_VALUE_FLAGS)
    bundle = os.path.abspath(options.get("--bundle") or options.get("-b") or os.getcwd())
    spec = load_spec(bundle)
    if not deferred_candidates(spec):
        exec_runc(values["runc"], args)
    if not container_id:
        raise RuntimeFailure("create: no container id")
    from crust.oci_runtime.client import HandlerClient

    startup_ms = process_age_ms()
    began = time.perf_counter()
    sandbox_id = sandbox_of(spec, container_id)
    client = HandlerClient(values["handlerEndpoint"])
    marker = os.path.join(values["stateDir"], container_id)
    try:
        deferred = client.prepare(container_id, sandbox_id, bundle, spec.get("mounts") or [])
        if not deferred:
            client.close()
            exec_runc(values["runc"], args)
        write_bundle(bundle, values["stateDir"], container_id, sandbox_id, spec, deferred, flags)
        prepared = time.perf_counter()
        code = call_runc(values["runc"], args)
        if code != 0:
            client.release(container_id)
            os.unlink(marker)
            return code
        created = time.perf_counter()
        try:
            client.created(container_id, container_pid(values["runc"], flags, options, container_id))
            done = time.perf_counter()
            log_line(flags, "info", f"crust: create took {startup_ms + (done - began) * 1e3:.0f} ms: start and "
                                    f"imports {startup_ms:.0f}, handler prepare {(prepared - began) * 1e3:.0f}, "
                                    f"runc create {(created - prepared) * 1e3:.0f}, handler created "
                                    f"{(done - created) * 1e3:.0f}")
        except BaseException:
            call_runc(values["runc"], [*global_args(flags), "delete", "--force", container_id], quiet=True)
            client.release(container_id)
            os.unlink(marker)
            raise
        return 0
    finally:
        client.close()


def global_args(flags: dict[str, str]) -> list[str]:
    out = []
    for name, value in flags.items():
        out += [name, value] if name in GLOBAL_VALUE_FLAGS else [name]
    return out


def container_pid(runc: str, flags: dict[str, str], options: dict[str, str], container_id: str) -> int:
    """The container's init, from runc's pid file (or `runc state`)."""
    pid_file = options.get("--pid-file")
    if pid_file:
        with open(pid_file) as f:
            return int(f.read().strip())
    import subprocess

    out = subprocess.run([runc, *global_args(flags), "state", container_id], capture_output=True, text=True,
                         check=True).stdout
    return int(json.loads(out)["pid"])


def delete(values: dict[str, str], flags: dict[str, str], args: list[str], rest: list[str]) -> int:
    _, container_id = command_options(rest, set())
    marker = os.path.join(values["stateDir"], container_id) if container_id else ""
    if not marker or not os.path.exists(marker):
        exec_runc(values["runc"], args)
    code = call_runc(values["runc"], args)
    state = os.path.join(flags.get("--root") or RUNC_ROOT, container_id, "state.json")
    if code != 0 and os.path.exists(state):
        return code  # still there (running, without --force): its claims stay
    from crust.oci_runtime.client import HandlerClient

    client = HandlerClient(values["handlerEndpoint"])
    try:
        client.release(container_id)
        os.unlink(marker)
    except RuntimeFailure as exc:
        # The handler's reaper releases the claims once the container's
        # processes are gone; the delete itself succeeded.
        log_line(flags, "warning", f"crust: container {container_id} deleted, its claims not released yet: {exc}")
    finally:
        client.close()
    return code


def run(values, flags, args, rest) -> int:
    options, container_id = command_options(rest, CREATE_VALUE_FLAGS | {"-d", "--detach", "--keep"})
    bundle = os.path.abspath(options.get("--bundle") or options.get("-b") or os.getcwd())
    if deferred_candidates(load_spec(bundle)):
        raise RuntimeFailure("run: a bundle that binds a kubelet CSI volume must be started with create and start "
                             "(its deferred volumes are claimed between the two)")
    exec_runc(values["runc"], args)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    flags, command, rest = split_command_line(args)
    try:
        values = settings()
        if command == "create":
            return create(values, flags, args, rest)
        if command == "delete":
            return delete(values, flags, args, rest)
        if command == "run":
            return run(values, flags, args, rest)
        exec_runc(values["runc"], args)
    except RuntimeFailure as exc:
        log_line(flags, "error", str(exc))
        return 1
    except Exception as exc:  # noqa: BLE001 - the shim reads runc's log, never our stderr
        log_line(flags, "error", f"crust-oci-runtime {command}: unexpected {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
