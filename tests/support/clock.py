"""A clock for collectors and rate limiters that take `clock=`: it moves only when the
test moves it."""

from __future__ import annotations

import time


class Clock:
    """Returns `now` when called; a test sets `now` or calls `advance()`. It starts at the
    wall-clock time, so that it can be compared with the modification times of files the
    test writes."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
