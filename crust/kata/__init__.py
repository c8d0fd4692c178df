"""The microVM foundation for a Kata-style sandbox.

A volume's file system is parsed by a guest kernel, never by the host's: the
host only hands a block device to QEMU (virtio-blk or virtio-scsi), and the
agent inside the guest (crust.guest) mounts, measures, grows and unmounts it.

- `image/`: builds the guest (a Debian kernel plus an initramfs with the file
  system tools, crun and the agent) from Debian packages only, cached.
- `vmm/`: one QEMU process per VM, QMP, devices, saving and restoring.
- `supply/`: VMs booted ahead (a pool) or restored from a saved one.
- `agent/`: the agent's protocol (specs/agent.proto) on the VM's
  virtio-serial port, and the checks of what the guest answers.
- `pod/`: PodRuntime (specs/handler.proto): pods, containers, processes.
- `sandbox/`: the handler's Sandbox on a VM, and Kata's direct volumes.
- `handler.py`: `crust kata handler`, which puts them together.

What the image carries of its own (`init.sh`, `enter.c`) lives with the guest,
in crust/guest/files/.

See docs/agent-protocol.md for the agent's protocol and examples/kata/README.md
for how to build and boot.
"""
