"""The `crust` command line: one entry point, a subcommand per component."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from crust import __version__
from crust.common import logs
from crust.common.units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is no whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1")
    return value


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity (default: info)")
    p.add_argument("--log-format", default="json", choices=["json", "text"],
                   help="json: one structured object per line (default); text: for humans")


def _add_metrics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on --metrics-address:PORT (default: off)")
    p.add_argument("--metrics-address", default="127.0.0.1",
                   help="address the metrics are served on (default: 127.0.0.1; 0.0.0.0 in a pod for Prometheus)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crust",
        description="crust: block volumes whose file system is mounted inside the sandbox, not on the host.",
    )
    parser.add_argument("--version", action="version", version=f"crust {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser(
        "driver",
        help="run the block-volume CSI driver (loop backend)",
        description="Serve the CSI Identity, Controller and Node services of the loop-device "
                    "block-volume driver on a unix socket.",
    )
    d.add_argument("--endpoint", required=True, help="unix:///path/to/csi.sock to serve on")
    d.add_argument("--node-id", required=True, help="this node's id (also its topology segment)")
    d.add_argument("--data-dir", required=True, type=Path,
                   help="state and storage pools (backing files); shared by controller and nodes")
    d.add_argument("--mode", default="all", choices=["all", "controller", "node"],
                   help="controller: never touches devices; node: no controller state; all: both (default)")
    d.add_argument("--backend", default="loop", choices=["loop"], help="storage backend (default: loop)")
    d.add_argument("--capacity", type=_size, default=0,
                   help="size of this node's pool, e.g. 100Gi (default: size of the data dir's file system)")
    d.add_argument("--max-volumes-per-node", type=int, default=64,
                   help="attach limit reported to the CO (default: 64)")
    d.add_argument("--default-fs-type", default="ext4", choices=["ext4", "xfs"],
                   help="file system when a mount capability names none (default: ext4)")
    d.add_argument("--distributed", action="store_true",
                   help="distributed provisioning (mode all): this node's own controller, no attach step "
                        "(attachRequired: false), volumes grow at NodeExpandVolume (the resizer's node-only mode)")
    _add_metrics(d)
    d.add_argument("--advertise-alpha", action="store_true",
                   help="advertise the alpha GET_ID and GET_NODE_INFO capabilities (the RPCs are served anyway)")
    _add_logging(d)

    sh = sub.add_parser(
        "shim",
        help="run the deferral shim in front of any block-capable CSI driver",
        description="Serve CSI in front of BACKEND: volumes asked for as file systems are raw block "
                    "volumes at the backend; NodePublishVolume with defer_fs_ops returns a deferred-mount "
                    "description instead of mounting. Everything else passes through unchanged.",
    )
    sh.add_argument("--endpoint", required=True, help="unix:///path the shim serves CSI on")
    sh.add_argument("--backend-endpoint", required=True, help="unix:///path of the wrapped CSI driver")
    sh.add_argument("--proxy-endpoint", required=True,
                    help="unix:///path of the crust proxy's Runtime API (stats and expansion of deferred volumes)")
    sh.add_argument("--state-dir", required=True, type=Path, help="the shim's records and private mount points")
    sh.add_argument("--default-fs-type", default="ext4", choices=["ext4", "xfs"],
                    help="file system when a mount capability names none (default: ext4)")
    sh.add_argument("--no-advertise-deferral", action="store_true",
                    help="do not advertise DEFER_FS_OPS* (for conformance tools that reject unknown capabilities)")
    sh.add_argument("--max-request-bytes", type=_size, default=1024 * 1024,
                    help="largest request accepted (default: 1Mi)")
    sh.add_argument("--freeze-timeout-seconds", type=int, default=60,
                    help="a snapshot's freeze of a deferred volume ends by itself in its sandbox this long "
                         "after it began, should the thaw not come (1..600, default: 60)")
    _add_metrics(sh)
    _add_logging(sh)

    px = sub.add_parser(
        "proxy",
        help="run the proxy next to kubelet (deferral decisions, watched directory, registry, Runtime API)",
        description="Serve CSI to kubelet in front of PLUGIN (the crust shim), decide deferral, publish "
                    "deferred volumes into the watched directory, and serve the handler registry and the "
                    "Runtime API on the runtime endpoint.",
    )
    px.add_argument("--csi-endpoint", required=True, help="unix:///path kubelet talks to")
    px.add_argument("--plugin-endpoint", required=True, help="unix:///path of the plugin (crust shim)")
    px.add_argument("--runtime-endpoint", required=True,
                    help="unix:///path for the Runtime API and the handler registry (its directory must be 0700)")
    px.add_argument("--volumes-dir", required=True, type=Path,
                    help="the watched directory: <sha256(target)>/mountInfo.json per deferred volume")
    px.add_argument("--state-dir", required=True, type=Path, help="the proxy's records (persistent storage)")
    px.add_argument("--kata-dir", type=Path, help="also mirror entries in Kata's direct-volume layout here")
    px.add_argument("--kubelet-root", type=Path, default=Path("/var/lib/kubelet"),
                    help="target paths must lie below it (default: /var/lib/kubelet)")
    px.add_argument("--policy", type=Path, help="deferral policy file (YAML or JSON)")
    px.add_argument("--runtime-socket-group", type=int,
                    help="numeric group allowed on the runtime socket (0660) instead of root only (0600); "
                         "callers whose effective gid it is may call")
    px.add_argument("--runtime-allowed-uid", type=int, action="append", dest="runtime_allowed_uids",
                    help="a uid allowed to call the registry and the Runtime API, as the kernel names the "
                         "caller (repeatable; default: 0 only); others get PERMISSION_DENIED")
    px.add_argument("--lease-seconds", type=int, default=15, help="handler lease (default: 15)")
    px.add_argument("--claim-grace-seconds", type=float, default=300,
                    help="how long an unclaimed deferred volume counts as 'sandbox starting' (default: 300)")
    px.add_argument("--sweep-interval", type=float, default=60,
                    help="seconds between sweeps of entries whose target is gone (default: 60)")
    _add_metrics(px)
    px.add_argument("--kubelet-registration-dir", type=Path,
                    help="register the driver with kubelet: serve kubelet's plugin registration on "
                         "DIR/<driver>-reg.sock (kubelet's is /var/lib/kubelet/plugins_registry); "
                         "default: off (use node-driver-registrar instead)")
    px.add_argument("--kubelet-registration-path", default="",
                    help="the CSI socket's path as kubelet sees it, when it differs from --csi-endpoint "
                         "(the proxy in a container); default: the path of --csi-endpoint")
    _add_logging(px)

    st = sub.add_parser(
        "status",
        help="show the deferred volumes and the registered handlers of a running proxy",
        description="Ask a running `crust proxy` (over its runtime endpoint) for its deferred volumes "
                    "(target, device, fs, state, claim, handler) and its handlers with their lease age.",
    )
    st.add_argument("--runtime-endpoint", help="the proxy's runtime endpoint")
    st.add_argument("--config", type=Path,
                    help="a `crust node` configuration: also show each child of the supervisor, its restarts "
                         "and the health of every socket (default runtime endpoint: the config's)")
    st.add_argument("--node-id", default=os.environ.get("NODE_NAME", ""),
                    help="with --config: this node's name when the file has no nodeId, as `crust node --node-id` "
                         "was given it (default: $NODE_NAME, which the DaemonSet sets, so `kubectl exec ... crust "
                         "status --config /etc/crust/node.yaml` works in the pod)")
    st.add_argument("--json", action="store_true", help="print JSON")

    hd = sub.add_parser(
        "handler",
        help="run the light runtime handler (mount-namespace sandboxes)",
        description="Register with the crust proxy, watch the volumes directory, and run sandboxes whose "
                    "deferred volumes are mounted only inside their own mount namespace.",
    )
    hd.add_argument("--endpoint", required=True, help="unix:///path of this handler's socket")
    hd.add_argument("--proxy-endpoint", required=True, help="the proxy's runtime endpoint (registry)")
    hd.add_argument("--volumes-dir", required=True, type=Path, help="the proxy's watched directory")
    hd.add_argument("--state-dir", required=True, type=Path, help="sandbox records and mount points")
    hd.add_argument("--name", default="mountns", help="handler name in the registry (default: mountns)")
    _add_logging(hd)

    sb = sub.add_parser(
        "sandbox",
        help="run, delete or list sandboxes of a running `crust handler`",
        description="Drive the sandboxes of a running handler: run an OCI runtime bundle, delete a "
                    "sandbox (unmount, release its volumes), list sandboxes.",
    )
    sb.add_argument("--handler-endpoint", default="unix:///run/crust/handler.sock",
                    help="the handler's socket (default: unix:///run/crust/handler.sock)")
    sb_sub = sb.add_subparsers(dest="action", metavar="ACTION")
    sb_sub.required = True
    sb_run = sb_sub.add_parser("run", help="create a sandbox from an OCI bundle and start its process")
    sb_run.add_argument("--bundle", required=True, type=Path, help="bundle directory (config.json inside)")
    sb_run.add_argument("--id", required=True, help="sandbox id")
    sb_run.add_argument("--json", action="store_true")
    sb_del = sb_sub.add_parser("delete", help="stop a sandbox, unmount and release its volumes")
    sb_del.add_argument("id")
    sb_list = sb_sub.add_parser("list", help="list sandboxes")
    sb_list.add_argument("--json", action="store_true")

    rt = sub.add_parser(
        "runtime",
        help="an OCI runtime with runc's command line that mounts deferred volumes inside the container "
             "(also installed as crust-oci-runtime)",
        description="runc's command line (create, start, state, kill, delete, exec, ...), for containerd's runc "
                    "shim (BinaryName) and CRI-O (runtime_path). At create, a bind mount of a kubelet CSI target "
                    "path holding a deferred volume is claimed through the light handler (`crust handler`) and "
                    "replaced by a mount of the volume's device, made by runc inside the container's mount "
                    "namespace; delete releases it. Everything else is runc's. Settings: CRUST_RUNC, "
                    "CRUST_HANDLER_ENDPOINT, CRUST_OCI_RUNTIME_STATE, CRUST_OCI_RUNTIME_CONFIG (a JSON file, "
                    "default /etc/crust/oci-runtime.json).",
    )
    rt.add_argument("runc_args", nargs=argparse.REMAINDER, help="runc's global flags, command and arguments")

    sub.add_parser(
        "runtime-frontend", add_help=False,
        help="build crust-runc, the runtime's front end: runc at once for every call crust has nothing to do in",
        description="Compiles crust-runc (a small C program) with the system's C compiler: it execs runc for "
                    "every call but create of a bundle that binds a kubelet CSI volume and delete of a container "
                    "crust created so, which it hands to crust-oci-runtime. Point containerd's BinaryName (or "
                    "CRI-O's runtime_path) at it. `crust runtime-frontend --help` lists its flags.",
    )

    kt = sub.add_parser(
        "kata",
        help="the microVM runtime handler: guest image and handler daemon",
        description="A runtime handler whose sandboxes are QEMU microVMs: deferred volumes are hot-plugged "
                    "as virtio-blk disks (or virtio-scsi LUNs) and mounted, measured and grown by the guest kernel.",
    )
    kt_sub = kt.add_subparsers(dest="kata_command", metavar="COMMAND")
    kt_sub.required = True
    kt_img = kt_sub.add_parser("image", help="build (or confirm up to date) the guest kernel and initramfs")
    kt_img.add_argument("--cache", type=Path, default=Path("/var/cache/crust/kata"),
                        help="cache directory (default: /var/cache/crust/kata)")
    kt_img.add_argument("--flavor", default="cloud", choices=["cloud", "generic"],
                        help="cloud: Debian's cloud kernel (default); generic: the full kernel (9p)")
    kt_img.add_argument("--force", action="store_true", help="rebuild even if nothing changed")
    kt_h = kt_sub.add_parser("handler", help="run the microVM handler daemon")
    kt_h.add_argument("--endpoint", required=True, help="unix:///path of this handler's socket")
    kt_h.add_argument("--proxy-endpoint", required=True, help="the proxy's runtime endpoint (registry)")
    kt_h.add_argument("--volumes-dir", required=True, type=Path, help="the proxy's watched directory")
    kt_h.add_argument("--state-dir", required=True, type=Path, help="sandbox records, VM sockets and logs")
    kt_h.add_argument("--name", default="kata", help="handler name in the registry (default: kata)")
    kt_h.add_argument("--accel", default="auto", choices=["auto", "kvm", "tcg"],
                      help="QEMU accelerator. auto (default): kvm if a probe VM boots under it (the verdict is "
                           "kept next to the guest image), tcg (software emulation) otherwise")
    kt_h.add_argument("--memory", type=int, default=256,
                      help="guest memory in MiB of a pod without memory limits, and of every VM before its pod "
                           "(booted, pooled, the template): the floor (default: 256)")
    kt_h.add_argument("--max-memory", type=int, default=0, metavar="MIB",
                      help="the most guest memory a pod gets: its containers' memory limits (and its overhead, "
                           "where the CRI runtime passes it) above the floor are hot-plugged up to this "
                           "(default: 0, the floor: every pod gets --memory)")
    kt_h.add_argument("--cpus", type=_at_least_one, default=1, metavar="N",
                      help="the guest's vCPUs (default: 1). Under software emulation each is a thread of QEMU's, "
                           "so a pod whose processes work at once (a container writing logs while the agent "
                           "reads them) runs on more than one host CPU")
    kt_h.add_argument("--vm-pool", type=int, default=0, metavar="N",
                      help="keep N VMs booted ahead of their pods: a pod takes one instead of waiting for a boot, "
                           "and the pool boots another in the background; a VM serves one pod, once (default: 0)")
    kt_h.add_argument("--vm-template", action="store_true",
                      help="save one booted VM (under the state directory, kept across restarts) and restore each "
                           "pod's VM from it instead of booting one, when the pool has none: about a quarter of a "
                           "boot. Each restored VM gets the host's clock and fresh entropy, and its generator is "
                           "reseeded, before the pod uses it")
    kt_h.add_argument("--disk-bus", default="virtio-blk", choices=["virtio-blk", "virtio-scsi"],
                      help="how volumes reach the guest. virtio-blk (default): a PCI device hot-plugged per volume; "
                           "virtio-scsi: one controller booted with the VM, each volume a LUN on it (no PCI "
                           "hot-plug, so a volume reaches the guest sooner under software emulation). A VM keeps the bus "
                           "it booted with, a restarted handler's setting notwithstanding")
    kt_h.add_argument("--tcg-tb-mib", type=int, default=None, metavar="MIB",
                      help="TCG's translation buffer per VM in MiB, under software emulation only (default: "
                           "crust's measured default, 32; QEMU's own would be an eighth of the host's RAM, at most "
                           "1 GiB)")
    kt_h.add_argument("--cache", type=Path, default=Path("/var/cache/crust/kata"), help="guest image cache")
    kt_h.add_argument("--kata-dir", type=Path, default=Path("/run/kata-containers/shared/direct-volumes"),
                      help="Kata's direct-volume directory, where a Kata-style CSI driver describes volumes "
                           "(default: /run/kata-containers/shared/direct-volumes)")
    _add_logging(kt_h)
    kt_dv = kt_sub.add_parser(
        "direct-volume",
        help="Kata's direct-assigned volume verbs (add, remove, stats, resize), answered by this handler",
        description="The verbs and flags of `kata-runtime direct-volume`, on Kata's directory layout: a CSI "
                    "driver written for Kata's direct-assigned volumes can call this instead (or through a "
                    "`kata-runtime` wrapper, see deploy/). stats and resize ask the microVM handler whose "
                    "sandbox uses the volume. Exit 0 on success, 1 with a message on stderr otherwise.",
    )
    kt_dv.add_argument("verb", choices=["add", "remove", "stats", "resize"])
    kt_dv.add_argument("--volume-path", required=True, help="the volume's path (the CSI target path)")
    kt_dv.add_argument("--mount-info", default="",
                       help="add: the JSON description (volume-type \"directvol\" or \"block\", device, fstype, "
                            "metadata, options)")
    kt_dv.add_argument("--size", type=int, default=0, help="resize: the new size in bytes (device already grown)")
    kt_dv.add_argument("--kata-dir", type=Path, default=None,
                       help="the direct-volume directory (default: $CRUST_KATA_DIR or "
                            "/run/kata-containers/shared/direct-volumes)")
    kt_dv.add_argument("--handler-endpoint", default="",
                       help="the microVM handler's socket (default: $CRUST_KATA_HANDLER_ENDPOINT or "
                            "unix:///run/crust/kata-handler.sock)")

    nd = sub.add_parser(
        "node",
        help="run the whole node side (driver, shim, proxy, optional handler) from one config file",
        description="Start crust driver, shim, proxy (registered with kubelet) and optionally a runtime handler "
                    "as supervised children, all configured by one file (docs/install-node.md lists every key; "
                    "unknown keys are refused). A child that dies is restarted with backoff; SIGTERM stops "
                    "them all, last started first. Prints where each socket is.",
    )
    nd.add_argument("--config", type=Path, default=Path("/etc/crust/node.yaml"),
                    help="the node configuration, YAML or JSON (default: /etc/crust/node.yaml)")
    nd.add_argument("--node-id", default="",
                    help="this node's name, overriding the file's nodeId (in a DaemonSet: $(NODE_NAME) from the "
                         "downward API, so one ConfigMap serves every node)")
    nd.add_argument("--check", action="store_true",
                    help="validate the configuration, print the sockets and each child's command line, and exit")

    demo = sub.add_parser(
        "demo",
        help="a deferred volume end to end on the embedded defaults (as root)",
        description="Start driver, shim, proxy and a runtime handler in a temporary root and play kubelet: "
                    "create, stage, publish with deferral, run a pod sandbox that writes into the volume "
                    "(mounted only inside the sandbox), stats and expansion from inside it, stop it, "
                    "unpublish, publish on the host and read the data back, clean up. Prints each step with "
                    "its time; exit 0 only when every step held.",
    )
    demo.add_argument("--runtime", default="mountns", choices=["mountns", "kata"],
                      help="sandbox of the runtime handler: mountns, a private mount namespace (default); "
                           "kata, a QEMU microVM whose kernel mounts the volume")
    demo.add_argument("--fs", default="xfs", choices=["ext4", "xfs"],
                      help="file system of the demo volume (default: xfs, which grows online here)")
    demo.add_argument("--cri", nargs="?", const="containerd", default="", choices=["containerd", "crio"],
                      help="the pod is a real pod: a private containerd (the default) or CRI-O (`--cri crio`: crio "
                           "and pinns on PATH or named by $CRIO and $PINNS) starts it through CRI, kubelet's CRI side "
                           "replayed; with the RuntimeClass crust-runc (crust's OCI runtime, which mounts the volume "
                           "inside the container), or with --runtime kata crust-microvm (the runtime crust, crust's "
                           "shim v2: the pod runs in a microVM whose kernel mounts the volume)")
    demo.add_argument("--json", action="store_true", help="print the result as JSON")
    demo.add_argument("--keep", action="store_true", help="keep the temporary root for inspection")
    return parser


EXIT_NEWER_FORMAT = 3


def _serve(what: str, serve, *args, **kwargs) -> int:
    """Run a daemon; one that finds a file of a newer format than it reads
    stops with one clear message (the file and both versions) and exit
    code 3, before it has changed anything."""
    from crust.common.formats import NewerFormat
    from crust.sys.memory import give_back_large_buffers, no_core_dumps
    from crust.sys.openfiles import raise_soft_limit

    give_back_large_buffers()  # large requests' buffers leave the RSS when freed (crust.sys.memory)
    raise_soft_limit()  # a descriptor per connection, two on a gated socket (crust.sys.openfiles)
    for failure in no_core_dumps():  # passphrases of encrypted volumes pass through the daemons' memory
        logging.getLogger(__name__).warning("core dumps not disabled", extra={"fields": {"error": failure}})
    try:
        serve(*args, **kwargs)
    except NewerFormat as exc:
        logging.getLogger(__name__).error("refusing to start: a file of a newer format",
                                              extra={"fields": {"error": str(exc)}})
        print(f"crust {what}: {exc}", file=sys.stderr)
        return EXIT_NEWER_FORMAT
    return 0


def main(argv: list[str] | None = None) -> int:
    from crust.node.supervised import die_with_supervisor

    die_with_supervisor()
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["runtime"] and words[1:2] not in (["-h"], ["--help"]):
        # runc's own flags (--root, --log, ...) are not ours to parse.
        from crust.oci_runtime.main import main as runtime_main

        return runtime_main(words[1:])
    if words[:1] == ["runtime-frontend"]:
        from crust.oci_runtime.frontend import main as frontend_main

        return frontend_main(words[1:])
    args = build_parser().parse_args(argv)
    if args.command == "driver":
        from crust.driver.config import DriverConfig, Mode
        from crust.driver.server import serve

        logs.setup(args.log_level, args.log_format == "json")
        try:
            config = DriverConfig(
                endpoint=args.endpoint, node_id=args.node_id, data_dir=args.data_dir.absolute(),
                mode=Mode(args.mode), backend=args.backend, capacity_bytes=args.capacity,
                max_volumes_per_node=args.max_volumes_per_node, default_fs_type=args.default_fs_type,
                advertise_alpha=args.advertise_alpha, distributed=args.distributed,
                metrics_port=args.metrics_port, metrics_address=args.metrics_address,
            )
        except ValidationError as exc:
            print(f"crust driver: invalid configuration:\n{exc}", file=sys.stderr)
            return 2
        return _serve("driver", serve, config)
    if args.command == "shim":
        from crust.csi_shim.config import ShimConfig
        from crust.csi_shim.server import serve as serve_shim

        logs.setup(args.log_level, args.log_format == "json")
        try:
            shim_config = ShimConfig(
                endpoint=args.endpoint, backend_endpoint=args.backend_endpoint,
                proxy_endpoint=args.proxy_endpoint, state_dir=args.state_dir.absolute(),
                default_fs_type=args.default_fs_type, advertise_deferral=not args.no_advertise_deferral,
                max_request_bytes=args.max_request_bytes, freeze_timeout_seconds=args.freeze_timeout_seconds,
                metrics_port=args.metrics_port, metrics_address=args.metrics_address,
            )
        except ValidationError as exc:
            print(f"crust shim: invalid configuration:\n{exc}", file=sys.stderr)
            return 2
        return _serve("shim", serve_shim, shim_config)
    if args.command == "proxy":
        from crust.proxy.config import PolicyFile, ProxyConfig
        from crust.proxy.server import serve as serve_proxy

        logs.setup(args.log_level, args.log_format == "json")
        try:
            policy = PolicyFile.load(args.policy) if args.policy else PolicyFile()
            proxy_config = ProxyConfig(
                csi_endpoint=args.csi_endpoint, plugin_endpoint=args.plugin_endpoint,
                runtime_endpoint=args.runtime_endpoint, volumes_dir=args.volumes_dir.absolute(),
                state_dir=args.state_dir.absolute(), kata_dir=args.kata_dir.absolute() if args.kata_dir else None,
                kubelet_root=args.kubelet_root.absolute(), policy=policy,
                runtime_socket_group=args.runtime_socket_group,
                runtime_allowed_uids=args.runtime_allowed_uids or [0], lease_seconds=args.lease_seconds,
                claim_grace_seconds=args.claim_grace_seconds, sweep_interval_seconds=args.sweep_interval,
                metrics_port=args.metrics_port, metrics_address=args.metrics_address,
                kubelet_registration_dir=args.kubelet_registration_dir.absolute()
                if args.kubelet_registration_dir else None,
                kubelet_registration_path=args.kubelet_registration_path,
            )
        except (ValidationError, ValueError) as exc:
            print(f"crust proxy: invalid configuration:\n{exc}", file=sys.stderr)
            return 2
        return _serve("proxy", serve_proxy, proxy_config)
    if args.command == "status":
        from crust.proxy.status import status

        if args.config is None and not args.runtime_endpoint:
            print("crust status: give --runtime-endpoint or --config", file=sys.stderr)
            return 2
        if args.config is not None:
            from crust.node.config import NodeConfig
            from crust.node.status import node_status

            try:
                node_config = NodeConfig.load(args.config, node_id=args.node_id)
            except ValueError as exc:
                print(f"crust status: {exc}", file=sys.stderr)
                return 2
            return node_status(node_config, args.json, args.runtime_endpoint)
        return status(args.runtime_endpoint, args.json)
    if args.command == "node":
        from crust.node.config import NodeConfig
        from crust.node.supervisor import child_argvs
        from crust.node.supervisor import serve as serve_node

        try:
            node_config = NodeConfig.load(args.config, node_id=args.node_id)
        except ValueError as exc:
            print(f"crust node: invalid configuration: {exc}", file=sys.stderr)
            return 2
        if args.check:
            print(f"{args.config}: valid")
            for name, argv, sock in child_argvs(node_config, node_config.supervisor_dir / "policy.json"):
                print(f"  {name:<8} {sock}\n           crust {' '.join(argv)}")
            return 0
        logs.setup(node_config.log_level, node_config.log_format == "json")
        from crust.sys.openfiles import raise_soft_limit

        raise_soft_limit()  # and so its children's (crust.sys.openfiles)
        return serve_node(node_config)
    if args.command == "handler":
        from crust.runtime_handler.server import HandlerConfig
        from crust.runtime_handler.server import serve as serve_handler

        logs.setup(args.log_level, args.log_format == "json")
        try:
            handler_config = HandlerConfig(name=args.name, endpoint=args.endpoint,
                                           proxy_endpoint=args.proxy_endpoint,
                                           volumes_dir=args.volumes_dir.absolute(),
                                           state_dir=args.state_dir.absolute())
        except ValidationError as exc:
            print(f"crust handler: invalid configuration:\n{exc}", file=sys.stderr)
            return 2
        return _serve("handler", serve_handler, handler_config)
    if args.command == "sandbox":
        from crust.runtime_handler import sandbox_cli

        return sandbox_cli.main(args.action, args.handler_endpoint, bundle=getattr(args, "bundle", None),
                                sandbox_id=getattr(args, "id", ""), as_json=getattr(args, "json", False))
    if args.command == "kata":
        if args.kata_command == "image":
            from crust.kata.image.build import main as image_main

            return image_main(["build", "--cache", str(args.cache), "--flavor", args.flavor]
                              + (["--force"] if args.force else []))
        if args.kata_command == "direct-volume":
            from crust.kata.sandbox.direct_volume_cli import main as direct_volume_main

            return direct_volume_main(args.verb, args.volume_path, mount_info=args.mount_info, size=args.size,
                                      kata_dir=args.kata_dir.absolute() if args.kata_dir else None,
                                      endpoint=args.handler_endpoint)
        from crust.kata.handler import serve as serve_kata
        from crust.runtime_handler.server import HandlerConfig

        if args.max_memory and args.max_memory < args.memory:
            print(f"crust kata handler: --max-memory {args.max_memory} is below --memory {args.memory}",
                  file=sys.stderr)
            return 2
        logs.setup(args.log_level, args.log_format == "json")
        return _serve("kata handler", serve_kata,
                      HandlerConfig(name=args.name, endpoint=args.endpoint, proxy_endpoint=args.proxy_endpoint,
                                    volumes_dir=args.volumes_dir.absolute(), state_dir=args.state_dir.absolute()),
                      cache=args.cache, accel=args.accel, memory_mib=args.memory, cpus=args.cpus,
                      kata_dir=args.kata_dir.absolute(), vm_pool=args.vm_pool, disk_bus=args.disk_bus,
                      vm_template=args.vm_template, max_memory_mib=args.max_memory,
                      tcg_tb_mib=args.tcg_tb_mib)
    if args.command == "demo":
        from crust.demo import run_demo

        return run_demo(fs_type=args.fs, runtime=args.runtime, as_json=args.json, keep=args.keep, cri=args.cri)
    return 2
