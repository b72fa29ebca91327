"""The per-batch path's C extension (instrument/_hotpath.c); everything else is in
pyproject.toml. optional=True: where it cannot be built (no C compiler or Python headers),
the package installs without it and runs the same code in Python (hotpath_base.py)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("dataloader_exporter.instrument._hotpath",
                             ["instrument/_hotpath.c"], optional=True,
                             extra_compile_args=["-O2"])])
