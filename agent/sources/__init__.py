"""Sources: everything that reads the host and returns plain data (agent.model), never a verdict.

The BPF probe (the only importer of bcc), /proc, tcp_info over netlink, NVML, Python stacks,
ELF symbols and the x86-64 syscall table. Nothing here imports the analysis or the report.
"""
