"""python -m dataloader_exporter: the dataloader-exporter command."""

import sys

from dataloader_exporter.cli import main

sys.exit(main())
