"""The host's side of the guest agent's protocol (specs/agent.proto): the
ttrpc client (`client`) on the VM's virtio-serial port (`connection`), the
typed calls the pod runtime makes (`calls`, `volume_calls`), and the checks
the host applies to the numbers a guest reports (`checked_numbers`)."""
