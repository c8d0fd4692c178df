"""System calls behind small modules, one per concern.

Everything that touches the kernel or runs a tool (losetup, mount, mkfs, blkid,
resize2fs, xfs_growfs) lives here, so the servicers above read like the CSI
protocol. Every command runs from an argument list (never a shell), with a
timeout bound to the RPC's deadline, and keeps its exit code and stderr in
the error it raises.
"""
