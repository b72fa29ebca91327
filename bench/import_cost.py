"""What the drop-in costs to import, in a process that has imported torch already (as a
training script has): wall time and modules added, median of fresh interpreters.

    python bench/import_cost.py                      # import dataloader_exporter; .DataLoader
    python bench/import_cost.py --old-tree /tmp/old  # and, interleaved, the same statement
                                                     # in an older checkout

The module test (tests/test_imports.py) keeps the modules this import may load.

Each tree is imported once first, unmeasured, so that its bytecode is written as pip writes
it at install (an environment with PYTHONDONTWRITEBYTECODE would compile every module it
loads in every process). The cases alternate run by run, so that a machine's noise falls
on both alike (these machines differ up to 6x in speed): compare the figures of one run,
not of two. Each is measured twice: as a training script runs it, and with the garbage
collector off, since after torch's import the allocations of any import of some size set
off one full collection over torch's objects (about 100 ms here) that is not the import's
own work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = """
import gc, json, sys, time
import torch, torch.utils.data
if {no_gc}:  # the import's own work, without the full collection it may set off
    gc.collect()
    gc.disable()
before = set(sys.modules)
start = time.perf_counter()
{statement}
took = time.perf_counter() - start
added = sorted(set(sys.modules) - before)
print(json.dumps({{"ms": took * 1000, "modules": len(added),
                   "asyncio_or_http": [m for m in added if m.split(".")[0] in
                                       ("asyncio", "ssl", "http", "yaml", "bcrypt", "pynvml")
                                       or ".http" in m or ".diagnosis" in m]}}))
"""


def measure(statement: str, pythonpath: str | None, no_gc: bool) -> dict[str, object]:
    env = dict(os.environ)
    # As installed: with bytecode written (pip compiles at install), not compiled each time.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", PROBE.format(statement=statement, no_gc=no_gc)],
                         capture_output=True, text=True, check=True, timeout=300, env=env,
                         cwd=pythonpath or None)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--statement",
                        default="import dataloader_exporter; dataloader_exporter.DataLoader")
    parser.add_argument("--old-tree", help="an older checkout (git worktree add /tmp/prev "
                        "HEAD), measured with the same statement, run for run")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    trees: dict[str, str | None] = {"this tree": None}
    if args.old_tree:
        trees[args.old_tree] = os.path.abspath(args.old_tree)
    results: dict[tuple[str, bool], list[dict[str, object]]] = {
        (t, g): [] for t in trees for g in (False, True)}
    for tree in trees:  # once unmeasured: each tree's bytecode written, as after pip install
        measure(args.statement, trees[tree], False)
    for _ in range(args.runs):
        for tree, no_gc in results:
            results[tree, no_gc].append(measure(args.statement, trees[tree], no_gc))
    for (tree, no_gc), runs in results.items():
        ms = [float(str(r["ms"])) for r in runs]
        how = "garbage collector off" if no_gc else "as a script runs it"
        print(f"{tree}: {args.statement!r} ({how}): median {statistics.median(ms):.0f} ms "
              f"(min {min(ms):.0f}, max {max(ms):.0f}) over {args.runs} runs; "
              f"{runs[0]['modules']} modules added; server/doctor modules among them: "
              f"{runs[0]['asyncio_or_http'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
