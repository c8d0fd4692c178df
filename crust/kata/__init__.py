"""The microVM foundation for a Kata-style sandbox.

A volume's file system is parsed by a guest kernel, never by the host's: the
host only hands a block device to QEMU (virtio-blk), and a small agent inside
the guest mounts, measures, grows and unmounts it.

- `image`: builds the guest (a Debian kernel plus a busybox initramfs with
  the file system tools and the agent) from Debian packages only, cached.
- `qemu`: one QEMU process per sandbox, with QMP for device hotplug and
  resize (`qmp`) and the line protocol to the guest agent (`agent`).
- `accel`: kvm where a probe VM boots under it, tcg otherwise (`--accel auto`).
- `guest/`: the scripts that run inside the guest (`init.sh`, `agent.sh`).

See examples/kata/README.md for the agent protocol and how to build and boot.
"""
