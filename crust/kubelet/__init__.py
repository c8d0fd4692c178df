"""Kubelet's side of a node, replayed from kubelet's public source (the demo
and the tests), and the container runtime it talks to."""
