"""Inside the microVM: its boot, the guest agent's port, the guest's OCI
runtime, guest disk I/O, and the containerd shim in front of it."""
