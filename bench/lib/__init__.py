"""What the benchmarks share: run records, the rendering of
docs/performance.md, and the stacks and fakes the benchmarks start."""
