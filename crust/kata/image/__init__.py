"""The guest image, built on the host: a Debian kernel and an initramfs with
the file system tools, crun and the agent (crust.guest), from Debian packages
only, cached by content (`build`)."""
