#!/bin/sh
# /init of the crust guest's initramfs (PID 1, busybox sh).
#
# The guest's root is the read-only ext4 image on the VM's virtio-pmem
# device (crust.kata.guest_root). This loads the modules that show it,
# mounts /dev/pmem0 read-only with DAX (its files are read from the
# host's page cache, never copied into guest RAM) and hands PID 1 to the
# root's own /init. A VM without its root powers off: the host then sees
# QEMU exit during the boot, with these words on the console.

export PATH=/bin
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev

fail() {
  echo "crust-initramfs: $*; powering off"
  poweroff -f
  while :; do sleep 1; done
}

while read -r module; do
  insmod "$module" || echo "crust-initramfs: insmod $module failed"
done < /etc/crust/root-modules

# The nvdimm bus registers the device's namespace asynchronously.
tries=0
while [ ! -b /dev/pmem0 ]; do
  tries=$((tries + 1))
  [ "$tries" -le 2000 ] || fail "no /dev/pmem0 after 20 s: the VM has no guest root device"
  sleep 0.01
done

mount -t ext4 -o ro,dax=always,noatime /dev/pmem0 /pmem || fail "the guest root on /dev/pmem0 did not mount"
# The root the guest runs on is a tmpfs of directories (the host may mount
# a volume at any path of it), with the image's directories bound over it
# read-only: the files themselves stay on the device.
mount -t tmpfs -o mode=0755 root /root || fail "no tmpfs for the root"
for dir in bin sbin usr lib lib64 etc; do
  mkdir /root/$dir && mount --bind /pmem/$dir /root/$dir && mount -o remount,bind,ro /root/$dir ||
    fail "/$dir of the guest root was not bound"
done
for dir in dev proc sys run tmp mnt root; do
  mkdir -m 0755 /root/$dir
done
chmod 1777 /root/tmp
cp /pmem/init /root/init || fail "no /init on the guest root"
umount /dev
umount /proc
exec switch_root /root /init
