"""containerd-shim-crust-v2: containerd's runtime `io.containerd.crust.v2`,
crust's microVM handler (`crust kata handler`) as a containerd shim v2.

containerd runs it with its working directory in the container's bundle:

  containerd-shim-crust-v2 -namespace NS -address SOCK -publish-binary BIN -id ID [-debug] start
      prints the ttrpc address of the shim serving ID's pod and writes it to
      the bundle's `address` file; starts that shim (a daemon) unless the
      pod's shim already answers. Every container of a pod goes to one shim:
      the pod is the sandbox id the CRI runtime's annotation names
      (crust.common.cri_annotations: containerd's or CRI-O's).
  containerd-shim-crust-v2 -namespace NS -address SOCK -id ID -bundle DIR delete
      cleans up after a shim that died: the container (or the pod) is
      deleted in the handler (at the endpoint `start` recorded in the
      bundle), the root file system unmounted, the dead shim's socket
      removed; prints a DeleteResponse.

Settings:
  the handler's socket: `handler_endpoint` in the TOML file named by the
  runtime's `ConfigPath` option in containerd's configuration (CRI-O: the
  handler's `runtime_config_path`), else $CRUST_KATA_HANDLER_ENDPOINT (in
  containerd's or CRI-O's own environment, which their shims inherit), else
  unix:///run/crust/kata-handler.sock (the handler's default).
  containerd's event socket: $TTRPC_ADDRESS (containerd sets it; CRI-O sets
  it empty and publishes nothing: it waits on each task with Wait).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import socket
import sys
from pathlib import Path

from crust.common import cri_annotations

# containerd runs `start` for every container of a pod, in the path of
# StartContainer (and of RunPodSandbox): this module imports only what
# `start` needs. asyncio, logging, protobuf and the ttrpc server (most of
# a start's time, were they imported here) are the daemon's and
# `delete`'s, imported there.

DEFAULT_HANDLER_ENDPOINT = "unix:///run/crust/kata-handler.sock"
ENV_HANDLER_ENDPOINT = "CRUST_KATA_HANDLER_ENDPOINT"
# containerd 1.6 keeps its own shims' sockets here; ours share the directory
# with names of their own (a hash with a crust prefix in its input).
SOCKET_DIR = Path("/run/containerd/s")
SHIM_MODULE = "crust.containerd_shim"
# In each bundle: the handler endpoint `start` was given (for `delete`).
ENDPOINT_FILE = "crust-handler-endpoint"


def socket_path(containerd_address: str, namespace: str, group: str) -> Path:
    digest = hashlib.sha256(f"crust\0{containerd_address}\0{namespace}\0{group}".encode()).hexdigest()
    return SOCKET_DIR / digest


def group_of(bundle: Path, container_id: str) -> str:
    """The pod whose shim serves this container: the sandbox id the CRI
    runtime's annotation names (the sandbox's own id for the sandbox), else
    the container itself."""
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return container_id
    return cri_annotations.sandbox_id(spec) or container_id


def handler_endpoint(options: bytes = b"") -> str:
    """The handler's socket: the runtime's ConfigPath file, the environment, the default."""
    return configured_endpoint(options) or os.environ.get(ENV_HANDLER_ENDPOINT) or DEFAULT_HANDLER_ENDPOINT


def configured_endpoint(options: bytes) -> str:
    """`handler_endpoint` of the TOML file the runtime options (a
    google.protobuf.Any of runtimeoptions.v1.Options, serialized) name as
    their ConfigPath; "" when they name none. containerd hands the options
    to `start` on its standard input; CRI-O (its handler's
    runtime_config_path) only in the sandbox's CreateTaskRequest."""
    if not options:
        return ""
    try:
        wrapped = message_strings(options)   # google.protobuf.Any: type_url 1, value 2
        if wrapped.get(1, b"").decode().endswith("runtimeoptions.v1.Options"):
            config_path = message_strings(wrapped.get(2, b"")).get(2, b"").decode()   # Options.config_path
            if config_path:
                import tomllib

                with open(config_path, "rb") as handle:
                    endpoint = tomllib.load(handle).get("handler_endpoint")
                if endpoint:
                    return str(endpoint)
    except Exception as exc:  # a broken option must not hide the default
        print(f"crust shim: runtime options not used: {exc}", file=sys.stderr)
    return ""


def message_strings(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields (strings, bytes, messages) of one
    protobuf message in its wire format, by field number; for a field given
    twice the last, as protobuf's parser keeps for a string. Fields of the
    other wire types are skipped. ValueError for bytes that are no message.
    The runtime options are two strings deep: decoding them here spares
    `start` the protobuf library's import."""
    fields: dict[int, bytes] = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire_type == 0:
            _, at = _varint(data, at)
        elif wire_type == 1:
            at += 8
        elif wire_type == 5:
            at += 4
        elif wire_type == 2:
            size, at = _varint(data, at)
            fields[number] = data[at:at + size]
            at += size
        else:
            raise ValueError(f"field {number}: wire type {wire_type} is not supported")
        if at > len(data):
            raise ValueError(f"field {number} runs past the message's end")
    return fields


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ValueError("a varint runs past the message's end")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def read_options() -> bytes:
    """containerd writes the runtime's options to `start`'s standard input."""
    try:
        if sys.stdin is None or sys.stdin.isatty():
            return b""
        return sys.stdin.buffer.read()
    except (OSError, ValueError):
        return b""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="containerd-shim-crust-v2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-namespace", default="default", help="containerd's namespace")
    parser.add_argument("-address", default="", help="containerd's gRPC socket")
    parser.add_argument("-publish-binary", dest="publish_binary", default="", help="containerd's binary (unused)")
    parser.add_argument("-id", default="", help="the container (task) id")
    parser.add_argument("-bundle", default="", help="the bundle (delete); else the working directory")
    parser.add_argument("-debug", action="store_true", help="debug logging")
    parser.add_argument("-socket", default="", help=argparse.SUPPRESS)  # serve: the pod's socket
    parser.add_argument("-handler-endpoint", dest="handler_endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("-log", default="", help=argparse.SUPPRESS)
    parser.add_argument("action", choices=["start", "delete", "serve"], help="what containerd asks")
    args, _unknown = parser.parse_known_args(argv)
    return args


# -- start ---------------------------------------------------------------------------


def start(args: argparse.Namespace) -> int:
    bundle = Path.cwd()
    group = group_of(bundle, args.id)
    path = socket_path(args.address, args.namespace, group)
    address = f"unix://{path}"
    from crust.sys.sockets import listen_backlog, socket_alive

    SOCKET_DIR.mkdir(parents=True, exist_ok=True, mode=0o711)
    # Two `start`s of one pod at once must not both bind (the second would
    # unlink the first's socket): the check and the bind hold a lock on the
    # directory, released when this process exits.
    lock = os.open(SOCKET_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    # containerd hands the runtime's options to every `start` (never to
    # `delete`): the endpoint they name is kept in the bundle for `delete`.
    endpoint = handler_endpoint(read_options())
    (bundle / ENDPOINT_FILE).write_text(endpoint)
    if not socket_alive(str(path)):
        path.unlink(missing_ok=True)  # a dead shim's
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, 0o600)
        listener.listen(listen_backlog())
        # The daemon serves on the socket bound here, so the address printed
        # answers as soon as containerd connects. Its output goes to the
        # bundle's `log` fifo (containerd copies it to its own log), never to
        # ours: containerd reads our output to its end.
        command = [sys.executable, "-m", SHIM_MODULE, "-namespace", args.namespace, "-address", args.address,
                   "-id", group, "-socket", str(path), "-handler-endpoint", endpoint,
                   "-log", str(bundle / "log"), *(["-debug"] if args.debug else []), "serve"]
        env = {**os.environ, "CRUST_SHIM_LISTEN_FD": str(listener.fileno())}
        import subprocess

        subprocess.Popen(command, cwd="/", env=env, pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        listener.close()
    (bundle / "address").write_text(address)
    sys.stdout.write(address)
    sys.stdout.flush()
    return 0


# -- delete --------------------------------------------------------------------------


def delete(args: argparse.Namespace) -> int:
    """After a dead shim: the handler forgets the container (or pod), the
    rootfs is unmounted, and containerd gets the exit it could not hear."""
    import signal
    import time

    import grpc
    from google.protobuf import timestamp_pb2

    from crust.api import containerd_task_pb2 as task_pb
    from crust.api import handler_pb2, handler_pb2_grpc
    from crust.common.channel import local_channel
    from crust.sys import mount as sysmount

    bundle = Path(args.bundle) if args.bundle else Path.cwd()
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        spec = {}
    sandbox = cri_annotations.container_type(spec) == cri_annotations.SANDBOX
    try:
        endpoint = (bundle / ENDPOINT_FILE).read_text().strip() or handler_endpoint()
    except OSError:
        endpoint = handler_endpoint()
    try:
        with local_channel(endpoint) as channel:
            pods = handler_pb2_grpc.PodRuntimeStub(channel)
            if sandbox:
                pods.DeletePod(handler_pb2.DeletePodRequest(sandbox_id=args.id), timeout=120)
            else:
                pods.DeleteContainer(handler_pb2.DeleteContainerRequest(container_id=args.id), timeout=120)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            print(f"crust shim delete {args.id}: the handler at {endpoint}: {exc.details()}", file=sys.stderr)
    try:
        sysmount.unmount_all(str(bundle / "rootfs"))
    except OSError as exc:
        print(f"crust shim delete {args.id}: {exc}", file=sys.stderr)
    try:
        remove_dead_socket(bundle)
    except OSError as exc:
        print(f"crust shim delete {args.id}: the dead shim's socket: {exc}", file=sys.stderr)
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    sys.stdout.buffer.write(task_pb.DeleteResponse(exit_status=128 + signal.SIGKILL, exited_at=stamp)
                            .SerializeToString())
    sys.stdout.flush()
    return 0


def remove_dead_socket(bundle: Path) -> bool:
    """The socket of the bundle's pod shim (its `address`) removed once
    nobody accepts on it: a shim that was killed leaves it in containerd's
    socket directory. Only a socket of that directory, checked and removed
    under the lock `start` binds under, so a shim that starts meanwhile for
    the same pod keeps its own. Returns whether one was removed."""
    from crust.sys.sockets import remove_if_dead

    try:
        address = (bundle / "address").read_text().strip()
    except OSError:
        return False
    if not address.startswith("unix://"):
        return False
    path = Path(address[len("unix://"):])
    if path.parent != SOCKET_DIR or not path.is_socket():
        return False
    lock = os.open(SOCKET_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return remove_if_dead(str(path))
    finally:
        os.close(lock)


# -- serve (the daemon) -----------------------------------------------------------------


def _log_to(path: str, debug: bool) -> None:
    from crust.common import logs

    try:
        # containerd holds the fifo's read end while it runs; opened for
        # reading too, the open never blocks and a restart loses no line.
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC) if path else None
    except OSError:
        fd = None
    if fd is not None:
        os.dup2(fd, 2)
        os.close(fd)
    logs.setup("debug" if debug else "info")


def serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    log = logging.getLogger("crust.containerd_shim")
    _log_to(args.log, args.debug)
    from crust.sys.memory import give_back_large_buffers
    from crust.sys.openfiles import raise_soft_limit

    give_back_large_buffers()  # a 4 MiB request's buffers leave the RSS when freed (crust.sys.memory)
    raise_soft_limit()  # a descriptor per connection (crust.sys.openfiles)
    from crust.api import containerd_task_pb2
    from crust.containerd_shim.events import Publisher
    from crust.containerd_shim.task import TaskService
    from crust.common.ttrpc import Server

    listen_fd = int(os.environ.pop("CRUST_SHIM_LISTEN_FD", "-1"))

    async def main() -> None:
        done = asyncio.Event()
        publisher = Publisher(os.environ.get("TTRPC_ADDRESS", ""), args.namespace)
        service = TaskService(args.handler_endpoint or handler_endpoint(), publisher, on_empty=done.set)
        server = Server()
        server.register_service(containerd_task_pb2.DESCRIPTOR.services_by_name["Task"], service)
        if listen_fd >= 0:
            await server.serve_socket(socket.socket(fileno=listen_fd))
        else:
            await server.serve_path(args.socket)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        loop.add_signal_handler(signal.SIGINT, done.set)
        log.info("shim serving", extra={"fields": {"pod": args.id, "socket": args.socket,
                                                   "handler": service.handler_endpoint}})
        await done.wait()
        await asyncio.sleep(0.05)  # Shutdown's answer leaves first
        await publisher.drain(5.0)
        await server.close()
        await service.close()
        await publisher.close()
        Path(args.socket).unlink(missing_ok=True)
        log.info("shim exits", extra={"fields": {"pod": args.id}})

    asyncio.run(main())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.action == "start":
        return start(args)
    if args.action == "delete":
        return delete(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
