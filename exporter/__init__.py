"""dataloader-exporter: the Prometheus side. Never imports torch or grafanalib."""

