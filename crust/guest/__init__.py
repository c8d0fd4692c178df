"""crust's guest agent: what runs inside a crust-microvm pod's VM and serves
the host's requests (specs/agent.proto) over ttrpc on a virtio-serial port.

Every module here runs in the guest on Debian's python3 with the standard
library and the protobuf runtime only, and on the host under the tests
(without a VM and without root where a call needs neither): nothing here
imports the host's daemons.
"""
