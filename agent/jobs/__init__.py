"""`hangwatch job`: a distributed job's ranks side by side, read from Prometheus.

prom.py asks the Prometheus HTTP API, ranks.py (pure) turns the series into one view per job
with the semantics of the shipped rules (group hangwatch.jobs), render.py prints it, and
command.py is the command that joins them.
"""
