"""The diagnosis client: the doctor, `top`, and the signals they compute from metrics.

A reader of metrics (an exporter's /metrics or a Prometheus server), never a server:
it imports the exporter's catalogue and machine facts, never torch, instrument or
dashboards.
"""
