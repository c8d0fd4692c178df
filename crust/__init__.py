"""crust: Container RUntime STorage operations."""

__version__ = "0.1.0"
