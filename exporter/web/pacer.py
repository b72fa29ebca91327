"""When each request is answered: a per-peer and an overall rate, each with a burst.

A generic cell rate algorithm: a request's turn is its peer's theoretical arrival time
(and everyone's) less the burst's allowance, and a request early for its turn waits for it.
Waiting costs the process nothing, so a client scraping in a tight loop, or fifty at once,
get their answers later instead of taking the interpreter lock from the training loop
(in-process); a few requests at once (a retry, a browser) never wait.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from dataloader_exporter.exporter.web.limits import Limits

_PEERS = 1024  # peers whose next turn is remembered; the longest unseen is forgotten first


class Pacer:
    """The turns of requests under Limits.peer_interval and answers_per_second, each with
    a burst of pace_burst (0: no bound). Used from the server's event loop only."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.peer_next: OrderedDict[str, float] = OrderedDict()  # each peer's arrival time
        self.next_answer = 0.0  # everyone's

    def turn(self, peer: str, now: float) -> float:
        """The time a request of `peer` arriving at `now` is due; books that turn."""
        gap, rate = self.limits.peer_interval, self.limits.answers_per_second
        burst = max(1, self.limits.pace_burst)
        turn = now
        if gap:
            due = max(now, self.peer_next.get(peer, now))
            turn = max(turn, due - (burst - 1) * gap)
            self.peer_next[peer] = due + gap
            self.peer_next.move_to_end(peer)
            while len(self.peer_next) > _PEERS:
                self.peer_next.popitem(last=False)
        if rate:
            due = max(now, self.next_answer)
            turn = max(turn, due - (burst - 1) / rate)
            self.next_answer = due + 1.0 / rate
        return turn

    async def wait(self, peer: str) -> None:
        """Waits for this request's turn; returns at once when nothing is bounded."""
        if not self.limits.peer_interval and not self.limits.answers_per_second:
            return
        now = time.monotonic()
        turn = self.turn(peer, now)
        if turn > now:
            await asyncio.sleep(turn - now)
