#!/bin/sh
# /init of the crust guest (PID 1, busybox sh).
#
# Sets up the pseudo file systems, starts the guest's agent on its
# virtio-serial port, loads the kernel modules the image builder listed (in
# dependency order: no modprobe, no depmod at boot), then waits. PID 1 must
# never exit (the kernel would panic), so the agent is a child and is
# restarted if it dies; waiting also reaps the orphans reparented to PID 1.
# Everything this script prints goes to the console (ttyS0).

export PATH=/sbin:/bin:/usr/sbin:/usr/bin
umask 022

# The initramfs is the kernel's rootfs, a mount with no parent, and
# pivot_root(2) refuses to move such a root: crun, which jails each
# container with pivot_root, needs the guest's root to be an ordinary
# mount. So the first /init binds the rootfs onto a directory of its own,
# moves that bind over / and starts again chrooted into it: the same files,
# nothing copied, and a root mount whose parent is the rootfs.
if [ "$$" = 1 ] && [ -z "${CRUST_ROOT_BOUND:-}" ]; then
  mkdir -p /newroot
  mount --bind / /newroot
  cd /newroot
  mount --move . /
  CRUST_ROOT_BOUND=1 exec chroot . /init
fi

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
# binary through /proc/self/exe) by running from a copy nobody can write:
# a binary already on a read-only mount it runs as it is; any other it
# copies into a sealed memfd and re-executes. On the rootfs (tmpfs) it
# takes its binary for an unsealed memfd and re-executes twice at every
# call: 140 ms instead of 50 under software emulation, for each run, exec,
# state and delete. So crun runs from a ramfs copy (no seals to misread)
# bound read-only over /sbin/crun: the read-only bind crun itself would
# make, made once. Only this namespace could remount it; containers have
# their own.
if [ -x /sbin/crun ]; then
  mkdir -p /run/crust-bin
  mount -t ramfs -o mode=0700 ramfs /run/crust-bin &&
    cp /sbin/crun /run/crust-bin/crun &&
    mount --bind /run/crust-bin/crun /sbin/crun &&
    mount -o remount,bind,ro /sbin/crun &&
    umount -l /run/crust-bin ||
    echo "crust-init: crun stays on the rootfs (it re-executes itself at each call)"
  rmdir /run/crust-bin 2>/dev/null
fi

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
