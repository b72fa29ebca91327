"""dataloader-exporter: the Prometheus side. Never imports torch or grafanalib."""

__version__ = "0.1.0"
