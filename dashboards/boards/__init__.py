"""The dashboards as data: overview (is the GPU starving, and why; with its rows on the
workers and the tuner), gpu, and jobs (every training job of a cluster)."""
