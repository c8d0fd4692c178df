"""The benchmarks: scripts run as `.venv/bin/python bench/NAME.py` (see docs/performance.md)."""
