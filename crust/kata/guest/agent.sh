#!/bin/sh
# shellcheck disable=SC2086,SC2046  # word splitting is intended (set -f below)
# The crust guest agent (busybox sh), started by /init, talking to the host
# over a serial port (default /dev/ttyS1; the console stays on ttyS0).
#
# Protocol: one request per line, one answer per line.
#   request:  <id> <command> <args...>
#   answer:   <id> ok [<fields...>]   or   <id> err <message>
# <id> is chosen by the host ([A-Za-z0-9_.-]+) and echoed back. Arguments are
# single words; those that may hold spaces or other bytes (mount options, a
# command line) travel as URL-safe base64 with padding, "-" standing for the
# empty string. Answers are always one line (newlines become spaces).
# Once, when it starts, the agent announces itself unasked with the id "-":
#   - ok ready agent=<n> image=<hash> kernel=<release> uptime=<s>
# The command table is in examples/kata/README.md.
#
# Requests are served one at a time, in arrival order. Each command runs in a
# command substitution, i.e. a subshell: whatever it does (fail, exit, hang
# up a pipe), the loop survives and the request gets exactly one answer.
# Commands print their ok-fields on stdout, or a reason on stderr and return
# non-zero.

PORT=${1:-/dev/ttyS1}
AGENT_VERSION=16
RUN=/run/crust
DISK_WAIT_SECONDS=15
DEVICE_WAIT_SECONDS=10   # a hot-plugged NIC or shared directory
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
# Requests and /proc/mounts lines are split into words on purpose, never
# globbed; the one glob (the disks in /sys/block) turns it back on locally.
set -f

# shellcheck disable=SC1091
[ -r /etc/crust/image ] && . /etc/crust/image

log() { echo "crust-agent: $*" >/dev/console; }
fail() { echo "$*" >&2; exit 1; }

NL='
'
CR=$(printf '\r')
TAB=$(printf '\t')
one_line() {  # the common case (already one line) without forking
  case $1 in
    *"$NL"*|*"$CR"*|*"$TAB"*) printf '%s' "$1" | tr '\r\n\t' '   ' | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-1000 ;;
    *) printf '%s' "$1" ;;
  esac
}

reply() {  # id ok|err text
  # Without a subshell in the common case (one line): each costs the
  # guest's one CPU a fork per request under emulation.
  case $3 in
    *"$NL"*|*"$CR"*|*"$TAB"*) text=$(one_line "$3") ;;
    *) text=$3 ;;
  esac
  if [ -n "$text" ]; then printf '%s %s %s\n' "$1" "$2" "$text" >&3
  else printf '%s %s\n' "$1" "$2" >&3; fi
  # The console is a slow emulated UART: a long answer (readout's data) is
  # logged cut short.
  if [ ${#text} -gt 200 ]; then log "$1 $2 ${text:0:200}..."; else log "$1 $2${text:+ $text}"; fi
}

b64() {  # URL-safe base64 (padded) -> bytes; "-" is the empty string
  [ "$1" = - ] && return 0
  case $1 in *[!A-Za-z0-9_=-]*) fail "not URL-safe base64: $1" ;; esac
  printf '%s' "$1" | tr '_-' '/+' | base64 -d || fail "bad base64: $1"
}

path_ok() {  # check_path's test as a status, for a caller that fails with its own words (no subshell)
  case $1 in /*) ;; *) return 1 ;; esac
  case $1 in *[!A-Za-z0-9/_.@:+,=-]*|*/../*|*/..|*/./*|*/.) return 1 ;; esac
}

check_path() {  # absolute, no "..", no characters that /proc/mounts escapes
  case $1 in
    /*) ;;
    *) fail "not an absolute path: $1" ;;
  esac
  case $1 in
    *[!A-Za-z0-9/_.@:+,=-]*) fail "unsupported characters in path: $1" ;;
    */../*|*/..|*/./*|*/.) fail "path with . or ..: $1" ;;
  esac
}

kernel_dev() {  # a mount source -> the kernel's node for it (/dev/mapper/crypt-x -> /dev/dm-0)
  case $1 in
    /dev/mapper/*) link=$(readlink "$(dm_sysfs "$1")") && echo "/dev/${link##*/}" || echo "$1" ;;
    *) echo "$1" ;;
  esac
}

mount_line() {  # target -> its (last) line of /proc/mounts, or nothing
  awk -v t="$1" '$2 == t { l = $0 } END { if (l != "") print l }' /proc/mounts
}

disk_with_serial() {  # serial -> vdX or sdX, if the guest has such a disk now
  set +f   # called in a request's subshell: the main loop keeps set -f
  for d in /sys/block/vd* /sys/block/sd*; do
    found=
    case ${d##*/} in
      # read, a builtin: each round forks nothing while the disk is probed
      # (the serial has no newline: read says end of file, having read it).
      vd*) read -r found 2>/dev/null < "$d/serial" ;;
      # A SCSI disk's serial is its VPD page 0x80 (agent 13): four bytes
      # of header, then the serial QEMU was given.
      sd*) [ -r "$d/device/vpd_pg80" ] && found=$(tail -c +5 "$d/device/vpd_pg80" 2>/dev/null) ;;
    esac
    if [ -n "$found" ] && [ "$found" = "$1" ] && [ -b "/dev/${d##*/}" ]; then
      echo "${d##*/}"
      return 0
    fi
  done
  return 1
}

find_disk() {  # serial -> vdX or sdX, waiting for a device that is still being hot-plugged
  tries=$((DISK_WAIT_SECONDS * 20))
  while ! disk_with_serial "$1"; do
    tries=$((tries - 1))
    [ "$tries" -gt 0 ] || return 1
    usleep 50000   # a hot-plugged disk is probed within about 0.1 s here
  done
}

cmd_diskgone() {  # serial: wait until no disk has this serial (agent 13)
  # QEMU removes a LUN at once and tells the guest, which removes the disk
  # in the background: the host waits for that before it plugs a disk of
  # the same serial again, so find_disk never finds the old one.
  [ $# -eq 1 ] || fail "usage: diskgone <serial>"
  case $1 in ''|*[!A-Za-z0-9_.-]*) fail "bad serial: $1" ;; esac
  tries=$((DISK_WAIT_SECONDS * 50))
  while dev=$(disk_with_serial "$1"); do
    tries=$((tries - 1))
    [ "$tries" -gt 0 ] || fail "disk $dev with serial $1 still there after ${DISK_WAIT_SECONDS}s"
    usleep 20000
  done
  echo "gone=1"
}

rescan_disk() {  # sdX: read a SCSI disk's capacity again, now (agent 13)
  # QEMU announces a grown LUN with an event that the kernel handles in
  # the background; a grow must not race it. A virtio disk's new size is
  # read when QEMU signals it, and it has no rescan file.
  [ -w "/sys/block/$1/device/rescan" ] || return 0
  echo 1 > "/sys/block/$1/device/rescan" || fail "rescan of $1 failed"
}

disk_under() {  # /dev/dm-N -> the disk it maps (its one slave), or nothing
  set +f
  for s in "/sys/block/${1#/dev/}/slaves/"*; do
    [ -e "$s" ] && echo "${s##*/}"
  done
}

fs_numbers() {  # target -> "total=.. free=.. avail=.. inodes=.. ifree=.."
  set -- $(stat -f -c '%S %b %f %a %c %d' "$1") || fail "statfs $1 failed"
  echo "total=$(($1 * $2)) free=$(($1 * $3)) avail=$(($1 * $4)) inodes=$5 ifree=$6"
}

load_fs_modules() {  # fstype: the modules the image listed for it, on first use
  grep -qw "$1" /proc/filesystems && return 0
  [ -r "/etc/crust/modules.d/$1" ] || return 0
  while read -r module; do
    name=${module##*/}
    name=${name%.ko}
    [ -d "/sys/module/$(echo "$name" | tr - _)" ] && continue
    insmod "$module" || fail "insmod $module failed"
  done < "/etc/crust/modules.d/$1"
}

cmd_ping() {
  read -r up _ < /proc/uptime
  read -r release < /proc/sys/kernel/osrelease
  echo "agent=$AGENT_VERSION image=${CRUST_IMAGE_HASH:-unknown} kernel=$release uptime=$up"
}

cmd_mount() {  # serial fstype options-b64 ro|rw target
  [ $# -eq 5 ] || fail "usage: mount <serial> <fstype> <options-b64> <ro|rw> <target>"
  serial=$1 fstype=$2 mode=$4 target=$5
  options=$(b64 "$3") || exit 1
  case $serial in ''|*[!A-Za-z0-9_.-]*) fail "bad serial: $serial" ;; esac
  case $fstype in ''|*[!a-z0-9]*) fail "bad file system type: $fstype" ;; esac
  case $mode in ro|rw) ;; *) fail "mode must be ro or rw, not $mode" ;; esac
  case $options in *[!A-Za-z0-9_.,=:/+@-]*) fail "unsupported characters in mount options" ;; esac
  check_path "$target"
  case $serial in
    crypt-*) [ -b "/dev/mapper/$serial" ] || fail "no opened encrypted volume $serial"; dev=mapper/$serial ;;
    *) dev=$(find_disk "$serial") || fail "no virtio disk with serial $serial after ${DISK_WAIT_SECONDS}s" ;;
  esac
  line=$(mount_line "$target")
  if [ -n "$line" ]; then
    set -- $line
    [ "$1" = "/dev/$dev" ] || fail "$target is already a mount of $1"
    echo "device=$dev already=1"
    return 0
  fi
  mkdir -p "$target" || fail "mkdir $target failed"
  load_fs_modules "$fstype"
  mount -t "$fstype" -o "${options:+$options,}$mode" "/dev/$dev" "$target" ||
    fail "mount of $dev ($fstype) on $target failed"
  # busybox mount falls back to read-only on a write-protected disk: a
  # read-write request must not succeed that way.
  set -- $(mount_line "$target")
  if [ "$mode" = rw ] && [ "${4%%,*}" != rw ]; then
    umount "$target"
    fail "$dev could only be mounted read-only"
  fi
  echo "device=$dev"
}

cmd_fsgroup() {  # target gid Always|OnRootMismatch (Kubernetes fsGroup semantics)
  [ $# -eq 3 ] || fail "usage: fsgroup <target> <gid> <Always|OnRootMismatch>"
  target=$1 gid=$2 policy=$3
  check_path "$target"
  case $gid in ''|*[!0-9]*) fail "bad gid: $gid" ;; esac
  case $policy in Always|OnRootMismatch) ;; *) fail "bad policy: $policy" ;; esac
  [ -n "$(mount_line "$target")" ] || fail "not mounted: $target"
  if [ "$policy" = OnRootMismatch ]; then
    perm=$(stat -c %a "$target")
    if [ "$(stat -c %g "$target")" = "$gid" ] && [ $((0$perm & 02070)) -eq $((02070)) ]; then
      echo "walked=0"
      return 0
    fi
  fi
  # Group ownership on everything (symlinks themselves, never followed),
  # group rw on files, rwx + setgid on directories; stay on this file system.
  find "$target" -xdev -exec chgrp -h "$gid" {} + || fail "chgrp failed under $target"
  find "$target" -xdev -type d -exec chmod g+rwxs {} + || fail "chmod failed under $target"
  find "$target" -xdev ! -type d ! -type l -exec chmod g+rw {} + || fail "chmod failed under $target"
  echo "walked=1"
}

cmd_stats() {  # target
  [ $# -eq 1 ] || fail "usage: stats <target>"
  check_path "$1"
  line=$(mount_line "$1")
  [ -n "$line" ] || fail "not mounted: $1"
  target=$1
  set -- $line
  set -- "$(kernel_dev "$1")" "$2" "$3" "$4"
  dev=${1#/dev/} fstype=$3 mode=${4%%,*}
  errors=0
  [ -r "/sys/fs/ext4/$dev/errors_count" ] && errors=$(cat "/sys/fs/ext4/$dev/errors_count")
  devsize=0
  [ -r "/sys/class/block/$dev/size" ] && devsize=$(($(cat "/sys/class/block/$dev/size") * 512))
  echo "$(fs_numbers "$target") mode=$mode fstype=$fstype device=$dev errors=$errors devsize=$devsize"
}

cmd_grow() {  # target: grow the mounted file system to its (grown) device
  [ $# -eq 1 ] || fail "usage: grow <target>"
  check_path "$1"
  line=$(mount_line "$1")
  [ -n "$line" ] || fail "not mounted: $1"
  target=$1
  set -- $line
  set -- "$(kernel_dev "$1")" "$2" "$3"
  case $1 in /dev/sd*) rescan_disk "${1#/dev/}" ;; esac
  case $3 in
    xfs) xfs_growfs "$target" >&2 || fail "xfs_growfs $target failed" ;;
    ext2|ext3|ext4) resize2fs "$1" >&2 || fail "resize2fs $1 failed" ;;
    *) fail "cannot grow a $3 file system" ;;
  esac
  echo "$(fs_numbers "$target") devsize=$(($(cat "/sys/class/block/${1#/dev/}/size") * 512))"
}

cmd_umount() {  # target (already unmounted is success)
  [ $# -eq 1 ] || fail "usage: umount <target>"
  check_path "$1"
  [ -n "$(mount_line "$1")" ] || { echo "unmounted=0"; return 0; }
  umount "$1" || fail "umount $1 failed"
  echo "unmounted=1"
}

cmd_exec() {  # command-b64: run it with sh -c in the background, output to the console
  [ $# -eq 1 ] || fail "usage: exec <command-b64>"
  line=$(b64 "$1") || exit 1
  [ -n "$line" ] || fail "empty command"
  mkdir -p "$RUN/exec"
  # $$ of the wrapper is the pid we return; it records the exit code under
  # that name (written, then renamed: a reader never sees half a number).
  sh -c 'sh -c "$1"; echo $? > '"$RUN"'/exec/$$.tmp; mv '"$RUN"'/exec/$$.tmp '"$RUN"'/exec/$$.exit' \
    crust-exec "$line" </dev/null >/dev/console 2>&1 &
  pid=$!
  : > "$RUN/exec/$pid.started"
  echo "pid=$pid"
}

cmd_wait() {  # pid: "state=running" or "state=exited code=<n>", never blocks
  [ $# -eq 1 ] || fail "usage: wait <pid>"
  case $1 in ''|*[!0-9]*) fail "bad pid: $1" ;; esac
  [ -e "$RUN/exec/$1.started" ] || fail "no process $1 was started by exec"
  if [ -r "$RUN/exec/$1.exit" ]; then echo "state=exited code=$(cat "$RUN/exec/$1.exit")"; return 0; fi
  [ -d "/proc/$1" ] && { echo "state=running"; return 0; }
  # Gone without recording a code: killed by a signal.
  [ -r "$RUN/exec/$1.exit" ] && { echo "state=exited code=$(cat "$RUN/exec/$1.exit")"; return 0; }
  fail "process $1 ended without an exit code (killed)"
}

cmd_bind() {  # source target ro|rw: give a container its view of a mounted volume
  [ $# -eq 3 ] || fail "usage: bind <source> <target> <ro|rw>"
  check_path "$1"
  check_path "$2"
  case $3 in ro|rw) ;; *) fail "mode must be ro or rw, not $3" ;; esac
  [ -n "$(mount_line "$2")" ] && { echo "already=1"; return 0; }
  if [ -d "$1" ]; then mkdir -p "$2" || fail "mkdir $2 failed"
  else mkdir -p "${2%/*}" && : > "$2" || fail "cannot create $2"; fi
  mount --bind "$1" "$2" || fail "bind $1 -> $2 failed"
  if [ "$3" = ro ]; then
    mount -o remount,bind,ro "$2" || { umount "$2"; fail "read-only remount of $2 failed"; }
  fi
  echo "bound=1"
}

secure_join() {  # root path -> root + path, every symlink on the way resolved inside root
  join_in_root "$1" "$2"
  echo "$joined"
}

join_in_root() {  # root path: secure_join's answer in $joined, without a subshell
  # What runc's filepath-securejoin does: a link is followed as if root
  # were /, ".." stops at root, so no component of the answer lies outside
  # root. Missing components are kept as they are (the caller makes them).
  # Its variables are its own (sj_*): callers keep theirs.
  sj_root=$1 sj_rest=$2 sj_cur= sj_links=0
  while [ -n "$sj_rest" ]; do
    case $sj_rest in /*) sj_rest=${sj_rest#/}; continue ;; esac
    sj_part=${sj_rest%%/*}
    if [ "$sj_part" = "$sj_rest" ]; then sj_rest=; else sj_rest=${sj_rest#*/}; fi
    case $sj_part in
      .) continue ;;
      ..) sj_cur=${sj_cur%/*}; continue ;;
    esac
    if [ -L "$sj_root$sj_cur/$sj_part" ]; then
      sj_links=$((sj_links + 1))
      [ $sj_links -le 40 ] || fail "too many symlinks resolving $2 in $sj_root"
      sj_target=$(readlink "$sj_root$sj_cur/$sj_part") || fail "cannot read the link $sj_cur/$sj_part in $sj_root"
      case $sj_target in /*) sj_cur= ;; esac
      sj_rest=$sj_target${sj_rest:+/$sj_rest}
      continue
    fi
    sj_cur=$sj_cur/$sj_part
  done
  joined=$sj_root$sj_cur
}

cmd_sharemount() {  # target [tag]: a shared directory of the pod (virtio-fs, tag crust by default) at target
  [ $# -eq 1 ] || [ $# -eq 2 ] || fail "usage: sharemount <target> [tag]"
  tag=${2:-crust}
  case $tag in crust|crust-live) ;; *) fail "tag $tag: crust or crust-live" ;; esac
  check_path "$1"
  line=$(mount_line "$1")
  if [ -n "$line" ]; then
    set -- $line
    [ "$1" = "$tag" ] && [ "$3" = virtiofs ] || fail "$2 is already a mount of $1 ($3)"
    echo "mounted=1 already=1"
    return 0
  fi
  load_fs_modules virtiofs
  mkdir -p "$1" || fail "mkdir $1 failed"
  # nodev: the host's device nodes never act in the guest; a container's
  # root keeps suid/exec (its binaries run from there).
  # A device hot-plugged a moment ago (a VM booted ahead of its pod, or
  # restored) may still be probed: its tag is unknown (the mount fails
  # with EINVAL) until the virtio-fs driver's probe has registered it, the
  # probe's last step. The driver's link in sysfs is no sign of that: the
  # kernel makes it before it calls the probe (setting up the queues, and
  # the device with QEMU and virtiofsd, which on a busy host takes long).
  # The sign is the device's DRIVER_OK, which the probe sets just before it
  # registers the tag: the mount is tried again each time one device more
  # has it, and every 200 ms while one has it and the mount still fails
  # (the probe may yield between the two steps).
  # It is looked at every 20 ms without a process (each one costs the
  # guest's one CPU, which the probe needs, under emulation).
  waited=0 seen=-1 again=0
  while :; do
    count_virtiofs
    if [ "$ready" -ne "$seen" ] || { [ "$ready" -gt 0 ] && [ "$waited" -ge "$again" ]; }; then
      seen=$ready again=$((waited + 200))
      mount -t virtiofs -o nodev "$tag" "$1" 2>"$RUN/mount.err" && break
    fi
    [ "$waited" -lt $((DEVICE_WAIT_SECONDS * 1000)) ] ||
      fail "mount of the shared directory (virtio-fs tag $tag) failed: $(cat "$RUN/mount.err")"
    nap
    waited=$((waited + 20))
  done
  echo "mounted=1"
}

count_virtiofs() {  # sets ready: the virtio-fs devices whose driver set DRIVER_OK (no process)
  ready=0
  set +f
  for device in /sys/bus/virtio/drivers/virtiofs/virtio*; do
    # status: the device's status byte in hex; DRIVER_OK is its bit 2.
    read -r device_status 2>/dev/null < "$device/status" &&
      [ $((device_status & 4)) -ne 0 ] && ready=$((ready + 1))
  done
  set -f
}

nap() {  # about 20 ms without a process: a read with a timeout on a fifo nobody writes
  if [ -z "$napping" ]; then
    [ -p "$RUN/pause" ] || mkfifo "$RUN/pause" 2>/dev/null || [ -p "$RUN/pause" ] || fail "cannot make $RUN/pause"
    exec 8<>"$RUN/pause"   # this request's shell only: closed with it
    napping=1
  fi
  read -t 0.02 _ <&8
}

cbind_one() {  # root source destination ro|rw: sets target (and already); root checked by the caller
  # The destination is resolved inside root (secure_join): a link in the
  # image (data -> /run/crust) lands inside the container, never on the
  # guest's own directories. Missing directories are made, as runc makes a
  # mount point: the last one a file when the source is one. The
  # destination is URL-safe base64, or (agent 10) a plain absolute path:
  # "/" is no base64 character. Each process costs the guest's one CPU
  # tens of milliseconds under emulation: a bind forks only for its mkdir
  # and mount.
  check_path "$2"
  case $3 in /*) dest=$3 ;; *) dest=$(b64 "$3") || exit 1 ;; esac
  case $4 in ro|rw) ;; *) fail "mode must be ro or rw, not $4" ;; esac
  [ -e "$2" ] || fail "no such source: $2"
  already=
  join_in_root "$1" "$dest"
  target=$joined
  [ "$target" != "$1" ] || fail "destination $dest is the container's root"
  path_ok "$target" || fail "destination $dest resolves to unsupported characters"
  # What is bound there, kept beside a tree of the targets: "#" is no
  # component of a checked path, so no target's record is another's
  # directory. Read without a fork; /proc/mounts only when it matches.
  record="$RUN/cbind$target/#"
  recorded=
  [ -r "$record" ] && read -r recorded < "$record"
  if [ "$recorded" = "$2" ] && [ -n "$(mount_line "$target")" ]; then
    already=1   # bound by an earlier try of this request
    return 0
  fi
  # Each missing parent is made one at a time below what secure_join
  # returned (all of it inside root, none of it a link).
  parent=${target%/*}
  [ -d "$parent" ] || mkdir -p "$parent" || fail "mkdir ${parent#"$1"} in the container failed"
  [ ! -L "$parent" ] || fail "${parent#"$1"} became a link"
  if [ -d "$2" ]; then
    [ -d "$target" ] || mkdir "$target" || fail "mkdir $dest in the container failed"
  else
    [ -e "$target" ] || : > "$target" || fail "cannot create $dest in the container"
  fi
  [ ! -L "$target" ] || fail "$dest became a link"
  mount --bind "$2" "$target" || fail "bind $2 -> $dest failed"
  if [ "$4" = ro ]; then
    mount -o remount,bind,ro "$target" || { umount "$target"; fail "read-only remount of $dest failed"; }
  fi
  # Recorded by write_records, all of the request's at once.
  record_dirs="$record_dirs ${record%/*}"
  record_lines="$record_lines$record $2$NL"
}

write_records() {  # what cbind_one bound: one mkdir for all the records' directories (the request's exit trap)
  [ -n "$record_lines" ] || return 0
  mkdir -p $record_dirs || fail "cannot record the binds"
  set -- $record_lines   # pairs of words: checked paths hold no blank
  while [ $# -ge 2 ]; do
    printf '%s\n' "$2" > "$1" || fail "cannot record the bind at $1"
    shift 2
  done
}

cmd_cbind() {  # root source destination ro|rw: bind source at destination inside a container's root
  [ $# -eq 4 ] || fail "usage: cbind <root> <source> <destination> <ro|rw>"
  check_path "$1"
  [ -n "$(mount_line "$1")" ] || fail "not mounted: $1"
  record_dirs= record_lines=
  trap write_records EXIT   # also after a failure: what was bound stays, and is known
  cbind_one "$@"
  echo "target=$target${already:+ already=1}"
}

cmd_cbinds() {  # root (source destination ro|rw)...: cbind each, in order (agent 8)
  # One request for all of a container's binds: each request costs a
  # round trip and a shell, about a quarter of a bind under emulation. A
  # failure stops at that bind; the ones before it stay (the host unmounts
  # the container's root and all below it).
  [ $# -ge 4 ] && [ $((($# - 1) % 3)) -eq 0 ] || fail "usage: cbinds <root> (<source> <destination> <ro|rw>)..."
  root=$1
  shift
  check_path "$root"
  [ -n "$(mount_line "$root")" ] || fail "not mounted: $root"
  n=0 targets= record_dirs= record_lines=
  trap write_records EXIT   # also after a failure: the binds before it stay, and are known
  while [ $# -gt 0 ]; do
    n=$((n + 1))
    cbind_one "$root" "$1" "$2" "$3"
    targets="$targets target$n=$target"
    shift 3
  done
  echo "binds=$n$targets"
}

tmpfs_size() {  # size (bytes, or with k/m/g): at most half the guest's memory, in KiB
  # The host's tmpfs is sized for the node (kubelet's bound is the node's
  # allocatable memory without a sizeLimit); the guest has its own, smaller
  # memory: a tmpfs promising more would have its writer, and the pod's
  # other processes, killed by the OOM killer instead of told ENOSPC. Half
  # is what tmpfs takes without a size.
  n=${1%[kmgKMG]}
  case $1 in *[kK]) kib=$n ;; *[mM]) kib=$((n * 1024)) ;; *[gG]) kib=$((n * 1048576)) ;; *) kib=$(((n + 1023) / 1024)) ;; esac
  half=$(($(awk '$1 == "MemTotal:" { print $2 }' /proc/meminfo) / 2))
  [ "$kib" -le "$half" ] || kib=$half
  echo "${kib}k"
}

cmd_reach() {  # path...: each looked up here, in the agent's mount namespace (agent 11)
  # A bind in a share is a submount of it: the guest mounts it on its first
  # lookup, in the namespace that looks, a file system of its own each time.
  # crun binds a container's sources in the container's namespace, a copy of
  # this one: looked up here first, every container of the pod binds the one
  # mount, and sees what the others write as they do (one page cache, one
  # file size for appends); looked up by each crun, each would have its own.
  # A stat of the path itself mounts nothing (the kernel leaves the last
  # component's automount alone); a lookup through it ("$p/.") does.
  [ $# -ge 1 ] || fail "usage: reach <path>..."
  for p in "$@"; do
    check_path "$p"
    if [ -d "$p" ]; then
      [ -e "$p/." ] || fail "cannot reach $p"
    else
      [ -e "$p" ] || fail "no such source: $p"
    fi
  done
  echo "reached=$#"
}

cmd_warm() {  # (agent 12) one throwaway container through crun, before the guest serves a pod
  # Under emulation (tcg) QEMU translates guest code the first time it
  # runs: the first crun start in a guest pays for crun's code and the
  # kernel's paths for namespaces, mounts, cgroups and exec, about 0.1 s
  # more than the next. A pooled VM runs one container of a pod's shape
  # while it waits (/usr/lib/crust/warm.json: an empty root, read-only,
  # with the guest's /bin bound in it), so that the pod's first start is
  # not the first. Nothing stays: crun deletes what it ran, this its bundle.
  [ $# -eq 0 ] || fail "usage: warm"
  spec=/usr/lib/crust/warm.json
  [ -x /sbin/crun ] && [ -r "$spec" ] || fail "this guest has no crun or no $spec"
  bundle=$RUN/warm
  mkdir -p "$bundle/root" "$bundle/dir" 2>/dev/null && : > "$bundle/file" || fail "cannot make $bundle"
  out=$(/sbin/crun --root /run/crust/crun run --bundle "$bundle" --config "$spec" crust-warm </dev/null 2>&1)
  code=$?
  if [ -d /run/crust/crun/crust-warm ]; then
    /sbin/crun --root /run/crust/crun delete --force crust-warm >/dev/null 2>&1
  fi
  rm -rf "$bundle"
  [ "$code" -eq 0 ] && [ "$out" = warm ] || fail "crun ran no container (exit $code): $(one_line "$out")"
  echo "ran=1"
}

cmd_resume() {  # (agent 15) seconds nanoseconds seed-hex: a VM restored from a template, made its own
  # Before anything of a pod runs in it: the host's wall clock, and fresh
  # entropy from the host credited and the kernel's generator reseeded
  # (every VM restored from one template woke with the same generator).
  [ $# -eq 3 ] || fail "usage: resume <seconds> <nanoseconds> <seed-hex>"
  out=$(/usr/lib/crust/resume "$1" "$2" "$3" 2>&1) || fail "resume: $(one_line "$out")"
  echo "$out"
}

cmd_podtmpfs() {  # name subpath-b64 size|-: the pod's tmpfs of that name (an emptyDir of medium Memory, /dev/shm)
  [ $# -eq 3 ] || fail "usage: podtmpfs <name> <subpath-b64> <size|->"
  check_name "$1"
  sub=$(b64 "$2") || exit 1
  case $3 in -) size= ;; *[!0-9kmgKMG]*|'') fail "bad size: $3" ;; *) size=,size=$(tmpfs_size "$3") ;; esac
  # A subPath in it is bound from a descriptor (subpath), never joined here.
  [ -z "$sub" ] || fail "podtmpfs takes no subpath ($sub): subpath binds one"
  top=$RUN/podtmpfs/$1
  if [ -z "$(mount_line "$top")" ]; then
    mkdir -p "$top" || fail "mkdir $top failed"
    # As kubelet makes an emptyDir: world-writable, for any user of the pod.
    mount -t tmpfs -o "nosuid,nodev,mode=0777$size" "crust-$1" "$top" || fail "mount of the tmpfs $1 failed"
  fi
  echo "path=$top"
}

# A volume kubelet's atomic writer updates (configMap, secret, projected,
# downward API), copied into the guest's memory and kept in step with the
# host: each version the writer publishes (a ..<timestamp> directory that
# ..data is renamed to point at) is copied whole, then the copy's own ..data
# is renamed over, then the names are linked and the old version removed, in
# the writer's order. A read in the guest then walks a tmpfs, as a read on
# the host walks the writer's files: it never finds a version half gone (a
# walk through virtio-fs takes a round trip per name, long enough for the
# writer to remove the version it started in). Secrets stay in memory.
mirror_sync() {  # source target staging
  src=$1 dst=$2 new=$3
  cur=$(readlink "$src/..data") || return 1
  case $cur in ..?*) ;; *) return 1 ;; esac
  case $cur in */*|..data|..data_tmp) return 1 ;; esac
  prev=$(readlink "$dst/..data" 2>/dev/null)
  if [ "$prev" != "$cur" ]; then
    if [ ! -d "$dst/$cur" ] || [ -L "$dst/$cur" ]; then
      rm -rf "$new"
      # A version is never changed once published, only removed, and only
      # once ..data names a newer one. A removal can cut a copy short
      # without failing it (cp lists the directory after the file went: an
      # empty copy), so the copy counts only if ..data still names cur
      # after it: then nothing of cur was removed while it was copied.
      cp -a "$src/$cur" "$new" || { rm -rf "$new"; return 1; }
      [ "$(readlink "$src/..data")" = "$cur" ] || { rm -rf "$new"; return 1; }
      mv "$new" "$dst/$cur" || return 1
    fi
    ln -sfn "$cur" "$dst/..data_tmp" && mv -T "$dst/..data_tmp" "$dst/..data" || return 1
  fi
  set +f
  for e in "$src"/* "$src"/.[!.]*; do
    name=${e##*/}
    if [ -L "$e" ]; then   # the names the writer links into ..data
      want=$(readlink "$e")
      [ "$(readlink "$dst/$name" 2>/dev/null)" = "$want" ] || ln -sfn "$want" "$dst/$name"
    elif [ -d "$e" ]; then   # a mount point made for a volume below this one: its place, empty
      [ -d "$dst/$name" ] || mkdir "$dst/$name"
    elif [ -f "$e" ]; then
      [ -e "$dst/$name" ] || : > "$dst/$name"
    fi
  done
  for e in "$dst"/* "$dst"/.[!.]*; do
    [ -L "$e" ] || continue
    [ -L "$src/${e##*/}" ] || rm -f "$e"
  done
  # The version just replaced stays until the next pass (0.25 s): a reader
  # that resolved ..data to it a moment ago still opens its file.
  for e in "$dst"/..?*; do
    case ${e##*/} in ..data|"$cur"|"$prev") continue ;; esac
    [ -d "$e" ] && [ ! -L "$e" ] && rm -rf "$e"
  done
  set -f
  return 0
}

cmd_mirror() {  # name source: a copy of the atomic-writer volume bound at source (in a share), kept in step
  [ $# -eq 2 ] || fail "usage: mirror <name> <source>"
  check_name "$1"
  check_path "$2"
  case $2 in "$RUN"/live/*|"$RUN"/share/*) ;; *) fail "the source must lie in a share of the pod ($RUN/live)" ;; esac
  [ -L "$2/..data" ] || fail "$2 is not laid out by kubelet's atomic writer (no ..data)"
  dst=$RUN/mirror/$1
  if [ ! -e "$RUN/mirror/.$1.running" ]; then
    mkdir -p "$dst" || fail "mkdir $dst failed"
    chown "$(stat -c %u:%g "$2")" "$dst" && chmod "$(stat -c %a "$2")" "$dst" || fail "cannot give $dst its source's owner and mode"
    tries=10
    until mirror_sync "$2" "$dst" "$RUN/mirror/.$1.new"; do   # a version removed while it was copied: the next one
      tries=$((tries - 1))
      [ "$tries" -gt 0 ] || fail "cannot copy $2"
      usleep 100000
    done
    # Polled: a virtio-fs share gives the guest no notice of the host's changes.
    (
      trap '' HUP
      while [ -d "$dst" ]; do
        usleep 250000
        mirror_sync "$2" "$dst" "$RUN/mirror/.$1.new" 2>/dev/null
      done
    ) </dev/null >/dev/null 2>&1 3>&- &
    echo $! > "$RUN/mirror/.$1.running"
  fi
  echo "path=$dst"
}

cmd_spawnfile() {  # name script: sh <script> in the background, stdout and stderr to files
  # The host writes the script into the pod's share (a file, so a command of
  # any size the kernel takes travels without a long line on this port).
  [ $# -eq 2 ] || fail "usage: spawnfile <name> <script>"
  new_output "$1"
  check_path "$2"
  case $2 in "$RUN"/share/*) ;; *) fail "the script must lie in the pod's share ($RUN/share)" ;; esac
  [ -f "$2" ] || fail "no script $2"
  # Copied into the guest's memory before the answer: the host may remove
  # its file as soon as it has it.
  mkdir -p "$RUN/cmd"
  cp "$2" "$RUN/cmd/$1.sh" || fail "cannot copy the script $2"
  run_with_output "$1" "" "$RUN/cmd/$1.sh"
}

cmd_subpath() {  # [strict] root subpath-b64 container index: a subPath of a volume, bound from a descriptor
  # A container of the pod may swap a directory of a shared volume for a
  # symlink while another container's subPath is resolved in it: the path
  # is never resolved as a string. beneath (guest/beneath.c) opens it below
  # root without leaving it and binds exactly what it opened at a place of
  # the agent's own, which crun then binds into the container.
  # strict: a deferred volume's (it must exist and pass no symlink).
  strict=
  [ "${1:-}" = strict ] && { strict=--strict; shift; }
  [ $# -eq 4 ] || fail "usage: subpath [strict] <root> <subpath-b64> <container> <index>"
  check_path "$1"
  sub=$(b64 "$2") || exit 1
  check_name "$3"
  case $4 in ''|*[!0-9]*) fail "bad index: $4" ;; esac
  dir=$RUN/subpath/$3
  mkdir -p "$dir" || fail "mkdir $dir failed"
  target=$dir/$4
  # A CreateContainer tried again binds afresh.
  while [ -n "$(mount_line "$target")" ]; do umount "$target" || fail "umount $target failed"; done
  out=$(/usr/lib/crust/beneath $strict "$1" "$sub" "$target" 2>&1) || fail "$(one_line "$out")"
  echo "path=$target $out"
}

cmd_subpathdrop() {  # container: its subPath binds unmounted and their places removed
  [ $# -eq 1 ] || fail "usage: subpathdrop <container>"
  check_name "$1"
  dir=$RUN/subpath/$1
  [ -d "$dir" ] || { echo "dropped=0"; return 0; }
  for m in $(awk -v p="$dir/" 'index($2, p) == 1 { print $2 }' /proc/mounts | tac); do
    umount "$m" || fail "umount $m failed"
  done
  # Never rm -r: a place still mounted would be emptied through its mount.
  set +f
  for e in "$dir"/*; do
    [ -e "$e" ] || continue
    if [ -d "$e" ]; then rmdir "$e"; else rm -f "$e"; fi || fail "$e could not be removed"
  done
  set -f
  rmdir "$dir" || fail "$dir could not be removed"
  echo "dropped=1"
}

cmd_checkpath() {  # root subpath-b64: the subpath exists below root and passes no symlink
  [ $# -eq 2 ] || fail "usage: checkpath <root> <subpath-b64>"
  check_path "$1"
  sub=$(b64 "$2") || exit 1
  case /$sub/ in */../*|*/./*|//*) fail "subpath $sub escapes the volume" ;; esac
  path=$1
  old_ifs=$IFS; IFS=/
  for part in $sub; do
    IFS=$old_ifs
    [ -n "$part" ] || continue
    path=$path/$part
    [ -L "$path" ] && fail "subpath $sub goes through a symlink ($part)"
    [ -e "$path" ] || fail "subpath $sub does not exist in the volume"
    IFS=/
  done
  IFS=$old_ifs
  echo "ok=1"
}

cmd_kill() {  # pid: kill a process started by exec, and its children
  [ $# -eq 1 ] || fail "usage: kill <pid>"
  case $1 in ''|*[!0-9]*) fail "bad pid: $1" ;; esac
  [ -e "$RUN/exec/$1.started" ] || fail "no process $1 was started by exec"
  set +f   # the /proc glob (this runs in a subshell)
  for child in $(cat /proc/[0-9]*/stat 2>/dev/null | awk -v p="$1" '$4 == p {print $1}'); do
    kill -KILL "$child" 2>/dev/null
  done
  kill -KILL "$1" 2>/dev/null
  echo "killed=1"
}

check_name() {  # a host-chosen word naming a process's output files
  case $1 in ''|*[!A-Za-z0-9_.-]*) fail "bad name: $1" ;; esac
}

new_output() {  # name: a name never used yet for a process's output files
  check_name "$1"
  mkdir -p "$RUN/exec" "$RUN/out"
  # One process per name: its output files are never reused or truncated.
  [ -e "$RUN/out/$1.out" ] && fail "a process named $1 was spawned already"
  return 0
}

run_with_output() {  # name -c|"" command-or-script: start it, stdout and stderr to name's files
  out=$RUN/out/$1.out err=$RUN/out/$1.err
  : > "$out" && : > "$err" || fail "cannot create the output files of $1"
  # As exec: the wrapper's pid is returned; its one child runs the command
  # (and becomes the command's process, sh -c exec'ing it).
  sh -c 'sh '"$2"' "$1" >"$2" 2>"$3"; echo $? > '"$RUN"'/exec/$$.tmp; mv '"$RUN"'/exec/$$.tmp '"$RUN"'/exec/$$.exit' \
    crust-spawn "$3" "$out" "$err" </dev/null >/dev/null 2>&1 &
  pid=$!
  : > "$RUN/exec/$pid.started"
  echo "pid=$pid"
}

cmd_spawn() {  # name command-b64: sh -c in the background, stdout and stderr to files
  [ $# -eq 2 ] || fail "usage: spawn <name> <command-b64>"
  new_output "$1"
  line=$(b64 "$2") || exit 1
  [ -n "$line" ] || fail "empty command"
  run_with_output "$1" -c "$line"
}

cmd_readout() {  # name out|err offset max: up to max bytes from offset, URL-safe base64
  [ $# -eq 4 ] || fail "usage: readout <name> <out|err> <offset> <max>"
  check_name "$1"
  case $2 in out|err) ;; *) fail "stream must be out or err, not $2" ;; esac
  case $3 in ''|*[!0-9]*) fail "bad offset: $3" ;; esac
  case $4 in ''|*[!0-9]*) fail "bad max: $4" ;; esac
  f=$RUN/out/$1.$2
  [ -e "$f" ] || fail "no output $1.$2"
  size=$(stat -c %s "$f")
  if [ "$3" -ge "$size" ] || [ "$4" -eq 0 ]; then echo "size=$size data=-"; return 0; fi
  # One read at the offset (dd seeks): reading from the start each time
  # would make a large output's copy quadratic.
  data=$(dd if="$f" bs="$4" skip="$3" iflag=skip_bytes count=1 2>/dev/null | base64 | tr -d '\n' | tr '+/' '-_')
  echo "size=$size data=${data:--}"
}

cmd_poll() {  # name:pid...: for each, name=<stdout size>,<stderr size>,<state>
  # What the host needs to know about the processes it waits on or reads
  # from, in one request: each process's state ("run", its exit code, "gone"
  # when it ended without one, "none" when no spawn started it), taken before
  # the sizes (an ended process's sizes are final), and the sizes of its
  # output files ("-" for a missing one). One fork (stat) however many.
  [ $# -gt 0 ] || fail "usage: poll <name:pid>..."
  states= files=
  for word in "$@"; do
    name=${word%%:*} pid=${word#*:}
    check_name "$name"
    case $pid in ''|*[!0-9]*) fail "bad pid in $word" ;; esac
    if [ ! -e "$RUN/exec/$pid.started" ]; then state=none
    elif [ -r "$RUN/exec/$pid.exit" ]; then read -r state < "$RUN/exec/$pid.exit"
    elif [ -d "/proc/$pid" ]; then state=run
    elif [ -r "$RUN/exec/$pid.exit" ]; then read -r state < "$RUN/exec/$pid.exit"
    else state=gone; fi
    states="$states $name:${state:-gone}"
    files="$files $RUN/out/$name.out $RUN/out/$name.err"
  done
  sizes=$(stat -c '%n:%s' $files 2>/dev/null)
  answer=
  for word in $states; do
    name=${word%%:*} out=- err=-
    for size in $sizes; do
      case $size in
        "$RUN/out/$name.out:"*) out=${size##*:} ;;
        "$RUN/out/$name.err:"*) err=${size##*:} ;;
      esac
    done
    answer="$answer $name=$out,$err,${word#*:}"
  done
  echo $answer
}

cmd_cstarted() {  # id pid [wait-ms]: started=1 once crun started the container, exited=1 once pid ended
  # The host asks this until the container runs. crun's state (cstate) would
  # run crun each time, which costs the guest's one CPU while crun is still
  # starting the container; this reads what crun state reads: its state
  # file written and no start pending (exec.fifo). With wait-ms (agent 11)
  # it answers as soon as either is true, or after about that long: one
  # request instead of one every few tens of milliseconds, each a shell
  # taken from crun's start. The wait forks nothing: a read with a timeout
  # on a fifo nobody writes.
  [ $# -eq 2 ] || [ $# -eq 3 ] || fail "usage: cstarted <id> <pid> [wait-ms]"
  check_name "$1"
  case $2 in ''|*[!0-9]*) fail "bad pid: $2" ;; esac
  wait_ms=${3:-0}
  case $wait_ms in ''|*[!0-9]*) fail "bad wait: $wait_ms" ;; esac
  [ "$wait_ms" -le 5000 ] || fail "wait at most 5000 ms, not $wait_ms"
  # pid: spawn's, or the Python agent's (whose exit is seen as its pid gone).
  waited=0
  while :; do
    if [ -e "$RUN/exec/$2.exit" ] || [ ! -d "/proc/$2" ]; then echo "started=0 exited=1"; return 0; fi
    if [ -e "/run/crust/crun/$1/status" ] && [ ! -e "/run/crust/crun/$1/exec.fifo" ]; then
      hold_namespace "$1"
      echo "started=1 exited=0"
      return 0
    fi
    [ "$waited" -lt "$wait_ms" ] || break
    nap
    waited=$((waited + 20))
  done
  echo "started=0 exited=0"
}

hold_namespace() {  # id: the started container's mount namespace, held until cforget (agent 14)
  # A container's processes mount the share's submounts they reach first
  # in its namespace (one the host mounted below a followed bind): its last
  # exit would unmount them, maybe with a file's release still in flight,
  # which stops this kernel at a BUG (crust.kata.pods says more). Held by a
  # bind of the namespace, it ends at cforget instead, long after the exit.
  # A container already gone has nothing to hold.
  [ ! -e "$RUN/ns/$1" ] || return 0
  pid=
  read -r pid < "/sys/fs/cgroup/crust/$1/ctr/cgroup.procs" 2>/dev/null
  [ -n "$pid" ] || return 0
  [ -d "$RUN/ns" ] || mkdir -p "$RUN/ns" || return 0
  : > "$RUN/ns/$1"
  mount --bind "/proc/$pid/ns/mnt" "$RUN/ns/$1" 2>/dev/null || rm -f "$RUN/ns/$1"
}

release_namespace() {  # id: what hold_namespace held (the container's mounts go now)
  [ -e "$RUN/ns/$1" ] || return 0
  umount "$RUN/ns/$1" 2>/dev/null
  rm -f "$RUN/ns/$1" || fail "cannot remove the hold of $1's mount namespace"
}

children_of() {  # pid -> its direct children
  cat /proc/[0-9]*/stat 2>/dev/null | awk -v p="$1" '$4 == p {print $1}'
}

cmd_signal() {  # pid signal: signal the process a spawn (or exec) runs
  [ $# -eq 2 ] || fail "usage: signal <pid> <signal>"
  case $1 in ''|*[!0-9]*) fail "bad pid: $1" ;; esac
  case $2 in ''|*[!0-9]*) fail "bad signal: $2" ;; esac
  [ -e "$RUN/exec/$1.started" ] || fail "no process $1 was started by spawn or exec"
  n=0
  set +f
  for child in $(children_of "$1"); do
    # The child is crun for a container's process (agent 5): it forwards
    # what it gets, but SIGKILL and SIGSTOP end or stop crun itself, so
    # those go to its child too, the process crun started.
    if [ "$2" = 9 ] || [ "$2" = 19 ]; then
      for grandchild in $(children_of "$child"); do kill -"$2" "$grandchild" 2>/dev/null; done
    fi
    kill -"$2" "$child" 2>/dev/null && n=$((n + 1))
  done
  echo "signalled=$n"
}

cmd_csignal() {  # id signal: signal every process in a container's cgroup (/crust/<id>); 0 counts them
  [ $# -eq 2 ] || fail "usage: csignal <id> <signal>"
  check_name "$1"
  case $2 in ''|*[!0-9]*) fail "bad signal: $2" ;; esac
  cg=/sys/fs/cgroup/crust/$1
  n=0
  [ -d "$cg" ] || { echo "signalled=0"; return 0; }
  set +f
  for pid in $(cat $(find "$cg" -name cgroup.procs) 2>/dev/null); do
    kill -"$2" "$pid" 2>/dev/null && n=$((n + 1))
  done
  echo "signalled=$n"
}

cmd_signalroot() {  # root signal: signal every process whose root directory is root
  [ $# -eq 2 ] || fail "usage: signalroot <root> <signal>"
  check_path "$1"
  case $2 in ''|*[!0-9]*) fail "bad signal: $2" ;; esac
  n=0
  set +f
  for d in /proc/[0-9]*; do
    [ "$(readlink "$d/root" 2>/dev/null)" = "$1" ] || continue
    kill -"$2" "${d#/proc/}" 2>/dev/null && n=$((n + 1))
  done
  echo "signalled=$n"
}

dev_template() {  # the nodes and links every container's /dev starts with, made once per guest
  t=$RUN/dev.template
  [ -d "$t" ] && return 0
  rm -rf "$t.new" && mkdir -p "$t.new/shm" "$t.new/pts" || fail "cannot make $t"
  for node in "null 1 3" "zero 1 5" "full 1 7" "random 1 8" "urandom 1 9" "tty 5 0"; do
    set -- $node
    mknod -m 666 "$t.new/$1" c "$2" "$3" || fail "mknod $t.new/$1 failed"
  done
  ln -s /proc/self/fd "$t.new/fd" && ln -s /proc/self/fd/0 "$t.new/stdin" &&
    ln -s /proc/self/fd/1 "$t.new/stdout" && ln -s /proc/self/fd/2 "$t.new/stderr" &&
    mv "$t.new" "$t" || fail "cannot make $t"
}

cmd_ctrsetup() {  # root: /proc and a small /dev in a container's root (the image's /tmp stays as runc leaves it)
  [ $# -eq 1 ] || fail "usage: ctrsetup <root>"
  check_path "$1"
  r=$1
  # One read of the mount table for the three questions (each process
  # costs the guest's one CPU tens of milliseconds under emulation).
  set -- $(awk -v r="$r" '$2 == r { m = 1 } $2 == r "/proc" { p = 1 } $2 == r "/dev" { d = 1 }
                          END { print m + 0, p + 0, d + 0 }' /proc/mounts)
  [ "$1" = 1 ] || fail "not mounted: $r"
  # /sys too: the OCI runtime mounts sysfs there, after a read-only root.
  mkdir -p "$r/proc" "$r/dev" "$r/sys" || fail "cannot make /proc, /dev, /sys in $r"
  if [ "$2" = 0 ]; then
    mount -t proc -o nosuid,nodev,noexec proc "$r/proc" || fail "mount of proc in $r failed"
  fi
  if [ "$3" = 0 ]; then
    dev_template
    mount -t tmpfs -o nosuid,noexec,mode=0755,size=1m tmpfs "$r/dev" || fail "mount of /dev in $r failed"
    # null, zero, full, random, urandom, tty (mode 666), fd, stdin, stdout, stderr, shm, pts
    cp -a "$RUN/dev.template/." "$r/dev/" || fail "cannot fill /dev in $r"
    mount -t tmpfs -o nosuid,nodev,mode=1777 shm "$r/dev/shm" || fail "mount of /dev/shm in $r failed"
  fi
  echo "ok=1"
}

cmd_podpid() {  # the pod's PID namespace: the pid of its init (catatonit -P, which reaps what it inherits)
  [ $# -eq 0 ] || fail "usage: podpid"
  if [ -s "$RUN/podpid" ]; then
    pid=$(cat "$RUN/podpid")
    if [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = /sbin/catatonit ]; then echo "pid=$pid"; return 0; fi
  fi
  /sbin/unshare --pid --fork -- /sbin/catatonit -P </dev/null >/dev/null 2>&1 &
  holder=$!
  set +f
  n=0
  pid=$(children_of "$holder")
  while [ -z "$pid" ]; do
    n=$((n + 1))
    [ $n -lt 250 ] || fail "the pod's PID namespace did not start"
    usleep 20000
    pid=$(children_of "$holder")
  done
  echo "$pid" > "$RUN/podpid"
  echo "pid=$pid"
}

cmd_cstate() {  # id: the container's state in crun (created, running, stopped) or absent
  [ $# -eq 1 ] || fail "usage: cstate <id>"
  check_name "$1"
  if [ ! -e "/run/crust/crun/$1/status" ]; then echo "state=absent"; return 0; fi
  state=$(/sbin/crun --root /run/crust/crun state "$1" 2>/dev/null | sed -n 's/^ *"status": *"\([a-z]*\)".*/\1/p')
  echo "state=${state:-absent}"
}

cmd_cforget() {  # id: a deleted container's state in crun and its bundle (already gone is success)
  [ $# -eq 1 ] || fail "usage: cforget <id>"
  check_name "$1"
  if [ -d "/run/crust/crun/$1" ]; then
    /sbin/crun --root /run/crust/crun delete --force "$1" >/dev/null 2>&1 ||
      fail "crun delete $1: $(/sbin/crun --root /run/crust/crun delete --force "$1" 2>&1 | one_line)"
  fi
  # The cgroup crun's lives in (guest_oci: it keeps the OOM count after the exit).
  cg=/sys/fs/cgroup/crust/$1
  if [ -d "$cg" ]; then
    rmdir "$cg/ctr" 2>/dev/null
    rmdir "$cg" || fail "the cgroup of $1 is not empty: processes of it still run"
  fi
  release_namespace "$1"
  rm -rf "/run/crust/bundles/$1"
  echo "forgotten=1"
}

cmd_netconf() {  # mac mtu addresses-b64 routes-b64: the pod's network on the NIC with that MAC address
  # The host read them from the pod's network namespace (crust/sys/podnet.py):
  # addresses are "ip/prefix" words, routes "destination,gateway" words.
  [ $# -eq 4 ] || fail "usage: netconf <mac> <mtu> <addresses-b64> <routes-b64>"
  mac=$1 mtu=$2
  case $mac in [0-9a-f][0-9a-f]:[0-9a-f][0-9a-f]:[0-9a-f][0-9a-f]:[0-9a-f][0-9a-f]:[0-9a-f][0-9a-f]:[0-9a-f][0-9a-f]) ;;
    *) fail "bad MAC address: $mac" ;; esac
  case $mtu in ''|*[!0-9]*) fail "bad MTU: $mtu" ;; esac
  addresses=$(b64 "$3") || exit 1
  routes=$(b64 "$4") || exit 1
  case "$addresses $routes" in *[!0-9a-fA-F.:/,\ default-]*) fail "unsupported characters in addresses or routes" ;; esac
  dev=
  set +f
  tries=$((DEVICE_WAIT_SECONDS * 10))   # a NIC hot-plugged a moment ago may still be probed
  while :; do
    for d in /sys/class/net/*; do
      [ "$(cat "$d/address" 2>/dev/null)" = "$mac" ] && dev=${d##*/}
    done
    [ -n "$dev" ] && break
    tries=$((tries - 1))
    [ "$tries" -gt 0 ] || break
    usleep 100000
  done
  set -f
  [ -n "$dev" ] || fail "no network interface with MAC address $mac (virtio-net not plugged?)"
  if [ "$dev" != eth0 ]; then
    ip link set dev "$dev" down && ip link set dev "$dev" name eth0 || fail "cannot name $dev eth0"
  fi
  ip link set dev eth0 mtu "$mtu" || fail "cannot set MTU $mtu on eth0"
  for a in $addresses; do
    ip addr show dev eth0 | grep -q " ${a} " || ip addr add "$a" dev eth0 || fail "cannot add address $a"
  done
  ip link set dev eth0 up || fail "cannot bring eth0 up"
  for r in $routes; do
    dst=${r%%,*} gw=${r#*,}
    family=-4
    case $gw in *:*) family=-6 ;; esac
    ip "$family" route replace "$dst" via "$gw" dev eth0 || fail "cannot route $dst via $gw"
  done
  echo "device=eth0 addresses=$(echo $addresses | tr ' ' ,)"
}

cmd_cstats() {  # id|-: a container's cgroup v2 numbers in the guest ("-": all of the pod's containers)
  # One word per value: <file>.<key>=<n> for the keyed files (cpu.stat,
  # memory.stat, memory.events), <file>=<n> for the single values
  # (memory.current, memory.max, pids.current, pids.max; "max" is no limit).
  [ $# -eq 1 ] || fail "usage: cstats <id|->"
  if [ "$1" = - ]; then cg=/sys/fs/cgroup/crust
  else check_name "$1"; cg=/sys/fs/cgroup/crust/$1; fi
  [ -d "$cg" ] || fail "no cgroup for $1"
  files=
  for f in cpu.stat memory.stat memory.events memory.current memory.max pids.current pids.max; do
    [ -r "$cg/$f" ] && files="$files $cg/$f"
  done
  [ -n "$files" ] || fail "the cgroup of $1 has no cpu, memory or pids files"
  awk 'FNR == 1 { n = FILENAME; sub(".*/", "", n); sub("[.]stat$", "", n) }
       NF == 2 { printf "%s.%s=%s ", n, $1, $2 }
       NF == 1 { printf "%s=%s ", n, $1 }' $files
}

cmd_ttysize() {  # pid columns rows: the size of the terminal a process spawned with one runs on
  # The spawn wrapper's child is util-linux script, whose child holds the
  # terminal as its standard input; the kernel tells the terminal's
  # foreground processes (SIGWINCH).
  [ $# -eq 3 ] || fail "usage: ttysize <pid> <columns> <rows>"
  case $1$2$3 in ''|*[!0-9]*) fail "pid, columns and rows are numbers" ;; esac
  [ -e "$RUN/exec/$1.started" ] || fail "no process $1 was started by spawn"
  set +f
  for runner in $(children_of "$1"); do
    for held in $(children_of "$runner"); do
      tty=$(readlink "/proc/$held/fd/0" 2>/dev/null)
      case $tty in /dev/pts/[0-9]*) stty -F "$tty" cols "$2" rows "$3" || fail "stty on $tty failed"
                                    echo "tty=$tty"; return 0 ;; esac
    done
  done
  fail "process $1 has no terminal (or ended)"
}

cmd_readonly() {  # target: make this mount read-only (a bind remount: the file system and its other mounts keep their mode)
  [ $# -eq 1 ] || fail "usage: readonly <target>"
  check_path "$1"
  [ -n "$(mount_line "$1")" ] || fail "not mounted: $1"
  mount -o remount,bind,ro "$1" || fail "read-only remount of $1 failed"
  echo "readonly=1"
}

cmd_forget() {  # name: remove a spawned process's output files (they live in the guest's memory)
  [ $# -eq 1 ] || fail "usage: forget <name>"
  check_name "$1"
  rm -f "$RUN/out/$1.out" "$RUN/out/$1.err" "$RUN/cmd/$1.sh" "$RUN/cmd/$1.json" "$RUN/in/$1"
  echo "forgotten=1"
}

cmd_umountall() {  # root: unmount root and every mount below it, the last mounted first
  [ $# -eq 1 ] || fail "usage: umountall <root>"
  check_path "$1"
  n=0
  for m in $(awk -v p="$1" '$2 == p || index($2, p "/") == 1 { print $2 }' /proc/mounts | tac); do
    umount "$m" 2>/dev/null || { usleep 200000; umount "$m"; } || fail "umount $m failed"
    n=$((n + 1))
  done
  # cbind's records of the binds below it go with them.
  rm -rf "$RUN/cbind$1"
  echo "unmounted=$n"
}

# -- encrypted volumes (LUKS2) --------------------------------------------------------
# The key arrives as one word of the request (URL-safe base64) over this
# private serial line and goes to cryptsetup on stdin only: printf is a
# shell builtin, so no command line in the guest's ps ever holds it, and no
# message of these commands repeats it. cryptsetup runs with
# --disable-keyring: the volume key stays in the dm table, so a resize
# needs no passphrase.

luks_key() {  # key-b64 -> the key's bytes on stdout (never echoes the input)
  printf '%s' "$1" | tr '_-' '/+' | base64 -d
}

dm_sysfs() {  # block device node -> its /sys/dev/block directory
  set -- $(stat -L -c '%t %T' "$1") || return 1
  echo "/sys/dev/block/$((0x$1)):$((0x$2))"
}

check_dm_name() {
  case $1 in crypt-*) ;; *) fail "bad encrypted volume name: $1" ;; esac
  case $1 in *[!a-z0-9-]*) fail "bad encrypted volume name: $1" ;; esac
}

# The one shape crust makes (crust/kata/guest/luks2-shape.jq checks it
# field by field before any open): every parameter named, none left to
# cryptsetup's defaults, which change between its releases and with the
# device (the sector size is auto-detected otherwise). Key slot PBKDF2 with
# the minimum iterations: argon2's memory-hard defaults (up to 1 GiB) do not
# fit this VM and take seconds under emulation, and the passphrase is a
# random Secret, not a password (docs/design.md). With integrity the data
# is authenticated (dm-integrity, HMAC-SHA256 per 4 KiB sector).
LUKS_SHAPE=/usr/lib/crust/luks2-shape.jq
LUKS_HEADER_COPY_BYTES=1048576   # the metadata and crust's key slot area fit in the first MiB
LUKS_FORMAT="--type luks2 --cipher aes-xts-plain64 --key-size 512 --hash sha256 --pbkdf pbkdf2
  --pbkdf-force-iterations 1000 --luks2-metadata-size 16k --luks2-keyslots-size 16744448 --offset 32768"

probe_blank() {  # device -> "blank" or "luks <version>"; anything else fails, naming what blkid said
  # The rule the host's crust/sys/fs.py keeps too: blank only when the
  # device reads and `blkid -p` (a low-level probe, no cache) exits 2 with
  # nothing to say. A file system, a partition table, any other signature
  # and any other exit (8: more than one signature, ambivalent) is not
  # blank, and is never formatted over.
  dd if="$1" of=/dev/null bs=4096 count=1 2>/dev/null || fail "$1 cannot be read: not treated as blank"
  found=$(/sbin/blkid -p -o export "$1" 2>&1)
  rc=$?
  if [ $rc -eq 2 ] && [ -z "$found" ]; then echo blank; return 0; fi
  [ $rc -eq 0 ] || fail "$1: blkid -p exited $rc${found:+ ($(one_line "$found"))}: not blank, refusing to format over it"
  # Values come from the disk: read by sed, never evaluated.
  kind=$(printf '%s\n' "$found" | sed -n 's/^TYPE=//p')
  table=$(printf '%s\n' "$found" | sed -n 's/^PTTYPE=//p')
  usage=$(printf '%s\n' "$found" | sed -n 's/^USAGE=//p')
  if [ "$kind" = crypto_LUKS ] && [ -z "$table" ]; then
    echo "luks $(printf '%s\n' "$found" | sed -n 's/^VERSION=//p')"
    return 0
  fi
  fail "$1 holds${kind:+ TYPE=$kind}${table:+ PTTYPE=$table}${usage:+ USAGE=$usage}: not blank and not LUKS2, refusing to format over it"
}

cmd_probe() {  # serial: what luksopen would make of the disk (blank, LUKS, or refused, saying why)
  [ $# -eq 1 ] || fail "usage: probe <serial>"
  case $1 in ''|*[!A-Za-z0-9_.-]*) fail "bad serial: $1" ;; esac
  dev=$(find_disk "$1") || fail "no virtio disk with serial $1 after ${DISK_WAIT_SECONDS}s"
  probed=$(probe_blank "/dev/$dev") || exit 1
  set -- $probed
  echo "kind=$1${2:+ version=$2}"
}

luks_header_copy() {  # device copy integrity: copy the header into guest memory and check it there
  # What is checked is what is opened: cryptsetup open reads the copy
  # (--header), so a disk rewritten after this copy changes nothing. The
  # copy is a sparse file of the header's full 16 MiB (cryptsetup wants
  # that size) of which the first MiB is data.
  rm -f "$2"
  dd if="$1" of="$2" bs=65536 count=$((LUKS_HEADER_COPY_BYTES / 65536)) iflag=direct 2>/dev/null ||
    fail "cannot read the LUKS2 header of $1"
  truncate -s 16777216 "$2" || fail "cannot size the copy of the LUKS2 header of $1"
  magic=$(head -c 8 "$2" | od -An -tx1 | tr -d ' \n')
  case $magic in
    4c554b53babe0002) ;;
    4c554b53babe0001) fail "$1 has a LUKS1 header: crust makes and opens LUKS2 only" ;;
    *) fail "$1 has no LUKS2 header at its start (found $magic): refusing to open it" ;;
  esac
  metadata=$(cryptsetup luksDump --dump-json-metadata "$2" 2>&1) ||
    fail "the LUKS2 header of $1 does not read: $(one_line "$metadata" | tail -c 300)"
  wrong=$(printf '%s' "$metadata" | jq -r --arg integrity "$3" -f "$LUKS_SHAPE" 2>&1) ||
    fail "the LUKS2 metadata of $1 does not parse: $(one_line "$wrong" | tail -c 300)"
  [ -z "$wrong" ] || fail "the LUKS2 header of $1 is not one crust makes, refusing to open it: $wrong"
}

luks_opened_as_made() {  # name integrity disk: the kernel's table of the mapping is the one crust makes
  # Read from the kernel (dmsetup), never from cryptsetup status, which
  # describes the header on the disk: the disk's owner writes that.
  name=$1 integrity=$2 disk=$(cat "/sys/block/$3/dev") || return 1
  table=$(dmsetup table "$name" 2>/dev/null) || return 1
  set -- $table
  # start length crypt cipher key(hex, hidden) iv_offset device offset [n options...]
  [ "$1" = 0 ] && [ "$3" = crypt ] && [ "$6" = 0 ] || return 1
  if [ -z "$integrity" ]; then
    [ $# -eq 8 ] && [ "$4" = aes-xts-plain64 ] && [ ${#5} -eq 128 ] && [ "$7" = "$disk" ] && [ "$8" = 32768 ]
    return
  fi
  [ $# -eq 11 ] && [ "$4" = 'capi:authenc(hmac(sha256),xts(aes))-plain64' ] && [ ${#5} -eq 192 ] &&
    [ "$8" = 0 ] && [ "$9" = 2 ] && [ "${10}" = integrity:32:aead ] && [ "${11}" = sector_size:4096 ] || return 1
  below=$7
  [ "$(dmsetup info -c --noheadings -o major,minor "${name}_dif" 2>/dev/null | tr -d ' ')" = "$below" ] || return 1
  set -- $(dmsetup table "${name}_dif" 2>/dev/null)
  # start length integrity device offset tag_size mode ...
  [ "$3" = integrity ] && [ "$4" = "$disk" ] && [ "$5" = 32768 ] && [ "$6" = 32 ] && [ "$7" = J ]
}

cmd_luksopen() {  # serial fstype name key-b64 [integrity]: open crust's LUKS2 volume; a blank device is
  # luksFormatted (then formatted with fstype inside) first; a LUKS2 header crust made is opened from a
  # checked copy; anything else is refused, and nothing is written to the device
  [ $# -eq 4 ] || [ $# -eq 5 ] || fail "usage: luksopen <serial> <fstype> <name> <key-b64> [none|hmac-sha256]"
  serial=$1 fstype=$2 dm=$3 integrity=${5:-none}
  case $serial in ''|*[!A-Za-z0-9_.-]*) fail "bad serial: $serial" ;; esac
  case $fstype in ext4|xfs) ;; *) fail "bad file system type: $fstype" ;; esac
  case $integrity in none) integrity= ;; hmac-sha256) ;; *) fail "bad integrity: $integrity (none or hmac-sha256)" ;; esac
  check_dm_name "$dm"
  case $4 in ''|-|*[!A-Za-z0-9_=-]*) fail "the key is not URL-safe base64" ;; esac
  dev=$(find_disk "$serial") || fail "no virtio disk with serial $serial after ${DISK_WAIT_SECONDS}s"
  if [ -b "/dev/mapper/$dm" ]; then echo "device=mapper/$dm already=1"; return 0; fi
  load_fs_modules crypt
  if [ -n "$integrity" ]; then
    load_fs_modules integrity
    [ -d /sys/module/dm_integrity ] ||
      fail "this guest's kernel has no dm-integrity: crust.dev/integrity $integrity cannot be honoured"
  fi
  load_fs_modules "$fstype"
  key=$4 fresh=0
  probed=$(probe_blank "/dev/$dev") || exit 1
  set -- $probed
  case $1 in
    blank)
      if [ -n "$integrity" ]; then sectors="--integrity $integrity --sector-size 4096"
      else sectors="--sector-size 512 --keyslot-cipher aes-xts-plain64 --keyslot-key-size 512"; fi
      luks_key "$key" | cryptsetup luksFormat --batch-mode $LUKS_FORMAT $sectors --key-file=- "/dev/$dev" >&2 ||
        fail "luksFormat of $dev failed"
      fresh=1 ;;
    luks) [ "${2:-}" = 2 ] || fail "$dev has a LUKS${2:-?} header: crust makes and opens LUKS2 only" ;;
  esac
  mkdir -p -m 0700 "$RUN/luks"
  header=$RUN/luks/$dm.header
  # A subshell: whatever it refuses, the copy goes with it.
  ( luks_header_copy "/dev/$dev" "$header" "$integrity" ) || { rm -f "$header"; exit 1; }
  luks_key "$key" | cryptsetup open --type luks2 --header "$header" --disable-keyring --key-file=- \
    "/dev/$dev" "$dm" 2>"$RUN/luks.err"
  rc=$?
  if [ $rc -ne 0 ]; then
    rm -f "$header"
    # cryptsetup's exit code 2: no key slot opens with this passphrase.
    [ $rc -eq 2 ] && fail "wrong passphrase: no key slot of the LUKS2 header on $dev opens with the pod's secret"
    fail "cannot open the LUKS2 volume on $dev: $(tail -n 1 "$RUN/luks.err")"
  fi
  if ! luks_opened_as_made "$dm" "$integrity" "$dev"; then
    cryptsetup close "$dm"
    rm -f "$header"
    fail "the mapping of $dev is not the cipher crust makes: closed again"
  fi
  if [ "$fresh" = 1 ]; then
    case $fstype in
      ext4) /sbin/mke2fs -t ext4 -q -F "/dev/mapper/$dm" >&2 ;;
      xfs) /sbin/mkfs.xfs -q "/dev/mapper/$dm" >&2 ;;
    esac || { cryptsetup close "$dm"; rm -f "$header"; fail "mkfs.$fstype inside the LUKS2 volume on $dev failed"; }
  fi
  echo "device=mapper/$dm formatted=$fresh cipher=aes-xts-plain64${integrity:+ integrity=$integrity}"
}

cmd_luksresize() {  # target: grow the opened LUKS2 volume mounted there to its (grown) disk
  [ $# -eq 1 ] || fail "usage: luksresize <target>"
  check_path "$1"
  line=$(mount_line "$1")
  [ -n "$line" ] || fail "not mounted: $1"
  set -- $line
  case $1 in /dev/mapper/crypt-*) ;; *) echo "resized=0"; return 0 ;; esac
  name=${1#/dev/mapper/}
  cryptsetup status "$name" | grep -q '^ *integrity:' &&
    fail "$name is integrity-protected: cryptsetup resizes no dm-integrity device, the volume cannot grow"
  for disk in $(disk_under "$(kernel_dev "$1")"); do
    case $disk in sd*) rescan_disk "$disk" ;; esac
  done
  # The checked copy, never the disk's header (which the disk's owner may have rewritten since).
  cryptsetup resize --header "$RUN/luks/$name.header" "$name" >&2 || fail "cryptsetup resize $name failed"
  echo "resized=1 devsize=$(($(cat "$(dm_sysfs "$1")/size") * 512))"
}

cmd_luksclose() {  # name: close an opened LUKS2 volume (already closed is success)
  [ $# -eq 1 ] || fail "usage: luksclose <name>"
  check_dm_name "$1"
  [ -b "/dev/mapper/$1" ] || { echo "closed=0"; return 0; }
  # The containers' views of the volume (binds of it) go first, newest first.
  for m in $(awk -v d="/dev/mapper/$1" '$1 == d { print $2 }' /proc/mounts | tac); do
    umount "$m" || fail "umount $m (a view of $1) failed"
  done
  cryptsetup close "$1" || fail "cryptsetup close $1 failed"
  rm -f "$RUN/luks/$1.header"
  echo "closed=1"
}

dispatch() {
  cmd=$1
  [ $# -gt 0 ] && shift
  case $cmd in
    ping) cmd_ping "$@" ;;
    mount) cmd_mount "$@" ;;
    fsgroup) cmd_fsgroup "$@" ;;
    stats) cmd_stats "$@" ;;
    grow) cmd_grow "$@" ;;
    diskgone) cmd_diskgone "$@" ;;
    umount) cmd_umount "$@" ;;
    exec) cmd_exec "$@" ;;
    wait) cmd_wait "$@" ;;
    bind) cmd_bind "$@" ;;
    cbind) cmd_cbind "$@" ;;
    cbinds) cmd_cbinds "$@" ;;
    sharemount) cmd_sharemount "$@" ;;
    podtmpfs) cmd_podtmpfs "$@" ;;
    reach) cmd_reach "$@" ;;
    warm) cmd_warm "$@" ;;
    resume) cmd_resume "$@" ;;
    spawnfile) cmd_spawnfile "$@" ;;
    checkpath) cmd_checkpath "$@" ;;
    subpath) cmd_subpath "$@" ;;
    subpathdrop) cmd_subpathdrop "$@" ;;
    kill) cmd_kill "$@" ;;
    spawn) cmd_spawn "$@" ;;
    readout) cmd_readout "$@" ;;
    signal) cmd_signal "$@" ;;
    signalroot) cmd_signalroot "$@" ;;
    csignal) cmd_csignal "$@" ;;
    cforget) cmd_cforget "$@" ;;
    cstate) cmd_cstate "$@" ;;
    cstarted) cmd_cstarted "$@" ;;
    poll) cmd_poll "$@" ;;
    cstats) cmd_cstats "$@" ;;
    netconf) cmd_netconf "$@" ;;
    ttysize) cmd_ttysize "$@" ;;
    podpid) cmd_podpid "$@" ;;
    mirror) cmd_mirror "$@" ;;
    ctrsetup) cmd_ctrsetup "$@" ;;
    umountall) cmd_umountall "$@" ;;
    forget) cmd_forget "$@" ;;
    readonly) cmd_readonly "$@" ;;
    luksopen) cmd_luksopen "$@" ;;
    probe) cmd_probe "$@" ;;
    luksresize) cmd_luksresize "$@" ;;
    luksclose) cmd_luksclose "$@" ;;
    *) fail "unknown command: ${cmd:-(none)}" ;;
  esac
}

poweroff_guest() {  # id: stop every process, unmount everything, answer, power off
  kill -KILL -1 2>/dev/null   # all but init and this shell
  usleep 200000
  sync
  n=0 failed=0
  for m in $(awk '$2 == "/" || $2 ~ "^/(proc|sys|dev|run|tmp)(/|$)" { next } { print $2 }' /proc/mounts | tac); do
    if umount "$m" 2>/dev/null || { usleep 300000; umount "$m"; }; then n=$((n + 1))
    else failed=$((failed + 1)); umount -l "$m" 2>/dev/null; fi
  done
  sync
  reply "$1" ok "unmounted=$n failed=$failed"
  exec 3>&-   # closing a tty waits until the answer left the UART
  poweroff -f
}

exec 3<>"$PORT" || { log "cannot open $PORT"; exit 1; }
# Raw: no echo of the requests back to the host, no CR/LF translation, and
# clocal: the host (dis)connecting must not hang up the line.
stty raw -echo clocal -hupcl 115200 <&3 || log "stty on $PORT failed"
mkdir -p "$RUN/exec"
log "listening on $PORT (agent $AGENT_VERSION, image ${CRUST_IMAGE_HASH:-unknown})"
# Unsolicited, id "-": a host already connected need not wait for its next ping.
reply - ok "ready $(cmd_ping)"

while IFS= read -r line <&3; do
  line=${line%"$CR"}
  set -- $line
  [ $# -gt 0 ] || continue
  id=$1
  shift
  case $id in *[!A-Za-z0-9_.-]*) log "ignored a malformed line"; continue ;; esac
  if [ "${1:-}" = poweroff ]; then
    poweroff_guest "$id"
  fi
  if out=$(dispatch "$@" 2>"$RUN/err"); then
    reply "$id" ok "$out"
  else
    rc=$?
    msg=$(tail -n 4 "$RUN/err")
    reply "$id" err "${msg:-${1:-request} failed with exit code $rc}"
  fi
done
log "$PORT closed"
