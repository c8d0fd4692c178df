"""containerd-shim-crust-v2: containerd's runtime `io.containerd.crust.v2`,
crust's microVM handler (`crust kata handler`) as a containerd shim v2.

containerd runs it with its working directory in the container's bundle:

  containerd-shim-crust-v2 -namespace NS -address SOCK -publish-binary BIN -id ID [-debug] start
      prints the ttrpc address of the shim serving ID's pod (containerd 2.3+,
      which sends BootstrapParams: a BootstrapResult holding it) and writes
      it to the bundle's `address` file; starts that shim (a daemon) unless
      it already answers. Every container of a pod goes to one shim: the pod
      is the sandbox id the CRI runtime's annotation names
      (crust.common.cri_annotations: containerd's or CRI-O's). A shim serves
      that pod alone, or every pod of the namespace and handler
      (`shim_group = "node"`: crust.containerd_shim.pods).
  containerd-shim-crust-v2 -namespace NS -address SOCK -id ID -bundle DIR delete
      cleans up after a shim that died: the container (or the pod) is
      deleted in the handler (at the endpoint `start` recorded in the
      bundle), the root file system unmounted, the dead shim's socket
      removed; prints a DeleteResponse.
  containerd-shim-crust-v2 -info
      prints a RuntimeInfo (containerd 2.2+ asks before creating a task).

Settings (`start` reads containerd's standard input, in either form:
crust.containerd_shim.bootstrap):
  which pods share a shim: `shim_group` ("node", the default, or "pod") in
  the runtime's `ConfigPath` file, else $CRUST_SHIM_GROUP.
  the handler's socket: `handler_endpoint` in the TOML file named by the
  runtime's `ConfigPath` option in containerd's configuration (CRI-O: the
  handler's `runtime_config_path`), else $CRUST_KATA_HANDLER_ENDPOINT (in
  containerd's or CRI-O's own environment, which their shims inherit), else
  unix:///run/crust/kata-handler.sock (the handler's default).
  containerd's event socket: BootstrapParams' ttrpc address, else
  $TTRPC_ADDRESS (containerd sets it; CRI-O sets it empty and publishes
  nothing: it waits on each task with Wait).
  the shim's socket directory: BootstrapParams' socket_dir, else
  /run/containerd/s; debug logs: `-debug`, or a debug log level.
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
from crust.containerd_shim.bootstrap import bootstrap_result, read_start_input, runtime_info
from crust.containerd_shim.options import (NODE, SOCKET_DIR, configured_settings, handler_endpoint,
                                           keep_endpoint, kept_endpoint, shim_group)

# containerd runs `start` for every container of a pod, in the path of
# StartContainer (and of RunPodSandbox): this module imports only what
# `start` needs. asyncio, logging, protobuf and the ttrpc server (most of
# a start's time, were they imported here) are the daemon's and
# `delete`'s, imported there.

SHIM_MODULE = "crust.containerd_shim"
# In each bundle whose `start` was given a socket directory of containerd's
# other than SOCKET_DIR: that directory (for `delete`).
SOCKET_DIR_FILE = "crust-socket-dir"
# containerd writes a few hundred bytes; more is not containerd.
MAX_STDIN_BYTES = 1 << 20


def socket_path(containerd_address: str, namespace: str, group: str, directory: Path = SOCKET_DIR) -> Path:
    digest = hashlib.sha256(f"crust\0{containerd_address}\0{namespace}\0{group}".encode()).hexdigest()
    return directory / digest


def group_of(bundle: Path, container_id: str, shared: bool = False, endpoint: str = "") -> str:
    """The group whose shim serves this container: for a shim per pod, the
    pod, i.e. the sandbox id the CRI runtime's annotation names (the
    sandbox's own id for the sandbox), else the container itself; for a
    shared shim, its handler's (two handlers' pods never share a shim)."""
    if shared:
        return f"{NODE}\0{endpoint}"
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return container_id
    return cri_annotations.sandbox_id(spec) or container_id


def read_stdin() -> bytes:
    """What containerd wrote to our standard input (crust.containerd_shim.bootstrap)."""
    try:
        if sys.stdin is None or sys.stdin.isatty():
            return b""
        return sys.stdin.buffer.read(MAX_STDIN_BYTES)
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
    parser.add_argument("-socket", default="", help=argparse.SUPPRESS)  # serve: the shim's socket
    parser.add_argument("-shared", action="store_true", help=argparse.SUPPRESS)  # serve: the node's pods
    parser.add_argument("-handler-endpoint", dest="handler_endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("-log", default="", help=argparse.SUPPRESS)
    parser.add_argument("action", choices=["start", "delete", "serve"], help="what containerd asks")
    args, _unknown = parser.parse_known_args(argv)
    return args


# -- start ---------------------------------------------------------------------------


def start(args: argparse.Namespace) -> int:
    bundle = Path.cwd()
    # containerd hands the runtime's options to every `start` (never to
    # `delete`), alone (1.6 to 2.2) or in its BootstrapParams (2.3+).
    given = read_start_input(read_stdin(), args.id, args.namespace)
    settings = configured_settings(given.options)
    endpoint = handler_endpoint(settings=settings)
    try:
        shared = shim_group(settings) == NODE
    except ValueError as exc:
        print(f"crust shim start {args.id}: {exc}", file=sys.stderr)
        return 1
    group = group_of(bundle, args.id, shared, endpoint)
    directory = Path(given.socket_dir) if given.socket_dir.startswith("/") else SOCKET_DIR
    path = socket_path(args.address, args.namespace, group, directory)
    address = f"unix://{path}"
    from crust.sys.sockets import listen_backlog, socket_alive

    directory.mkdir(parents=True, exist_ok=True, mode=0o711)
    # Two `start`s of one shim at once must not both bind (the second would
    # unlink the first's socket): the check and the bind hold a lock on the
    # directory, released when this process exits. A shared shim ends only
    # under this lock, once containerd asked it something after the last
    # `start` touched its socket, or that touch is old (crust.containerd_shim.pods).
    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(lock, fcntl.LOCK_EX)
    # The endpoint the options name is kept in the bundle for `delete`, and
    # so is a socket directory of containerd's own choosing.
    keep_endpoint(bundle, endpoint)
    if directory != SOCKET_DIR:
        (bundle / SOCKET_DIR_FILE).write_text(str(directory))
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
                   "-id", NODE if shared else group, *(["-shared"] if shared else []), "-socket", str(path),
                   "-handler-endpoint", endpoint, "-log", str(bundle / "log"),
                   *(["-debug"] if args.debug or given.debug else []), "serve"]
        env = {**os.environ, "CRUST_SHIM_LISTEN_FD": str(listener.fileno())}
        if given.ttrpc_address:
            env["TTRPC_ADDRESS"] = given.ttrpc_address  # where events go
        import subprocess

        subprocess.Popen(command, cwd="/", env=env, pass_fds=[listener.fileno()], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        listener.close()
    else:
        os.utime(path)  # this start's: a shared shim stays for the containerd it answers
    (bundle / "address").write_text(address)
    if given.bootstrap:
        sys.stdout.buffer.write(bootstrap_result(address))
    else:
        sys.stdout.write(address)
    sys.stdout.flush()
    return 0


# -- delete --------------------------------------------------------------------------


def delete(args: argparse.Namespace) -> int:
    """After a dead shim: the handler forgets the container (or pod), the
    rootfs is unmounted, and containerd gets the exit it could not hear."""
    import signal
    import time

    import asyncio

    from google.protobuf import timestamp_pb2

    from crust.api import containerd_task_pb2 as task_pb
    from crust.api import handler_pb2
    from crust.common import ttrpc
    from crust.containerd_shim.handler_client import HandlerClient
    from crust.sys import mount as sysmount

    bundle = Path(args.bundle) if args.bundle else Path.cwd()
    try:
        spec = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        spec = {}
    sandbox = cri_annotations.container_type(spec) == cri_annotations.SANDBOX
    endpoint = kept_endpoint(bundle)

    async def forget() -> None:
        pods = HandlerClient(endpoint)
        try:
            if sandbox:
                await pods.call("DeletePod", handler_pb2.DeletePodRequest(sandbox_id=args.id), timeout=120)
            else:
                await pods.call("DeleteContainer", handler_pb2.DeleteContainerRequest(container_id=args.id),
                                timeout=120)
        finally:
            await pods.close()

    try:
        asyncio.run(forget())
    except ttrpc.TtrpcError as exc:
        if exc.code != ttrpc.NOT_FOUND:
            print(f"crust shim delete {args.id}: the handler at {endpoint}: {exc.message}", file=sys.stderr)
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
    try:
        directory = Path((bundle / SOCKET_DIR_FILE).read_text().strip() or SOCKET_DIR)
    except FileNotFoundError:
        directory = SOCKET_DIR
    if path.parent != directory or not path.is_socket():
        return False
    lock = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return remove_if_dead(str(path))
    finally:
        os.close(lock)


# -- serve (the daemon) -----------------------------------------------------------------


def serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from crust.common import logs
    from crust.containerd_shim.pods import ShimLog

    shim_log = ShimLog()
    if args.log:
        shim_log.follow(os.path.dirname(args.log))
    logs.setup("debug" if args.debug else "info")
    log = logging.getLogger("crust.containerd_shim")
    from crust.sys.memory import give_back_large_buffers
    from crust.sys.openfiles import raise_soft_limit

    give_back_large_buffers()  # a 4 MiB request's buffers leave the RSS when freed (crust.sys.memory)
    raise_soft_limit()  # a descriptor per connection (crust.sys.openfiles)
    from crust.api import containerd_task_pb2
    from crust.common.ttrpc_server import Server
    from crust.containerd_shim.events import Publisher
    from crust.containerd_shim.pods import ShimPods

    listen_fd = int(os.environ.pop("CRUST_SHIM_LISTEN_FD", "-1"))

    async def main() -> None:
        done = asyncio.Event()
        publisher = Publisher(os.environ.get("TTRPC_ADDRESS", ""), args.namespace)
        service = ShimPods(args.handler_endpoint or handler_endpoint(), publisher, socket_path=args.socket,
                           shared=args.shared, on_empty=done.set, shim_log=shim_log)
        server = Server()
        server.register_service(containerd_task_pb2.DESCRIPTOR.services_by_name["Task"], service)
        if listen_fd >= 0:
            await server.serve_socket(socket.socket(fileno=listen_fd))
        else:
            await server.serve_path(args.socket)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, done.set)
        loop.add_signal_handler(signal.SIGINT, done.set)
        log.info("shim serving", extra={"fields": {"pods": args.id, "socket": args.socket,
                                                   "handler": service.handler_endpoint}})
        await done.wait()
        await asyncio.sleep(0.05)  # Shutdown's answer leaves first
        await publisher.drain(5.0)
        await service.release_socket()   # a shared shim's, under start's lock, while it still listens
        await server.close()
        await service.close()
        await publisher.close()
        if not args.shared:
            Path(args.socket).unlink(missing_ok=True)
        log.info("shim exits", extra={"fields": {"pods": args.id}})

    asyncio.run(main())
    return 0


INFO_FLAGS = ("-info", "--info", "-info=true", "--info=true")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in INFO_FLAGS for a in argv):
        # containerd 2.2+: a flag, not an action, with nothing else given.
        sys.stdout.buffer.write(runtime_info(read_stdin()))
        sys.stdout.flush()
        return 0
    args = parse(argv)
    if args.action == "start":
        return start(args)
    if args.action == "delete":
        return delete(args)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
