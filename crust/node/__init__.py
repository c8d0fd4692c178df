"""`crust node`: the node side (driver, shim, proxy, optional handler) from one config file."""
