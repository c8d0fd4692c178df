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
  with write_bundle below), the front end runs runc and reports the
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

from crust.common import cri_annotations
from crust.oci_runtime.client import RuntimeFailure

CSI_SOURCE_MARK = "/kubernetes.io~csi/"
ORIGINAL_CONFIG = "config.crust-original.json"
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


# -- runc's log, where the shim looks for the reason of a failure --------------------------------


def log_line(flags: dict[str, str], level: str, message: str) -> None:
    """A line in runc's log (--log), in its format; the shim reports the
    last error line as the reason create failed."""
    path = flags.get("--log")
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1e9):09d}Z"
    if flags.get("--log-format") == "json":
        line = json.dumps({"level": level, "msg": message, "time": stamp})
    else:
        line = f'time="{stamp}" level={level} msg={json.dumps(message)}'
    if path:
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
            return
        except OSError:
            pass
    print(line, file=sys.stderr)


# -- the bundle ------------------------------------------------------------------------------------


def deferred_candidates(spec: dict) -> list[dict]:
    """Bind mounts whose source lies below a kubelet CSI volume, by its text
    or by its real path (a symbolic link on the way: the handler refuses a
    link that leads to a deferred volume, which runc would follow)."""
    found = []
    for mount in spec.get("mounts") or []:
        options = mount.get("options") or []
        source = mount.get("source") or ""
        is_bind = mount.get("type") == "bind" or "bind" in options or "rbind" in options
        if is_bind and source.startswith("/") and (CSI_SOURCE_MARK in source
                                                   or CSI_SOURCE_MARK in os.path.realpath(source) + "/"):
            found.append(mount)
    return found


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), "a number")


def check_spec(spec, path: str) -> dict:
    """What this runtime reads of config.json, in the shape it reads it (runc
    checks the rest): an object; `mounts` a list of objects whose
    destination, type and source are strings and whose options a list of
    strings; `annotations` an object of strings. RuntimeFailure names the
    field otherwise."""
    if not isinstance(spec, dict):
        raise RuntimeFailure(f"{path}: config.json must hold a JSON object (an OCI runtime spec), "
                             f"not {_json_kind(spec)}")
    mounts = spec.get("mounts")
    if mounts is not None and not isinstance(mounts, list):
        raise RuntimeFailure(f"{path}: mounts must be a list of objects, not {_json_kind(mounts)}")
    for i, mount in enumerate(mounts or []):
        if not isinstance(mount, dict):
            raise RuntimeFailure(f"{path}: mounts[{i}] must be an object, not {_json_kind(mount)}")
        for key in ("destination", "type", "source"):
            if mount.get(key) is not None and not isinstance(mount[key], str):
                raise RuntimeFailure(f"{path}: mounts[{i}].{key} must be a string, not {_json_kind(mount[key])}")
        options = mount.get("options")
        if options is not None and not (isinstance(options, list) and all(isinstance(o, str) for o in options)):
            raise RuntimeFailure(f"{path}: mounts[{i}].options must be a list of strings")
    annotations = spec.get("annotations")
    if annotations is not None and not (isinstance(annotations, dict)
                                        and all(isinstance(v, str) for v in annotations.values())):
        raise RuntimeFailure(f"{path}: annotations must be an object of strings")
    return spec


def load_spec(bundle: str) -> dict:
    """config.json, or the original kept by an earlier create of this bundle."""
    for name in (ORIGINAL_CONFIG, "config.json"):
        path = os.path.join(bundle, name)
        try:
            with open(path) as f:
                spec = json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            raise RuntimeFailure(f"cannot read {path}: {exc}") from None
        return check_spec(spec, path)
    raise RuntimeFailure(f"{bundle} has no config.json")


def rewrite(spec: dict, deferred) -> dict:
    """The spec with each deferred bind replaced by its device mount, in place
    (same position, same destination)."""
    by_destination = {(m.destination, m.target_path): m for m in deferred}
    mounts = []
    for mount in spec.get("mounts") or []:
        replacement = None
        for (destination, target), described in by_destination.items():
            source = os.path.normpath(mount.get("source") or "")
            if mount.get("destination") == destination and source == target:
                replacement = described
        if replacement is None:
            mounts.append(mount)
        else:
            mounts.append({"destination": replacement.destination, "type": replacement.fs_type,
                           "source": replacement.device, "options": list(replacement.options)})
    updated = dict(spec)
    updated["mounts"] = mounts
    annotations = dict(spec.get("annotations") or {})
    annotations["dev.crust.deferred-volumes"] = json.dumps(
        [{"destination": m.destination, "target": m.target_path, "device": m.device, "fstype": m.fs_type}
         for m in deferred], separators=(",", ":"))
    updated["annotations"] = annotations
    return updated


def sandbox_of(spec: dict, container_id: str) -> str:
    """The pod the container belongs to (the claims' sandbox), from the
    CRI runtime's annotation; the container itself outside any pod."""
    return cri_annotations.sandbox_id(spec) or container_id


def write_bundle(bundle: str, state_dir: str, container_id: str, sandbox_id: str, spec: dict, deferred,
                 flags: dict[str, str]) -> None:
    """What `create` leaves once the handler claimed the deferred binds:
    the marker that `delete` looks for, the original spec kept (once: a
    retried create reads it again), config.json rewritten for runc, and a
    line per deferred mount in runc's log. The crust handler does the same
    for crust-runc (PrepareBundle)."""
    from crust.common.private import make_dirs  # (os and pathlib only: no start-up cost)

    make_dirs(state_dir)  # 0700, its parents too, whatever containerd's umask
    write_file(os.path.join(state_dir, container_id),
               json.dumps({"sandbox_id": sandbox_id, "bundle": bundle}).encode(), 0o600)
    original = os.path.join(bundle, ORIGINAL_CONFIG)
    config = os.path.join(bundle, "config.json")
    mode = os.stat(config).st_mode & 0o777
    if not os.path.exists(original):
        write_file(original, json.dumps(spec).encode(), mode)
    write_file(config, json.dumps(rewrite(spec, deferred)).encode(), mode)
    for m in deferred:
        log_line(flags, "info", f"crust: {m.destination}: {m.fs_type} on {m.device}, the deferred volume "
                                f"{m.target_path}, mounted in the container only")


def write_file(path: str, data: bytes, mode: int) -> None:
    """Replace path atomically (rename). No fsync: a bundle and the markers
    are run-time state (under /run on a node), gone after a reboot anyway."""
    temporary = f"{path}.crust-{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(temporary, path)


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
