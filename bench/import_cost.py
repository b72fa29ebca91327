"""What the drop-in costs to import, in a process that has imported torch already (as a
training script has): wall time and modules added, median of fresh interpreters.

    python bench/import_cost.py                      # from dataloader_exporter import DataLoader
    python bench/import_cost.py --old-tree /tmp/old  # and, interleaved, an older checkout's
                                                     # `from instrument import DataLoader`

The cases alternate run by run, so that a machine's noise falls on both alike (these
machines differ up to 6x in speed): compare the figures of one run, not of two. Each is
measured twice: as a training script runs it, and with the garbage collector off, since
after torch's import the allocations of any import of some size set off one full
collection over torch's objects (about 100 ms here) that is not the import's own work.
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
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", PROBE.format(statement=statement, no_gc=no_gc)],
                         capture_output=True, text=True, check=True, timeout=300, env=env,
                         cwd=pythonpath or None)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--statement", default="from dataloader_exporter import DataLoader")
    parser.add_argument("--old-tree", help="a checkout from before the one namespace, "
                        "measured with its `from instrument import DataLoader`")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    cases = {args.statement: None}
    if args.old_tree:
        cases["from instrument import DataLoader"] = os.path.abspath(args.old_tree)
    results: dict[tuple[str, bool], list[dict[str, object]]] = {
        (c, g): [] for c in cases for g in (False, True)}
    for _ in range(args.runs):
        for statement, no_gc in results:
            results[statement, no_gc].append(measure(statement, cases[statement], no_gc))
    for (statement, no_gc), runs in results.items():
        ms = [float(str(r["ms"])) for r in runs]
        how = "garbage collector off" if no_gc else "as a script runs it"
        print(f"{statement!r} ({how}): median {statistics.median(ms):.0f} ms "
              f"(min {min(ms):.0f}, max {max(ms):.0f}) over {args.runs} runs; "
              f"{runs[0]['modules']} modules added; server/doctor modules among them: "
              f"{runs[0]['asyncio_or_http'] or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
