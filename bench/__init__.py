"""The benchmarks: scripts run as `.venv/bin/python bench/GROUP/NAME.py` (see
docs/performance.md), grouped by what they measure (csi/, runtime/, microvm/),
with what they share in lib/."""
