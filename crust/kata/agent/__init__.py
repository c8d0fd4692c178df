"""The host's side of the guest agent's protocol (specs/agent.proto): the
ttrpc client (`client`), the typed calls the pod runtime makes (`calls`,
`volume_calls`), the bounds on a stop's calls (`stop_bound`), and the checks
the host applies to the numbers a guest reports (`checked_numbers`). A VM's
connection to its agent is the VM's (crust.kata.vmm.agent_port)."""
