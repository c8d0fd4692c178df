"""The microVM foundation for a Kata-style sandbox.

A volume's file system is parsed by a guest kernel, never by the host's: the
host only hands a block device to QEMU (virtio-blk or virtio-scsi), and the
agent inside the guest (crust.guest) mounts, measures, grows and unmounts it.

- `image`: builds the guest (a Debian kernel plus an initramfs with the file
  system tools, crun and the agent) from Debian packages only, cached.
- `qemu`: one QEMU process per sandbox, with QMP for device hotplug and
  resize (`qmp`) and the agent's protocol (specs/agent.proto) on a
  virtio-serial port (`port_agent`, `agent_client`).
- `accel`: kvm where a probe VM boots under it, tcg otherwise (`--accel auto`).
- `guest/`: what the image carries of its own (`init.sh`, `enter.c`).

See docs/agent-protocol.md for the agent's protocol and examples/kata/README.md
for how to build and boot.
"""
