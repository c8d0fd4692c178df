"""Storage backends of the driver. `loop` (sparse files + loop devices) is the
embedded default; a backend is the only code that knows where bytes live."""
