"""Where a pod's VM comes from when it is not booted for it: VMs booted ahead
(`pool`) and VMs restored from a saved one (`template`)."""
