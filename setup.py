"""The packaging that pyproject.toml cannot say as data: the one installed namespace
mapped onto the repository's top-level folders, and the per-batch path's C extension.

Installed, everything is `dataloader_exporter`: `dataloader_exporter/` holds the commands
and the drop-in's names, and each of ROOTS (a top-level folder of the repository) is
installed as `dataloader_exporter.<root>`, its sub-packages with it (setuptools'
package-dir: a wheel holds each module once; an editable install maps the names through
its finder). No list of packages to keep in step: they are found.

The extension is optional: where it cannot be built (no C compiler or Python headers, or
not Linux), the package installs without it and runs the same code in Python
(instrument/hotpath/base.py).
"""

from setuptools import Extension, find_packages, setup

NS = "dataloader_exporter"
ROOTS = ("core", "exporter", "instrument", "diagnosis", "dashboards")

package_dir = {NS: NS} | {f"{NS}.{root}": root for root in ROOTS}
packages = [NS] + [f"{NS}.{root}{'.' + sub if sub else ''}"
                   for root in ROOTS for sub in ("", *find_packages(root))]

setup(
    package_dir=package_dir,
    packages=packages,
    ext_modules=[Extension(f"{NS}.instrument.hotpath._hotpath",
                           ["instrument/hotpath/_hotpath.c"], optional=True,
                           extra_compile_args=["-O2"])],
)
