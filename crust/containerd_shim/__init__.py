"""containerd-shim-crust-v2: containerd's shim v2 runtime `io.containerd.crust.v2`
in front of crust's microVM handler (its PodRuntime service)."""
