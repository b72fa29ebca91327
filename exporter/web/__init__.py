"""Serving over HTTP as exporter-toolkit does: the server, its connections, the wire
format, TLS and basic auth from a web configuration file, and the bounds on what clients
may hold (connections, time, and the pace of answers)."""
