"""The storage path: the driver, the shim, the proxy and the handlers, call
by call and at scale, against the reference driver where one exists."""
