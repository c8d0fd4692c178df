#!/bin/sh
# feed.sh INPUT EXITFILE: the standard input of one process of a pod, on
# stdout (a fifo the process reads), from the file the host appends it to.
#
# The host (crust.kata.pods, WriteInput) appends the process's input to
# INPUT in the pod's live share (virtio-fs without a cache: an append is
# seen at once) and makes INPUT.closed once nothing more will come. This
# copies every new byte as it appears, and ends (the process reads end of
# file) once INPUT.closed exists and everything before it was copied; or
# when EXITFILE appears (the process ended: nobody reads any more). A write
# to a reader that is gone ends it too (SIGPIPE).
export PATH=/sbin:/bin:/usr/sbin:/usr/bin
input=$1 exitfile=$2 sent=0
while :; do
  size=$(stat -c %s "$input" 2>/dev/null || echo 0)
  if [ "$size" -gt "$sent" ]; then
    tail -c +$((sent + 1)) "$input" | head -c $((size - sent)) || exit 0
    sent=$size
    continue
  fi
  if [ -e "$input.closed" ]; then
    # Everything the host wrote came before the marker: one more look at
    # the size, taken after the marker was seen, is final.
    size=$(stat -c %s "$input" 2>/dev/null || echo 0)
    [ "$size" -gt "$sent" ] && continue
    exit 0
  fi
  [ -e "$exitfile" ] && exit 0
  usleep 100000
done
