"""crust's OCI runtime: runc's command line, with deferred volumes claimed
and mounted inside the container (see crust.oci_runtime.main)."""
