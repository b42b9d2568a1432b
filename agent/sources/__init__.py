"""Sources: everything that reads the host and returns plain data (agent.model), never a verdict.

The BPF probe (the only importer of bcc), /proc, tcp_info over netlink, NVML, Python stacks
and ELF symbols. What the syscalls they read mean is agent.syscalls, a table every layer
shares. Nothing here imports the analysis or the report.
"""
