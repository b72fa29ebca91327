"""`dataloader-exporter dashboards`: write the generated dashboards, alerts, rules and
Kubernetes objects into a directory (grafanalib and PyYAML: the dashboards extra)."""

from __future__ import annotations

import argparse

from .build import write

DESCRIPTION = ("Write the Grafana dashboards and provisioning files, the Prometheus alert and "
               "recording rules and the Kubernetes objects into a directory.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="deploy", metavar="DIR",
                        help="output directory (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    for path in write(args.out):
        print(path)
    return 0
