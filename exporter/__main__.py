"""python -m exporter: the dataloader-exporter command."""

import sys

from exporter.cli import main

sys.exit(main())
