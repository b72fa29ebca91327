"""The standard-library core both sides share: the metric catalogue, environment
variable names, machine facts, loader settings, the CPU advisor and the bands that
judge a figure. It imports nothing but the standard library, so the trainer pays
little for it and the sidecar, the doctor and the dashboards read the same values."""
