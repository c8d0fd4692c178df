"""A microVM as the handler's Sandbox (`vm_sandbox`): deferred volumes
hot-plugged and mounted by the guest, and Kata's direct-assigned volumes
(`direct_volume`, its command line `direct_volume_cli`)."""
