"""The tuner's change of worker pool in the middle of an epoch, where the order allows it
(a map-style dataset whose sampler runs in the training process, batches in order).

The old iterator's sampler iterator is taken from it (compat.take_indices): it hands out
the batches its workers have in flight, in order, and ends. Then a new iterator under the
new settings starts on the very same sampler iterator (iterator_on), so the loop sees the
same batches in the same order, and nothing more is drawn from the loader's generator or
torch's RNG than an untuned epoch draws: the new iterator's base seed comes from a
generator of its own (order.fresh_seed), and its index sampler is the user's again
once it is built. The new pool starts only once the old one has ended (its memory is
never held twice); a persistent pool is shut down and replaced as the loader's own.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .. import compat


class _Rest:
    """A stand-in for the loader's index sampler while a new iterator is built: its
    iterator is the old one's, its length and everything else the user's sampler's."""

    def __init__(self, rest: Iterator[Any], user: Any) -> None:
        self._rest = rest
        self._user = user

    def __iter__(self) -> Iterator[Any]:
        return self._rest

    def __len__(self) -> int:
        return len(self._user)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._user, name)


def iterator_on(loader: Any, rest: Iterator[Any], build: Callable[[Any], Any]) -> Any:
    """build(loader), torch's new iterator drawing its indices from `rest`; the loader's
    sampler is the user's again before this returns, and so is the iterator's."""
    attr = compat.index_sampler_attr(loader)
    user = getattr(loader, attr)
    object.__setattr__(loader, attr, _Rest(rest, user))  # past DataLoader's own guard
    try:
        it = build(loader)
    finally:
        object.__setattr__(loader, attr, user)
    compat.give_index_sampler(it, user)
    return it


class Drawn:
    """The sampler iterator, remembering the indices drawn from it that have not been
    handed out yet, so that a new pool that fails its first batch gives them back."""

    def __init__(self, rest: Iterator[Any]) -> None:
        while isinstance(rest, Drawn) and rest.drawn is None:  # an earlier switch's, done
            rest = rest._rest
        self._rest: Iterator[Any] = rest
        self.drawn: list[Any] | None = []  # None: no longer kept (the pool delivered)

    def __iter__(self) -> Drawn:
        return self

    def __next__(self) -> Any:
        index = next(self._rest)
        if self.drawn is not None:
            self.drawn.append(index)
        return index

    def forget(self) -> None:
        """The new pool delivered its first batch: nothing will be given back."""
        self.drawn = None

    def undelivered(self) -> Iterator[Any]:
        """The indices drawn and never handed out, then the rest."""
        return itertools.chain(self.drawn or (), self._rest)


class Chain:
    """The old iterator's batches in flight, then those of the iterator `start()` builds
    once the old one has ended. Exceptions pass through where they happen, but one from
    the new iterator's first batch: `fallback(error)` may give an iterator to go on with
    instead (None: the error goes on)."""

    def __init__(self, old: Any, start: Callable[[], Any],
                 fallback: Callable[[Exception], Any], delivered: Callable[[], None]) -> None:
        self.it = old
        self._start: Callable[[], Any] | None = start
        self._fallback: Callable[[Exception], Any] | None = fallback
        self._delivered = delivered  # called once the new iterator's first batch came

    def __iter__(self) -> Chain:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            start, self._start = self._start, None
            if start is None:
                raise
        fallback, self._fallback = self._fallback, None
        try:
            self.it = start()
            batch = next(self.it)
            self._delivered()
            return batch
        except StopIteration:
            raise
        except Exception as e:  # the new pool did not start, or failed its first batch
            again = fallback(e) if fallback is not None else None
            if again is None:
                raise
            self.it = again
            return next(self.it)

    def __len__(self) -> int:
        return len(self.it)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("it", "_start"):
            raise AttributeError(name)
        return getattr(self.it, name)


def switcher(loader: Any, instruments: Any, timed: Any, torch_iter: Callable[[Any], Any],
             again: Callable[[Callable[[Any], Any]], tuple[Any, Any]]
             ) -> Callable[[], tuple[Any, int, Any] | None]:
    """For a tuned loader that can change its pool mid-epoch: at the loop's readings, the
    tuner's pending change made (module docstring). `torch_iter`: the loader's own
    __iter__; `again(torch_iter)`: the iter() planned and started anew
    (iter_start._again), its plan and iterator."""
    from .epoch import setting_of
    from .order import fresh_seed

    # The loop's iterator holds this closure: a weak reference back, so no cycle keeps
    # an abandoned iterator, and its workers, alive until the garbage collector runs.
    timed_ref = weakref.ref(timed)
    del timed

    def switch() -> tuple[Any, int, Any] | None:
        tuning = instruments.tuning
        decision = tuning.pending if tuning is not None else None
        if tuning is None or decision is None:
            return None
        timed = timed_ref()
        if timed is None:
            return None
        old = timed._it
        raw = old.it if isinstance(old, Chain) else old
        rest = compat.take_indices(raw)
        if rest is None:
            tuning.no_switch()
            return None
        tuning.pending = None
        drawn = Drawn(rest)
        seed = compat.base_seed(raw)
        previous = setting_of(loader)

        def build(indices: Iterator[Any]) -> Any:
            pool = compat.persistent_iterator(loader)  # the old pool, or a failed new one
            if pool is not None:
                compat.shut_down(loader, pool)
            instruments.forget_workers()  # the old pool ended on purpose
            seeded = fresh_seed(torch_iter, seed)
            plan, it = again(lambda ld: iterator_on(ld, indices, seeded))
            gen = instruments.track(it, plan.block) if plan.workers else 0
            timed = timed_ref()  # the loop's iterator, alive while it asks for a batch
            if timed is not None:
                timed._gen, timed._count = gen, plan.count
            tuning.remark(loader, warming=True)
            return it

        def start() -> Any:
            tuning.switch(loader, decision)
            return build(drawn)

        def fallback(error: Exception) -> Any:
            if decision.old != 0 or not tuning.cannot_switch(loader, previous, error):
                return None
            return build(drawn.undelivered())

        return Chain(old, start, fallback, drawn.forget), timed._gen, timed._count
    return switch
