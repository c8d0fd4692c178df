"""The virtual machine monitor: one QEMU process per VM (`qemu`), driven over
QMP (`qmp`); what it is asked to run (`config`), the devices it gains and
loses while it runs (`devices`), its connection to the guest's agent
(`agent_port`), its console (`console`), its shared directories (`share`)
and their file servers (`virtiofsd`), and how a VM is saved and restored
(`saving`, `saved_ram`)."""
