"""HTTP basic auth against bcrypt hashes, as exporter-toolkit checks it, and a fair queue
for the checks.

bcrypt is slow on purpose (cost 10: about 60 ms here, each +1 doubles it), so a success
is cached under the user and a SHA-256 of the password (bounded LRU) and a scrape every
second pays it once; failures are not cached. An unknown user still costs one bcrypt
check, against a random hash of the highest configured cost, so timing does not reveal
users. As in exporter-toolkit, one bcrypt check runs at a time.

Checks wait in CheckQueue, which serves addresses with no recent failure first and lets
such a one push the worst offender out of a full queue, so addresses sending wrong
passwords cannot keep a scraper whose password is not cached yet out. Failures gives each
address an allowance of failed checks (a token bucket: BURST at once, then one every
REFILL seconds) whose refill slows each time it runs dry, so a flooding address is
refused (429, no bcrypt) ever longer, while a misconfigured Prometheus scraping every
second keeps getting its check and its 401. Addresses are accounted, not users: guessing
a user's password must not lock that user out. An attacker with ever-new addresses is
not slowed by them, but is served no earlier than a cold scraper, one check at a time.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hashlib
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass

import bcrypt

AUTH_CACHE_SIZE = 100
MAX_COST = 16  # about 4 s a check here: higher costs would stall every new client
# A peer address's failed checks: BURST at once (typos, a restart of a few wrong jobs),
# then one every REFILL seconds, so a wrong password scraped every second always gets its
# check (and Prometheus shows the 401); each time the allowance runs dry the refill time
# doubles, to REFILL * 2**MAX_LEVEL (64 s), and is forgiven once the allowance is full.
BURST = 4
REFILL = 1.0
MAX_LEVEL = 6
PEERS = 1024  # addresses whose failures are remembered, the least recent forgotten first
_EPS = 1e-9  # clock arithmetic: a bucket refilled to within this is refilled


class BasicAuth:
    """Checks `Basic` credentials against bcrypt hashes, remembering recent successes.

    bcrypt is slow on purpose: a success is cached under the user and a SHA-256 of the
    password (bounded LRU); failures are not. An unknown user still costs one bcrypt check,
    against a random hash of the highest configured cost, so timing does not reveal users.
    As in exporter-toolkit, one bcrypt check runs at a time. Thread-safe.
    """

    def __init__(self, users: Mapping[str, bytes], cache_size: int = AUTH_CACHE_SIZE) -> None:
        self.users, self.cache_size = users, cache_size
        self.cache: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._lock, self._bcrypt_lock = threading.Lock(), threading.Lock()
        cost = max((int(h[4:6]) for h in users.values()), default=4)
        self._dummy = bcrypt.hashpw(secrets.token_hex(16).encode(), bcrypt.gensalt(cost))

    def _cached(self, credentials: tuple[str, bytes]) -> tuple[bool, tuple[str, bytes]]:
        """Whether these credentials passed recently, and their cache key."""
        key = (credentials[0], hashlib.sha256(credentials[1]).digest())
        with self._lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return True, key
        return False, key

    def known(self, authorization: str | None) -> bool:
        """True when no users are configured or these credentials passed recently."""
        if not self.users:
            return True
        credentials = parse_basic(authorization)
        return credentials is not None and self._cached(credentials)[0]

    def check(self, authorization: str | None) -> bool:
        """True for a right `Basic` Authorization header value, or when there are no users."""
        if not self.users:
            return True
        credentials = parse_basic(authorization)
        if credentials is None:
            return False
        hit, key = self._cached(credentials)
        if hit:
            return True
        user, password = credentials
        hashed = self.users.get(user)
        if not self.checkpw(password, self._dummy if hashed is None else hashed) or not hashed:
            return False
        with self._lock:
            self.cache[key] = None
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return True

    def checkpw(self, password: bytes, hashed: bytes) -> bool:
        """One bcrypt comparison; bcrypt reads only the first 72 bytes, as Go's does."""
        with self._bcrypt_lock:
            try:
                return bcrypt.checkpw(password[:72], hashed)
            except ValueError:
                return False


class Failures:
    """Each peer address's allowance of failed password checks: a token bucket of BURST
    refilled one every REFILL * 2**level seconds, its level raised each time a failure
    leaves it dry and back to 0 once it is full (a full bucket is not kept). At most
    `size` addresses, the least recently failing forgotten first. The event loop's
    alone: not thread-safe."""

    def __init__(self, size: int = PEERS, clock: Callable[[], float] = time.monotonic) -> None:
        self.size, self.clock = size, clock
        self._peers: OrderedDict[str, tuple[float, float, int]] = OrderedDict()  # tokens, at, level

    def __len__(self) -> int:
        return len(self._peers)

    def _bucket(self, peer: str) -> tuple[float, int]:
        """(tokens, level) now."""
        entry = self._peers.get(peer)
        if entry is None:
            return float(BURST), 0
        tokens, at, level = entry
        tokens += (self.clock() - at) / (REFILL * 2**level)
        if tokens >= BURST - _EPS:
            del self._peers[peer]
            return float(BURST), 0
        return tokens, level

    def wait(self, peer: str) -> float:
        """Seconds before this peer may have a password checked: 0 now."""
        tokens, level = self._bucket(peer)
        return 0.0 if tokens >= 1.0 - _EPS else (1.0 - tokens) * REFILL * 2**level

    def score(self, peer: str) -> float:
        """How much allowance it has used lately, each level counting BURST: 0 for a peer
        with no recent failure. The lower is checked first."""
        tokens, level = self._bucket(peer)
        return BURST - tokens + BURST * level

    def failed(self, peer: str) -> None:
        tokens, level = self._bucket(peer)
        tokens -= 1.0
        if tokens < 1.0 - _EPS:
            level = min(level + 1, MAX_LEVEL)
        self._peers[peer] = (tokens, self.clock(), level)
        self._peers.move_to_end(peer)
        while len(self._peers) > self.size:
            self._peers.popitem(last=False)

    def passed(self, peer: str) -> None:
        """It knows a password: its failures are forgiven."""
        self._peers.pop(peer, None)


@dataclass(eq=False)
class _Check:
    score: float
    order: int
    peer: str
    fn: Callable[[], bool]
    answer: asyncio.Future[bool | None]


class CheckQueue:
    """Password checks waiting for their turn, run one at a time on `executor`.

    At most one per peer address and `size` waiting in all; the lowest Failures.score
    runs first, first come first within a score, so a peer with no recent failure waits
    for the check under way and its own, however many failing peers wait. A peer with no
    allowance left is refused, and so is a newcomer to a full queue unless it scores
    lower than the worst peer waiting, which is refused instead. A check counts for its
    peer even when its client has gone. The event loop's alone.
    """

    def __init__(self, executor: Executor, size: int, failures: Failures | None = None
                 ) -> None:
        self.executor, self.size = executor, size
        self.failures = Failures() if failures is None else failures
        self.peers: set[str] = set()  # with a check waiting or running
        self.waiting: list[_Check] = []
        self.running = False
        self.ran, self.busy = 0, 0.0  # checks run and seconds spent in them, for tests
        self._order = itertools.count()

    async def check(self, peer: str, fn: Callable[[], bool]) -> bool | None:
        """fn()'s answer, run in this peer's turn; None when refused (429)."""
        if peer in self.peers or self.failures.wait(peer) > 0:
            return None
        entry = _Check(self.failures.score(peer), next(self._order), peer, fn,
                       asyncio.get_running_loop().create_future())
        if len(self.waiting) >= self.size:
            worst = max(self.waiting, key=lambda c: (c.score, c.order))
            if worst.score <= entry.score:
                return None
            self._settle(worst, None)
        self.waiting.append(entry)
        self.peers.add(peer)
        self._next()
        try:
            return await entry.answer
        except asyncio.CancelledError:
            if entry in self.waiting:  # not begun: nothing to count, its place freed
                self._settle(entry, None)
            raise

    def _settle(self, entry: _Check, answer: bool | None) -> None:
        if entry in self.waiting:
            self.waiting.remove(entry)
        self.peers.discard(entry.peer)
        if not entry.answer.done():
            entry.answer.set_result(answer)

    def _next(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.running and self.waiting:
            entry = min(self.waiting, key=lambda c: (c.score, c.order))
            self.waiting.remove(entry)
            try:
                future = loop.run_in_executor(self.executor, self._timed, entry.fn)
            except RuntimeError:  # the executor is shut down: the server is stopping
                self._settle(entry, None)
                continue
            self.running = True
            future.add_done_callback(functools.partial(self._done, entry))

    def _done(self, entry: _Check, future: asyncio.Future[bool]) -> None:
        self.running = False
        error = None if future.cancelled() else future.exception()
        if future.cancelled() or error is not None:
            self.peers.discard(entry.peer)
            if not entry.answer.done():
                entry.answer.set_exception(error or asyncio.CancelledError())
        else:
            ok = future.result()
            (self.failures.passed if ok else self.failures.failed)(entry.peer)
            self._settle(entry, ok)
        self._next()

    def _timed(self, fn: Callable[[], bool]) -> bool:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.ran, self.busy = self.ran + 1, self.busy + time.perf_counter() - start


def parse_basic(authorization: str | None) -> tuple[str, bytes] | None:
    """(user, password) from `Basic base64(user:password)`; None when malformed."""
    if not authorization or authorization[:6].lower() != "basic ":
        return None
    try:
        raw = base64.b64decode(authorization[6:], validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = raw.partition(b":")
    return (user.decode("utf-8", "surrogateescape"), password) if colon else None
