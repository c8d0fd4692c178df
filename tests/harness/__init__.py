"""What the tests and the benchmarks share: real daemons on real sockets,
containerd and CRI-O started for a test, guests, pods, and the upstream
programs' lookup. Test modules never import each other; they import this."""
