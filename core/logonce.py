"""The one log-once helper: a problem is logged the first time it is seen, and again only
after it has cleared, so a scrape every second or a batch every millisecond never floods
the log with the same line."""

from __future__ import annotations

import logging
import threading


class LogOnce:
    """Logs each key's message once while it stays active; thread-safe."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING) -> None:
        self._logger = logger
        self._level = level
        self._active: set[str] = set()
        self._lock = threading.Lock()

    def problem(self, key: str, msg: str, *args: object) -> bool:
        """Logs `msg` unless `key` is already active; True when it logged."""
        with self._lock:
            if key in self._active:
                return False
            self._active.add(key)
        self._logger.log(self._level, msg, *args, stacklevel=2)
        return True

    def cleared(self, key: str, msg: str = "", *args: object) -> None:
        """Ends `key`'s problem; `msg`, if any, is logged at INFO."""
        with self._lock:
            if key not in self._active:
                return
            self._active.discard(key)
        if msg:
            self._logger.info(msg, *args, stacklevel=2)

    def seen(self, key: str) -> bool:
        """Whether `key` is active (was logged and has not cleared)."""
        return key in self._active
