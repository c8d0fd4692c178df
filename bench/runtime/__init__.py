"""Pods through containerd, crust's runtimes beside runc in one run: start,
exec, logs, network, shared directories, density, bursts and long lives."""
