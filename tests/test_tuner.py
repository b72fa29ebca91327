"""The tuner's decisions (core/tuner/rules.py), driven by a small model of an input pipeline
whose figures are those the instrumentation measures: samples/s, the loop's stall share,
the workers' running and waiting-for-CPU shares. The real loop, with real workers, is
test_tuner_loader.py's; these tests pin the rules: converge, stay, respect budgets, go
back when a change did not help, and never move on an unknown figure."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dataloader_exporter.core import bands
from dataloader_exporter.core.tuner.rules import MAX_TRIALS, UNSEEN_EPOCHS, Tuner
from dataloader_exporter.core.tuner.types import Budget, Decision, Epoch, Setting

GiB = 1 << 30


@dataclass(frozen=True)
class Pipeline:
    """A CPU-bound pipeline: each batch costs `cpu` core-seconds in a worker (or in the
    loop with no workers), the step `step` seconds, on `cores` cores for the workers;
    `ceiling` caps batches/s whatever the workers (storage, a lock)."""

    cpu: float = 0.04
    step: float = 0.01
    cores: int = 8
    ceiling: float = float("inf")
    batch: int = 32  # samples

    def run(self, s: Setting, worker_bytes: int = GiB // 4, batch_bytes: int = 1 << 20,
            burstiness: float | None = 1.5) -> Epoch:
        if s.workers == 0:
            rate = min(self.ceiling, 1 / (self.cpu + self.step))
            stall = self.cpu * rate
            return Epoch(s, rate * self.batch, stall, worker_bytes=worker_bytes,
                         batch_bytes=batch_bytes, burstiness=burstiness)
        parallel = min(s.workers, self.cores)
        rate = min(self.ceiling, 1 / self.step, parallel / self.cpu)
        stall = max(0.0, 1 - rate * self.step)
        waiting = max(0.0, 1 - self.cores / s.workers)
        running = min(1.0, rate * self.cpu / s.workers)
        return Epoch(s, rate * self.batch, stall, running=running, waiting_cpu=waiting,
                     blocked=max(0.0, 1 - running - waiting), worker_bytes=worker_bytes,
                     batch_bytes=batch_bytes, burstiness=burstiness)


def room(free: int | None, used_now: int) -> int | None:
    return None if free is None else free - used_now


def tune(pipe: Pipeline, tuner: Tuner, epochs: int, cores: int = 8, memory: int | None = 8 * GiB,
         shm: int | None = 8 * GiB, worker_bytes: int = GiB // 4, batch_bytes: int = 1 << 20,
         burstiness: float | None = 1.5) -> tuple[list[Setting], list[Decision]]:
    """Runs `epochs` epochs; the room left is read each epoch, as the loader reads it: what
    the machine had free less what the current workers and batches in flight take."""
    settings, decisions = [], []
    setting = tuner.start
    for _ in range(epochs):
        settings.append(setting)
        budget = Budget(cores, room(memory, setting.workers * worker_bytes),
                        room(shm, int(setting.workers * setting.prefetch * batch_bytes
                                      * bands.SHM_SAFETY)))
        epoch = pipe.run(setting, worker_bytes, batch_bytes, burstiness)
        decision = tuner.observe(epoch, budget)
        if decision is not None:
            decisions.append(decision)
            setting = decision.setting
    return settings, decisions


def best_fixed(pipe: Pipeline, most: int) -> float:
    return max(pipe.run(Setting(n, 2)).samples_per_s for n in range(most + 1))


FREE = Budget(cores=8, memory_room=8 * GiB, shm_room=8 * GiB)


def test_a_starved_loader_converges_near_the_best_fixed_worker_count_and_stays() -> None:
    pipe = Pipeline(cores=8)
    tuner = Tuner(Setting(0, 2))
    settings, decisions = tune(pipe, tuner, 20)
    assert tuner.stable
    last = pipe.run(settings[-1]).samples_per_s
    assert last >= 0.9 * best_fixed(pipe, 8), (settings[-1], decisions)
    changed = [i for i in range(1, len(settings)) if settings[i] != settings[i - 1]]
    assert changed and changed[-1] <= MAX_TRIALS + 1, changed  # then it stays
    assert len(decisions) <= MAX_TRIALS + 1


def test_the_first_move_says_what_was_measured() -> None:
    tuner = Tuner(Setting(2, 2))
    decision = tuner.observe(Epoch(Setting(2, 2), 500.0, 0.41, running=0.96, waiting_cpu=0.0,
                                   worker_bytes=GiB // 4, batch_bytes=1 << 20), FREE)
    assert decision is not None
    assert decision.line("train") == ("dataloader 'train': num_workers 2 -> 4: workers ran "
                                      "96% of the time, loop waited 41%, 6 of 8 cores free")
    assert decision.reason == "starved"


def test_the_cores_the_rank_may_use_are_never_exceeded() -> None:
    settings, _ = tune(Pipeline(cores=8), Tuner(Setting(0, 2)), 20, cores=3)
    assert max(s.workers for s in settings) == 3  # the machine has 8; the rank's share is 3


def test_memory_room_bounds_the_workers_added() -> None:
    settings, _ = tune(Pipeline(), Tuner(Setting(1, 2)), 20, memory=GiB * 5 // 2,
                       worker_bytes=GiB)
    assert max(s.workers for s in settings) == 2  # 2.5 GiB free: two workers of 1 GiB


def test_shm_room_bounds_the_batches_in_flight() -> None:
    batch = 64 << 20
    shm = int(6 * batch * bands.SHM_SAFETY)  # room for 6 batches in flight
    settings, _ = tune(Pipeline(), Tuner(Setting(1, 2)), 20, shm=shm, batch_bytes=batch)
    assert max(s.workers * s.prefetch for s in settings) <= 6
    assert max(s.workers for s in settings) == 3


def test_an_unknown_figure_blocks_the_move_it_would_justify() -> None:
    unknown_running = Epoch(Setting(2, 2), 100.0, 0.5, running=None, waiting_cpu=0.0,
                            worker_bytes=GiB, batch_bytes=1 << 20)
    assert Tuner(Setting(2, 2)).observe(unknown_running, FREE) is None
    unknown_memory = Epoch(Setting(2, 2), 100.0, 0.5, running=0.9, waiting_cpu=0.0,
                           worker_bytes=None, batch_bytes=1 << 20)
    assert Tuner(Setting(2, 2)).observe(unknown_memory, FREE) is None
    known = Epoch(Setting(2, 2), 100.0, 0.5, running=0.9, waiting_cpu=0.0, worker_bytes=GiB,
                  batch_bytes=1 << 20)
    assert Tuner(Setting(2, 2)).observe(known, Budget(cores=8)) is None  # room unknown
    assert Tuner(Setting(2, 2)).observe(known, FREE) is not None


def test_a_change_that_did_not_help_is_reverted_after_two_windows_and_not_tried_again(
        ) -> None:
    pipe = Pipeline(ceiling=50.0)  # storage caps it at 50 batches/s: 2 busy workers reach it
    tuner = Tuner(Setting(2, 2))
    settings, decisions = tune(pipe, tuner, 12)
    assert [d.reason for d in decisions] == ["starved", "reverted"], decisions
    # One window may lie on a busy machine: a trial that did not pay is measured twice.
    assert settings[1].workers > 2 and settings[2] == settings[1]
    assert settings[3:] == [Setting(2, 2)] * 9
    assert tuner.stable
    assert tuner.settings_line("train") == "train.num_workers=2,train.prefetch_factor=2"


def test_workers_waiting_for_a_cpu_are_cut() -> None:
    pipe = Pipeline(cores=2)
    decision = Tuner(Setting(8, 2)).observe(pipe.run(Setting(8, 2)), FREE)
    assert decision is not None and decision.reason == "cpu-contention"
    assert decision.new < 8 and "waited for a CPU 75%" in decision.why


def test_an_iterable_datasets_worker_count_is_never_changed() -> None:
    # Starved, workers idle a quarter of the time, the wait in bursts: the tuner moves,
    # but only the queue's depth (and goes back: storage caps the rate).
    tuner = Tuner(Setting(2, 2), workers=False)
    settings, decisions = tune(Pipeline(cpu=0.01, ceiling=50.0), tuner, 12, burstiness=6.0)
    assert {s.workers for s in settings} == {2}
    assert [(d.name, d.reason) for d in decisions] == [("prefetch_factor", "bursty"),
                                                       ("prefetch_factor", "reverted")]
    starved = Tuner(Setting(2, 2), workers=False)
    _, grown = tune(Pipeline(cpu=0.04), starved, 12)  # busy workers: more would help
    assert grown == [] and starved.stable


def test_a_bursty_wait_with_idle_workers_deepens_the_queue() -> None:
    epoch = Epoch(Setting(4, 2), 800.0, 0.2, running=0.3, waiting_cpu=0.0,
                  worker_bytes=GiB // 4, batch_bytes=1 << 20, burstiness=6.0)
    decision = Tuner(Setting(4, 2)).observe(epoch, FREE)
    assert decision is not None and (decision.name, decision.new) == ("prefetch_factor", 4)


def test_a_loader_that_keeps_up_is_left_alone() -> None:
    tuner = Tuner(Setting(1, 2))
    settings, decisions = tune(Pipeline(cpu=0.01, step=0.05), tuner, 5)
    assert decisions == [] and tuner.stable and set(settings) == {Setting(1, 2)}


def test_workers_past_the_cores_are_cut_and_kept_only_where_they_were_faster() -> None:
    one = Budget(cores=1, memory_room=8 * GiB, shm_room=8 * GiB)

    def epoch(workers: int, rate: float) -> Epoch:
        return Epoch(Setting(workers, 2), rate, 0.3, running=0.9, waiting_cpu=0.1,
                     worker_bytes=GiB // 4, batch_bytes=1 << 20)

    # Just as fast with one worker as with three: the cut stays.
    tuner = Tuner(Setting(3, 2))
    cut = tuner.observe(epoch(3, 300.0), one)
    assert cut is not None and (cut.reason, cut.new) == ("cores", 1)
    assert tuner.observe(epoch(1, 290.0), one) is None
    assert tuner.current == Setting(1, 2) and tuner.stable
    # Three were faster (the machine had the cores): back after one epoch, and it stays.
    tuner = Tuner(Setting(3, 2))
    assert tuner.observe(epoch(3, 300.0), one) is not None
    back = tuner.observe(epoch(1, 150.0), one)
    assert back is not None and (back.reason, back.new) == ("reverted", 3)
    for _ in range(4):
        assert tuner.observe(epoch(3, 300.0), one) is None
    assert tuner.current == Setting(3, 2)


def test_auto_is_a_value_for_the_tunable_settings_only() -> None:
    from dataloader_exporter.core.settings import (
        AUTO,
        SettingsError,
        format_settings,
        parse,
        tuned,
    )

    line = parse("train.num_workers=auto,*.prefetch_factor=AUTO,val.num_workers=2")
    assert [s.value for s in line] == [AUTO, AUTO, 2]
    assert tuned(line, "train") == ("num_workers", "prefetch_factor")
    assert tuned(line, "val") == ("prefetch_factor",)  # its own num_workers wins
    assert parse("train.num_workers=0,train.prefetch_factor=auto")  # no clash: tuned
    assert tuned(parse("train.persistent_workers=auto"), "train") == ("persistent_workers",)
    for bad in ("train.pin_memory=auto",
                "train.num_workers=automatic"):
        try:
            parse(bad)
        except SettingsError as e:
            assert "auto" in str(e) or "true or false" in str(e), e
        else:
            raise AssertionError(bad)
    assert format_settings("train", {"num_workers": AUTO}) == "train.num_workers=auto"


def first_worker(rate: float, budget: Budget) -> Tuner:
    """A tuner that has just given a loop without workers (at `rate`) its first one."""
    tuner = Tuner(Setting(0, 2))
    first = tuner.observe(Epoch(Setting(0, 2), rate, 0.6, worker_bytes=GiB // 4,
                                batch_bytes=1 << 20), budget)
    assert first is not None and (first.reason, first.new) == ("starved", 1)
    return tuner


def test_unknown_worker_shares_are_waited_for_then_it_settles() -> None:
    budget = Budget(cores=4, memory_room=8 * GiB, shm_room=8 * GiB)
    tuner = first_worker(100.0, budget)
    blind = Epoch(Setting(1, 2), 180.0, 0.4, worker_bytes=GiB // 4, batch_bytes=1 << 20)
    assert tuner.observe(blind, budget) is None and not tuner.stable  # kept: 180 > 105
    seen = replace(blind, running=0.95, waiting_cpu=0.02)
    grown = tuner.observe(seen, budget)
    assert grown is not None and (grown.old, grown.new) == (1, 2)
    never = Tuner(Setting(1, 2))
    for _ in range(UNSEEN_EPOCHS):
        assert never.observe(blind, budget) is None and not never.stable
    assert never.observe(blind, budget) is None and never.stable


def test_cuts_that_each_cost_a_little_do_not_add_up_to_a_slower_job() -> None:
    budget = Budget(cores=8, memory_room=8 * GiB, shm_room=8 * GiB)
    tuner = Tuner(Setting(8, 2))

    def epoch(workers: int, rate: float) -> Epoch:
        return Epoch(Setting(workers, 2), rate, 0.3, running=0.6, waiting_cpu=0.3,
                     worker_bytes=GiB // 4, batch_bytes=1 << 20)

    cut = tuner.observe(epoch(8, 100.0), budget)
    assert cut is not None and (cut.reason, cut.new) == ("cpu-contention", 6)
    again = tuner.observe(epoch(6, 96.0), budget)  # 4% slower: kept, and cut again
    assert again is not None and again.new == 5
    back = tuner.observe(epoch(5, 94.0), budget)  # 6% below the 100 it started from
    assert back is not None and (back.reason, back.new) == ("reverted", 6)
    assert "fell more than 5% below 100" in back.why


def test_rates_restart_when_samples_can_no_longer_be_counted() -> None:
    budget = Budget(cores=8, memory_room=8 * GiB, shm_room=8 * GiB)
    tuner = first_worker(3200.0, budget)
    # The same epoch rate counted in batches (32 a batch) is no revert: the unit changed.
    batches = Epoch(Setting(1, 2), 110.0, 0.3, running=0.9, waiting_cpu=0.0,
                    worker_bytes=GiB // 4, batch_bytes=1 << 20, unit="batches")
    decision = tuner.observe(batches, budget)
    assert decision is None or decision.reason != "reverted"
