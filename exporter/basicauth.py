"""HTTP basic auth against bcrypt hashes, as exporter-toolkit checks it.

bcrypt is slow on purpose (cost 10: about 60 ms here, each +1 doubles it), so a success
is cached under the user and a SHA-256 of the password (bounded LRU) and a scrape every
second pays it once; failures are not cached. An unknown user still costs one bcrypt
check, against a random hash of the highest configured cost, so timing does not reveal
users. As in exporter-toolkit, one bcrypt check runs at a time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping

import bcrypt

AUTH_CACHE_SIZE = 100
MAX_COST = 16  # about 4 s a check here: higher costs would stall every new client


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
