#!/bin/sh
# /init of the crust guest (PID 1, busybox sh), on the guest's read-only
# root (the initramfs's /init mounted it: crust.kata.guest_root).
#
# Sets up the pseudo file systems, starts the guest's agent on its
# virtio-serial port, loads the kernel modules the image builder listed (in
# dependency order: no modprobe, no depmod at boot), then waits. PID 1 must
# never exit (the kernel would panic), so the agent is a child and is
# restarted if it dies; waiting also reaps the orphans reparented to PID 1.
# Everything this script prints goes to the console (ttyS0).

export PATH=/sbin:/bin:/usr/sbin:/usr/bin
umask 022

mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
mkdir -p /dev/pts /dev/shm
# The guest's own terminals (a container's are in its own devpts).
mount -t devpts -o nosuid,noexec,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /tmp
# cgroup v2: runc puts each container in a cgroup of its own below /crust
# (its limits, its OOM kills, its processes to signal).
mount -t cgroup2 -o nosuid,nodev,noexec,nsdelegate cgroup2 /sys/fs/cgroup
exec </dev/console >/dev/console 2>&1

# The guest's agent (crust.guest, Python) on its virtio-serial port: the
# host takes the VM as ready once it answers there, so it starts first, its
# imports (seconds of the one CPU under emulation) beside the rest of the
# boot. In the background, with a restart loop of its own: one that keeps
# exiting at once is restarted less and less often (up to a minute apart),
# not in a loop that takes the CPU from the pod; one that ran a minute or
# more is restarted after a second.
python_agent() {
  pause=1
  while :; do
    started=$(cut -d. -f1 /proc/uptime)
    echo "crust-init: starting the agent at $(cut -d' ' -f1 /proc/uptime)s"
    PYTHONPATH=/usr/lib/crust/python python3.11 -S -m crust.guest --port-name crust.agent
    code=$?
    if [ $(($(cut -d. -f1 /proc/uptime) - started)) -ge 60 ]; then
      pause=1
    fi
    echo "crust-init: the agent exited ($code) at $(cut -d' ' -f1 /proc/uptime)s; restarting it in ${pause}s"
    sleep "$pause"
    pause=$((pause < 32 ? pause * 2 : 60))
  done
}
python_agent &

# crun guards against CVE-2019-5736 (a container overwriting the runtime's
# binary through /proc/self/exe) by running from a copy nobody can write;
# a binary on a read-only mount, as the guest's root is, it runs as it is.

# Only this list is loaded: the image has no modules.dep, so the kernel's own
# module requests (through busybox modprobe) find nothing and fail quietly.
while read -r module; do
  [ -n "$module" ] || continue
  insmod "$module" || echo "crust-init: insmod $module failed"
done < /etc/crust/modules
# A VM whose disks are LUNs of a virtio-scsi controller says so on the
# kernel's command line (crust.kata.vmm.qemu): its SCSI modules, listed apart
# so that a VM of virtio-blk disks does not pay for them.
case " $(cat /proc/cmdline) " in
  *" crust.disks=scsi "*)
    while read -r module; do
      insmod "$module" || echo "crust-init: insmod $module failed"
    done < /etc/crust/modules.d/scsi ;;
esac

hostname crust-guest
# The VM is the pod: its containers share the guest's network, localhost included.
ip link set dev lo up
echo "crust-init: up in $(cut -d' ' -f1 /proc/uptime)s"

while :; do
  wait
  sleep 1
done
