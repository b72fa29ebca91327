"""mypy over the installed namespace, as the checkout holds it.

The repository's top-level folders are installed as dataloader_exporter.* (setup.py's
package-dir mapping), which mypy cannot see through an editable install's import hook.
So each file is handed to mypy with the module name it is installed under
(tools/namespace.py), under the project's mypy settings (pyproject.toml); errors name
the files as they are in the repository.

    python tools/typecheck.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from namespace import REPO, all_files, module_name


def main() -> int:
    _, options = process_options(["--config-file", str(REPO / "pyproject.toml"), "-c", ""])
    paths = all_files((".py", ".pyi"))
    sources = [BuildSource(str(p.relative_to(REPO)), module_name(p)) for p in paths]
    try:
        result = build.build(sources, options)
        messages = result.errors
    except CompileError as e:
        messages = e.messages
    for line in messages:
        print(line)
    modules = len({s.module for s in sources})
    if messages:
        print(f"Found errors in the namespace ({modules} modules checked)")
        return 1
    print(f"Success: no issues found in {modules} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
