"""A pod's guest memory from the CRI runtime's annotations, between the
node's floor and ceiling (crust.kata.pod.guest_memory), and the room QEMU is
given for it."""

from __future__ import annotations

import json

import pytest

from crust.kata.pod import guest_memory

MIB = 1024 * 1024


def _containerd(memory: str | None) -> dict:
    annotations = {"io.kubernetes.cri.container-type": "sandbox"}
    if memory is not None:
        annotations["io.kubernetes.cri.sandbox-memory"] = memory
    return {"annotations": annotations}


def _crio(resources: object, overhead: object = None, key: str = "pod-linux-resources.crio.io") -> dict:
    annotations = {"io.kubernetes.cri-o.ContainerType": "sandbox", key: json.dumps(resources)}
    if overhead is not None:
        annotations["pod-linux-overhead.crio.io"] = json.dumps(overhead)
    return {"annotations": annotations}


def test_the_limits_and_overhead_are_read_as_the_runtime_that_wrote_the_spec_gives_them():
    """containerd: the limits' sum in bytes, no overhead; CRI-O: the CRI's
    messages as JSON, under its current keys or the older ones; a spec
    without them asks nothing. Under CRI-O a containerd key (the pod's
    author's, copied) is ignored."""
    from crust.kata.pod.guest_memory import requested

    assert requested(_containerd(str(512 * MIB))) == (512 * MIB, 0)
    assert requested(_containerd("0")) == (0, 0)
    assert requested(_containerd(None)) == (0, 0)
    assert requested({}) == (0, 0)
    assert requested(_crio({"memory_limit_in_bytes": 300 * MIB}, {"memory_limit_in_bytes": 160 * MIB})) == (
        300 * MIB, 160 * MIB)
    assert requested(_crio({"memory_limit_in_bytes": 64 * MIB}, key="io.kubernetes.cri-o.PodLinuxResources")) == (
        64 * MIB, 0)
    assert requested(_crio(None)) == (0, 0)
    forged = _crio({"cpu_shares": 2})
    forged["annotations"]["io.kubernetes.cri.sandbox-memory"] = str(8 * 1024 * MIB)
    assert requested(forged) == (0, 0)


@pytest.mark.parametrize("spec, named", [
    (_containerd("lots"), "annotations[io.kubernetes.cri.sandbox-memory]"),
    (_containerd("-1"), "annotations[io.kubernetes.cri.sandbox-memory]"),
    (_crio({"memory_limit_in_bytes": "x"}), "annotations[pod-linux-resources.crio.io].memory_limit_in_bytes"),
    (_crio([1]), "annotations[pod-linux-resources.crio.io]: not a JSON object"),
])
def test_a_value_that_is_no_size_is_refused_naming_its_annotation(spec, named):
    from crust.common.errors import InvalidArgument
    from crust.kata.pod.guest_memory import requested

    with pytest.raises(InvalidArgument) as caught:
        requested(spec)
    assert named in caught.value.message


def test_the_guest_gets_the_limits_above_the_floor_in_whole_blocks_up_to_the_ceiling():
    """No limits: the floor. Limits: the floor (or a larger overhead) on
    top, rounded up to 128 MiB blocks. Never above the ceiling, which
    rounds down to a whole block above the floor."""
    from crust.kata.pod.guest_memory import guest_mib

    assert guest_mib(0, 0, 256, 2048) == 256
    assert guest_mib(512 * MIB, 0, 256, 2048) == 768
    assert guest_mib(100 * MIB, 0, 256, 2048) == 384
    assert guest_mib(512 * MIB, 384 * MIB, 256, 2048) == 896
    assert guest_mib(512 * MIB, 64 * MIB, 256, 2048) == 768
    assert guest_mib(8 * 1024 * MIB, 0, 256, 1024) == 1024
    assert guest_mib(8 * 1024 * MIB, 0, 256, 1000) == 896
    assert guest_mib(512 * MIB, 0, 256, 256) == 256
    with pytest.raises(ValueError, match="below its floor"):
        guest_mib(0, 0, 512, 256)


def test_qemu_gets_room_for_one_dimm_only_below_a_ceiling(tmp_path):
    from crust.kata.vmm.qemu import Vm, VmConfig

    def m(**settings) -> str:
        argv = Vm("crust-units", tmp_path / "vm", VmConfig(kernel=tmp_path / "k", initrd=tmp_path / "i",
                                                           **settings)).argv()
        return argv[argv.index("-m") + 1]

    assert m(memory_mib=256, max_memory_mib=2048) == "256M,slots=1,maxmem=2048M"
    assert m(memory_mib=256) == "256"
    assert m(memory_mib=256, max_memory_mib=256) == "256"


def test_the_node_config_keeps_the_ceiling_above_the_floor_and_the_template_on(tmp_path):
    from crust.node.config import NodeConfig

    config = NodeConfig.model_validate({"nodeId": "n", "handler": {"runtime": "kata"}})
    assert config.handler.kata.vm_template is True
    assert (config.handler.kata.memory_mib, config.handler.kata.max_memory_mib) == (256, 2048)
    path = tmp_path / "node.yaml"
    path.write_text("nodeId: n\nhandler:\n  kata:\n    memoryMiB: 512\n    maxMemoryMiB: 384\n")
    with pytest.raises(ValueError, match="maxMemoryMiB 384 is below memoryMiB 512"):
        NodeConfig.load(path)


def test_kubelets_replay_passes_the_pods_limits_in_run_pod_sandbox():
    """As calculateSandboxResources: the containers' memory limits summed
    (a container without one adds nothing), an init container's when
    larger (they run one at a time); 0 without limits."""
    from crust.kubelet import Container, Pod
    from crust.kubelet.cri_config import GeneratedConfigs

    def limit(containers, init_containers=()) -> int:
        pod = Pod(uid="u", name="p", containers=list(containers), init_containers=list(init_containers))
        return GeneratedConfigs()._sandbox_resources(pod).memory_limit_in_bytes

    assert limit([Container("a", "i")]) == 0
    assert limit([Container("a", "i", memory_limit=512 * MIB), Container("b", "i")]) == 512 * MIB
    assert limit([Container("a", "i", memory_limit=100 * MIB), Container("b", "i", memory_limit=28 * MIB)]) == 128 * MIB
    assert limit([Container("a", "i", memory_limit=64 * MIB)], [Container("init", "i", memory_limit=256 * MIB)]) == \
        256 * MIB


def test_the_guest_memory_block_follows_the_end_of_the_boot_memory():
    assert [guest_memory.block_bytes(mib) >> 20 for mib in (256, 384, 512, 640, 1024, 3072, 4096, 8192)] == \
        [256, 128, 512, 128, 1024, 1024, 2048, 2048]


async def test_the_dimm_goes_past_the_guest_root_on_a_whole_block():
    class Qmp:
        def __init__(self, devices):
            self.devices = devices

        async def execute(self, command, arguments=None):
            assert command == "query-memory-devices"
            return self.devices

    class Vm:
        def __init__(self, devices):
            self.qmp = Qmp(devices)

    root = {"type": "virtio-pmem", "data": {"memaddr": 4 << 30, "size": 62 << 20, "id": "root-pmem"}}
    assert await guest_memory.dimm_address(Vm([root]), 256) == (4 << 30) + (256 << 20)
    assert await guest_memory.dimm_address(Vm([root]), 384) == (4 << 30) + (128 << 20)
    assert await guest_memory.dimm_address(Vm([]), 256) is None
