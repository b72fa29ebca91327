"""The one error type that reports every problem of an input at once (flags, environment
variables, a settings line, a web config file), one per line, instead of the first."""

from __future__ import annotations

from collections.abc import Iterable


class Problems(ValueError):
    """Every problem found, one line each; ``problems`` keeps them apart."""

    def __init__(self, problems: Iterable[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
