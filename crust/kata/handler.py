"""`crust kata handler`: the runtime handler whose sandboxes are microVMs."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from pathlib import Path

from crust.contract import encryption
from crust.kata.vmm.accel import choose as choose_accelerator
from crust.kata.sandbox.direct_volume import DEFAULT_ROOT, DirectVolumes
from crust.kata.image.build import DEFAULT_CACHE, build
from crust.kata.pod.service import PodRuntimeExtension
from crust.kata.supply.pool import VmPool
from crust.kata.vmm.qemu import Vm, VmConfig
from crust.kata.sandbox.vm_sandbox import KataSandbox
from crust.kata.supply.template import VmTemplate, remove_saved
from crust.runtime_handler.server import HandlerConfig, HandlerDaemon
from crust.sys.proc import ProcessId

log = logging.getLogger(__name__)


def serve(config: HandlerConfig, *, cache: Path = DEFAULT_CACHE, accel: str = "auto", memory_mib: int = 256,
          cpus: int = 1, kata_dir: Path | None = DEFAULT_ROOT, vm_pool: int = 0, disk_bus: str = "virtio-blk",
          vm_template: bool = False, max_memory_mib: int = 0, tcg_tb_mib: int | None = None) -> None:
    # The image is checked (and rebuilt if its inputs changed) before the
    # handler registers: a sandbox must never wait for a kernel build.
    image = build(cache, "cloud")
    if tcg_tb_mib is not None and not 1 <= tcg_tb_mib <= 1024:
        raise ValueError(f"tcg_tb_mib {tcg_tb_mib}: 1 to 1024 MiB")
    vm_config = VmConfig(kernel=image.kernel, initrd=image.initrd, memory_mib=memory_mib, cpus=cpus,
                         disk_bus=disk_bus, max_memory_mib=max_memory_mib, tcg_tb_mib=tcg_tb_mib)

    def make_sandbox(sandbox_id: str, workdir: Path, rootfs: Path | None, qemu: ProcessId | None,
                     vm: Vm | None = None) -> KataSandbox:
        # The guest has its own root file system; the bundle's rootfs is not used.
        return KataSandbox(sandbox_id, workdir, vm_config, qemu, vm=vm)

    # VMs booted ahead of their pods (PodRuntime's pods take them).
    pool = VmPool(vm_pool, config.state_dir / "pool", vm_config)
    # A VM saved once, restored for each pod the pool has no VM for; what
    # an earlier handler saved is removed when this one restores nothing.
    template = VmTemplate(config.state_dir / "template", vm_config) if vm_template else None
    if template is None:
        removed = remove_saved(config.state_dir / "template")
        if removed:
            log.info("removed the VM template an earlier handler saved", extra={"fields": {"files": removed}})

    # Volumes a Kata-style CSI driver described with `direct-volume add`
    # are found next to the proxy's deferred ones.
    direct = DirectVolumes(kata_dir) if kata_dir is not None else None

    async def main() -> None:
        # Decided before registering, like the image: no sandbox waits for a
        # probe. SIGTERM meanwhile cancels the probe, which kills its VM.
        loop = asyncio.get_running_loop()
        choosing = asyncio.ensure_future(
            choose_accelerator(accel, vm_config, cache, config.state_dir / "accel-probe"))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, choosing.cancel)
        try:
            vm_config.accel, reason = await choosing
        except asyncio.CancelledError:
            log.info("stopped while choosing the accelerator")
            return
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        log.info("accelerator", extra={"fields": {"accel": vm_config.accel, "requested": accel, "reason": reason}})
        # PodRuntime (containerd's crust shim): one VM per pod, its containers inside.
        # The guest opens LUKS2 volumes, authenticated ones too: the proxy
        # hands this handler their keys.
        await HandlerDaemon(config, make_sandbox=make_sandbox, direct_source=direct,
                            extensions=[functools.partial(PodRuntimeExtension, pool=pool, template=template,
                                                          endpoint=config.endpoint)],
                            extra_features=tuple(encryption.required_features(encryption.LUKS2,
                                                                              encryption.HMAC_SHA256))).run()

    asyncio.run(main())
