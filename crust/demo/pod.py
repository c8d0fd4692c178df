"""What the demo's pod does in the volume, in every variant: its process
writes data and says what it sees, and the fsGroup it should see."""

FS_GROUP = 2000
# The pod's process writes 1 MiB and its sha256 into the volume and says
# which group the file got.
WRITE_SCRIPT = ("head -c 1048576 /dev/urandom > /data/payload.bin && "
                "sha256sum /data/payload.bin | cut -d' ' -f1 > /data/payload.sha256 && sync && "
                "echo \"file-group: $(ls -ln /data/payload.bin | awk '{print $4}')\"")
# df's view of the volume from inside the sandbox, for the comparison with
# NodeGetVolumeStats (the last lines a sandbox prints; run through ExecSync
# under CRI).
DF_SCRIPT = ("echo \"df-bytes: $(df -P -B1 /data | tail -n 1)\" && "
             "echo \"df-inodes: $(df -P -i /data | tail -n 1)\"")
