"""An epoch's start in instructions, not microseconds: iter() and the first batch of a
loader without workers (the iterator then dropped, as bench/overhead.py's epoch start
does), bare and instrumented, counted by valgrind's callgrind.

Timings of a few tens of µs swing 2x from round to round on a shared machine; the
instructions an epoch start executes do not (within about 1%), so they say what a change
to the epoch-start path saves, and where its cost lies: each piece of the instrumented
path is made a no-op in turn and the instructions it took are what went away.

Each count is one process under callgrind, instrumentation switched on (callgrind_control)
only around K epoch starts after a warm-up, less the same process with none: per epoch
start = (count(K) - count(0)) / K. Python's hash seed is fixed. Needs valgrind.

    python bench/epoch_instructions.py [--quick] [--epochs K]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WARMUP = 50

# Pieces of the instrumented path, each replaced by a no-op of the same result.
PIECES = ("settings", "shm", "arm", "kept_iter", "timed")


def child(which: str, epochs: int, without: list[str]) -> None:
    """Runs `epochs` epoch starts between two lines read from stdin (under callgrind,
    counted only while switched on)."""
    sys.path.insert(0, str(REPO / "bench"))
    import overhead
    from prometheus_client import CollectorRegistry
    from torch.utils.data import DataLoader

    from dataloader_exporter import instrument
    from dataloader_exporter.instrument import iter_start
    from dataloader_exporter.instrument.hotpath.iterator import TimedIterator
    from dataloader_exporter.instrument.torch_originals import TORCH_ITER

    ds = overhead.make_dataset(64)
    loader: Any = (DataLoader(ds) if which == "bare" else
                   instrument.DataLoader(ds, name="epochs", registry=CollectorRegistry()))
    DataLoader.__iter__ = TORCH_ITER  # type: ignore[method-assign]  # bare: torch's own
    for _ in range(WARMUP):  # the first also logs the config and keeps the plan
        next(iter(loader))
    kept = loader._instruments.kept if which != "bare" else None

    def bare_kept_iter(loader: Any, inst: Any, kept: Any, start: int) -> Any:
        return TimedIterator(TORCH_ITER(loader), inst, start, 0, kept.count, kept.sized)

    noop = {  # (owner, attribute, replacement)
        # the kept plan's settings compared with the loader's
        "settings": (iter_start, "_same_settings", lambda *a: True),
        # its /dev/shm size compared
        "shm": (iter_start, "process_shm_size", lambda: kept.shm),
        # the arming of the full-batch count: the sampler's length (torch's and the
        # dataset's __len__)
        "arm": (kept, "sized", None),
        # all of _kept_iter's checks and bookkeeping: only the TimedIterator built
        "kept_iter": (iter_start, "_kept_iter", bare_kept_iter),
        # the whole instrumentation but the class: its __iter__ is torch's
        "timed": (type(loader), "__iter__", TORCH_ITER),
    }
    for name in without:
        owner, attr, fn = noop[name]
        setattr(owner, attr, fn)
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(epochs):
        next(iter(loader))
    print("done", flush=True)
    sys.stdin.readline()


def count(which: str, epochs: int, without: tuple[str, ...], tmp: str) -> int:
    """Instructions the child executed while switched on."""
    out = os.path.join(tmp, "callgrind.out")
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         sys.executable, __file__, "--child", which, str(epochs), *without],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def expect(word: str) -> None:
        if (line := stdout.readline().strip()) != word:
            raise RuntimeError(f"the child said {line!r}: {proc.stderr.read()[-2000:]}")

    def send(word: str) -> None:
        stdin.write(word + "\n")
        stdin.flush()

    def switch(on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(proc.pid)],
                       check=True, capture_output=True, timeout=60)

    try:
        expect("ready")
        switch(True)
        send("go")
        expect("done")
        switch(False)
        send("end")
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    found = re.search(r"Collected : (\d+)", err)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind failed ({proc.returncode}): {err[-2000:]}")
    return int(found[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="bare and instrumented only, fewer epoch starts")
    parser.add_argument("--epochs", type=int, default=0, help="epoch starts counted (K)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2:])
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (callgrind) is not installed", file=sys.stderr)
        return 2
    epochs = args.epochs or (100 if args.quick else 400)
    with tempfile.TemporaryDirectory() as tmp:
        base = {w: count(w, 0, (), tmp) for w in ("bare", "inst")}
        per = {w: (count(w, epochs, (), tmp) - base[w]) / epochs for w in ("bare", "inst")}
        print(f"epoch start (iter() and first batch), instructions: bare {per['bare']:,.0f}, "
              f"instrumented {per['inst']:,.0f} ({per['inst'] - per['bare']:+,.0f}, "
              f"{per['inst'] / per['bare']:.3f}x)")
        saved = {}
        for piece in () if args.quick else PIECES:
            without = (count("inst", epochs, (piece,), tmp) - base["inst"]) / epochs
            saved[piece] = per["inst"] - without
            print(f"  {piece:<13} {saved[piece]:>+9,.0f}")
    print(json.dumps({"epochs": epochs, "bare": per["bare"], "instrumented": per["inst"],
                      "pieces": saved}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
