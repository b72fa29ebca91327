"""The doctor says why: where the workers' time goes (running, waiting for a CPU, blocked),
their memory, the bottleneck and the advice that follows, and why workers failed. Each
window is built from exposition text as the trainer writes it, read twice 10 s apart."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.settings import for_loader, parse
from dataloader_exporter.core.tuner.model import Load, choose
from dataloader_exporter.diagnosis import tuner_report, why
from dataloader_exporter.diagnosis.doctor import Diagnosis
from dataloader_exporter.diagnosis.machine import Machine
from dataloader_exporter.diagnosis.report import Report, build_report, env_line
from dataloader_exporter.diagnosis.signals import Scrape, Window, loaders

GiB, MiB = 1 << 30, 1 << 20
SECONDS = 10.0
# 8 cores, 64 GiB with 32 available, a 1 GiB /dev/shm, NVMe storage.
MACHINE = Machine(8, None, 64 * GiB, 32 * GiB, GiB, "nvme", "/data")
WORKER_KEYS = {"running_share", "waiting_for_cpu_share", "blocked_share", "rss_bytes",
               "bottleneck"}


def sample(metric: cat.Metric, value: float, suffix: str = "", **labels: str) -> str:
    labels = {"loader": "train", "rank": "0", **labels}
    body = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{metric.name}{suffix}{{{body}}} {value}"


def exposition(k: float, *, workers: int = 2, stall: float = 0.8,
               states: tuple[float, float, float] | None = None,
               pss: float | None = None, rss: float | None = None,
               swap: tuple[float, float] | None = None, max_rss: float | None = None,
               failures: dict[str, float] | None = None, lost: float = 0.0,
               available: float = 32 * GiB, host_swap: tuple[float, float] = (0.0, 0.0),
               cgroup: tuple[float, float] | None = None, batch_bytes: float = MiB,
               shm_size: float = GiB, info: bool = True, prefetch: str = "2",
               persistent: str = "true", stable: float | None = None, tuned: str | None = None,
               changes: dict[tuple[str, str], float] | None = None,
               loop_cpu: float | None = None) -> str:
    """A snapshot after k (0 or 1) windows: counters are k times their window's increase,
    gauges their value (swap gauges move from their first to their second value).
    `states`: the workers' seconds in the window running, waiting for a CPU and blocked;
    pss/rss/swap: summed over the live workers, as the trainer exports them. info: with
    dataloader_info (its prefetch_factor and persistent_workers labels). stable: the
    loader tuner's gauge (None: not tuned); changes: its changes so far by (setting,
    reason), totals as the trainer exports them. loop_cpu: the loop thread's CPU seconds
    in the window (a loader without workers)."""
    lines = [
        sample(cat.TIME, k * SECONDS * stall, "_sum", phase=cat.PHASE_FETCH),
        sample(cat.STEP, k * SECONDS * (1 - stall), "_sum"),
        sample(cat.BATCHES, k * 100), sample(cat.SAMPLES, k * 400),
        sample(cat.WORKERS_CONFIGURED, workers), sample(cat.WORKERS_ACTIVE, workers),
        sample(cat.WORKERS_LOST, lost), sample(cat.BATCH_BYTES, batch_bytes),
        f'{cat.GPU_UTILIZATION.name}{{gpu="0",gpu_uuid="GPU-0"}} 0.3',
        f"{cat.HOST_MEMORY_TOTAL.name} {64 * GiB}",
        f"{cat.HOST_MEMORY_AVAILABLE.name} {available}",
        f"{cat.HOST_SWAP_USED.name} {host_swap[int(k)]}",
        f'{cat.SHM_SIZE.name}{{path="/dev/shm"}} {shm_size}',
    ]
    if info:
        lines.append(sample(cat.INFO, 1, num_workers=str(workers), batch_size="4",
                            prefetch_factor=prefetch, pin_memory="true",
                            persistent_workers=persistent, gpu_uuid="GPU-0"))
    if stable is not None:
        lines.append(sample(cat.TUNER_STABLE, stable, **({"settings": tuned} if tuned else {})))
    lines += [sample(cat.TUNER_CHANGES, n, setting=setting, reason=reason)
              for (setting, reason), n in (changes or {}).items()]
    if loop_cpu is not None:
        lines.append(sample(cat.LOOP_CPU, k * loop_cpu))
    if states is not None:
        lines += [sample(cat.WORKER_TIME, k * v, state=st)
                  for st, v in zip(cat.WORKER_STATES, states, strict=True)]
    for kind, value in (("pss", pss), ("rss", rss)):
        if value is not None:
            lines.append(sample(cat.WORKER_MEMORY, value, kind=kind))
    if swap is not None:
        lines.append(sample(cat.WORKER_MEMORY, swap[int(k)], kind="swap"))
    if max_rss is not None:
        lines.append(sample(cat.WORKER_MAX_RSS, max_rss))
    if failures is not None:
        lines += [sample(cat.FAILURES, failures.get(c, 0.0), cause=c)
                  for c in cat.FAILURE_CAUSES]
    if cgroup is not None:
        lines += [f"{cat.CGROUP_MEMORY_LIMIT.name} {cgroup[0]}",
                  f"{cat.CGROUP_MEMORY_USAGE.name} {cgroup[1]}"]
    return "\n".join(lines) + "\n"


def report(local_ranks: int = 1, **figures: Any) -> Report:
    first = Scrape.parse(exposition(0, **figures), at=1000.0)
    second = Scrape.parse(exposition(1, **figures), at=1000.0 + SECONDS)
    return build_report("test", MACHINE, loaders(Window.between(first, second)), local_ranks)


def diagnosis(local_ranks: int = 1, **figures: Any) -> Diagnosis:
    [d] = report(local_ranks, **figures).diagnoses
    return d


def setting(d: Diagnosis, name: str) -> Any:
    found = [r for r in d.recommendations if r.setting == name]
    return found[0] if found else None


def kinds(d: Diagnosis) -> list[str]:
    return [f.kind for f in d.findings]


# --- the bottleneck and the advice that follows ----------------------------------------------
def test_workers_that_run_most_of_their_time_are_cpu_bound_and_get_the_free_cores() -> None:
    d = diagnosis(workers=2, states=(17.0, 1.0, 2.0), pss=600 * MiB)
    v = d.workers
    assert v.bottleneck == why.CPU
    assert (v.running_share, v.waiting_for_cpu_share, v.blocked_share) == pytest.approx(
        (0.85, 0.05, 0.10))
    assert v.cpu_cores_used == pytest.approx(1.7)
    rec = setting(d, "num_workers")
    assert rec.value == "8" and rec.current == "2"
    assert "run 85% of their time" in rec.why and "6 of the 8 cores per local rank" in rec.why


def test_no_more_workers_when_no_core_is_free_but_cheaper_samples_or_more_cores() -> None:
    d = diagnosis(workers=8, states=(68.0, 4.0, 8.0), pss=8 * 300 * MiB)
    assert d.workers.bottleneck == why.CPU
    assert setting(d, "num_workers") is None
    assert "no core is free for another worker" in d.workers.why
    assert "make samples cheaper" in d.workers.why and "more cores" in d.workers.why
    assert setting(d, "prefetch_factor").value == "2"  # a deeper queue computes nothing


def test_workers_that_wait_for_a_cpu_are_too_many_and_get_fewer() -> None:
    # 8 workers that get 2 cores' worth between them (pinned, or other work on the cores).
    d = diagnosis(workers=8, states=(20.0, 50.0, 10.0), pss=8 * 300 * MiB)
    assert d.workers.bottleneck == why.CONTENTION
    assert d.workers.waiting_for_cpu_share == pytest.approx(0.625)
    rec = setting(d, "num_workers")
    assert rec.value == "2" and rec.current == "8"
    assert "wait for a CPU 62% of their time" in rec.why and "2.0 cores' worth" in rec.why


def test_one_worker_waiting_for_a_cpu_is_not_told_to_go_to_none() -> None:
    d = diagnosis(workers=1, states=(4.0, 5.0, 1.0), pss=300 * MiB)
    assert d.workers.bottleneck == why.CONTENTION and setting(d, "num_workers") is None
    assert "other processes take the cores" in d.workers.why


def test_blocked_workers_get_the_models_count_and_a_deeper_queue() -> None:
    d = diagnosis(workers=2, states=(2.0, 0.0, 18.0), pss=600 * MiB)
    assert d.workers.bottleneck == why.BLOCKED
    rec = setting(d, "num_workers")
    # 0.2 s a batch, 10% of it on a CPU, a 20-ms step: the loop's 50 batches/s take 15
    # workers with headroom for their waits, the tuner's first move from these figures
    # (the machine's NVMe cap of 12 is a guess that the measurement overrides).
    assert rec.value == str(choose(Load(0.2, 0.02, 0.02), 8.0)) == "15"
    assert "more workers overlap the waits" in rec.why
    assert setting(d, "prefetch_factor").value == "4"


def test_blocked_workers_get_the_tuners_count_within_the_cores_their_running_needs() -> None:
    # A batch takes a worker 0.2 s, 0.09 s of it running, and the step 0.02 s. Alone, the
    # 8 cores are no limit: the loop's 50 batches/s take 13 workers. With a second rank
    # its 4 cores hold 36 batches/s of the workers' and the step's CPU: 7.3 workers busy,
    # 10 with headroom for their blocked time. Each is the tuner's model's first move
    # (core/tuner/model.py): one answer for the same figures.
    figures: dict[str, Any] = {"workers": 2, "states": (9.0, 0.0, 11.0), "pss": 600 * MiB}
    assert diagnosis(**figures).workers.bottleneck == why.BLOCKED
    assert setting(diagnosis(**figures), "num_workers").value == "13"
    assert setting(diagnosis(2, **figures), "num_workers").value == "10"
    load = Load(0.2, 0.09, 0.02)
    assert choose(load, 4.0) == 10 and choose(load, 8.0) == 13


def test_memory_caps_the_workers_when_not_one_more_fits() -> None:
    # Blocked workers would take 15, but each holds 4 GiB and 8 GiB is available, of which
    # 10% of 64 GiB stays free: 1.6 GiB, not one more worker.
    d = diagnosis(workers=2, states=(2.0, 0.0, 18.0), pss=8 * GiB, available=8 * GiB)
    v = d.workers
    assert v.bottleneck == why.MEMORY and v.more_workers_memory_allows == 0
    assert setting(d, "num_workers") is None
    assert ("memory, not CPU, is the limit: each worker holds 4.00 GiB (PSS); 1.60 GiB "
            "available allows 0 more") in v.why
    assert setting(d, "prefetch_factor").value == "4"  # the waits still want a deeper queue


def test_memory_caps_the_advice_and_says_so_when_a_few_more_fit() -> None:
    d = diagnosis(workers=2, states=(2.0, 0.0, 18.0), pss=8 * GiB, available=16 * GiB)
    assert d.workers.bottleneck == why.BLOCKED  # more workers still help, two of them
    rec = setting(d, "num_workers")
    assert rec.value == "4"
    assert "memory, not CPU, is the limit" in rec.why and "allows 2 more" in rec.why


def test_the_containers_memory_limit_caps_when_it_is_tighter_than_the_host() -> None:
    d = diagnosis(workers=2, states=(2.0, 0.0, 18.0), pss=2 * GiB,
                  cgroup=(16 * GiB, 12 * GiB))  # 16 x 0.9 - 12 = 2.4 GiB: two more
    assert d.workers.memory_room_source == "cgroup"
    assert d.workers.memory_room_bytes == pytest.approx(2.4 * GiB)
    rec = setting(d, "num_workers")
    assert rec.value == "4" and "the container's memory limit less its usage" in rec.why


def test_rss_is_the_per_worker_memory_when_pss_is_absent() -> None:
    d = diagnosis(workers=2, states=(17.0, 1.0, 2.0), rss=GiB, max_rss=700 * MiB)
    assert d.workers.rss_bytes == 512 * MiB and d.workers.memory_kind == "rss"
    assert d.workers.max_rss_bytes == 700 * MiB


def test_workers_that_swap_are_bound_by_memory_and_get_fewer() -> None:
    d = diagnosis(workers=4, states=(8.0, 0.0, 32.0), pss=4 * GiB, swap=(0.0, 512 * MiB),
                  host_swap=(GiB, 2 * GiB))
    v = d.workers
    assert v.bottleneck == why.MEMORY and v.swapping
    assert "the workers swap (0.50 GiB of theirs in swap, growing)" in v.why
    assert setting(d, "num_workers").value == "3"  # one worker's worth out of swap
    assert setting(d, "prefetch_factor").value == "1"
    assert "workers-swap" in kinds(d) and "swap" not in kinds(d)  # said once, by the workers


def test_host_swap_growing_with_the_workers_swap_in_it_is_memory() -> None:
    d = diagnosis(workers=4, states=(8.0, 0.0, 32.0), pss=4 * GiB, swap=(64 * MiB, 64 * MiB),
                  host_swap=(GiB, 2 * GiB))
    assert d.workers.bottleneck == why.MEMORY


def test_the_bottleneck_is_none_when_the_loop_does_not_wait_for_input() -> None:
    d = diagnosis(workers=2, stall=0.01, states=(2.0, 0.0, 18.0), pss=600 * MiB)
    assert d.verdict == "not input-bound" and d.workers.bottleneck == why.NONE
    assert d.workers.blocked_share == pytest.approx(0.9)  # figures still shown
    assert setting(d, "num_workers") is None
    assert not [u for u in d.unknowns if "why the input is slow" in u]


def test_absent_worker_figures_give_unknown_and_no_advice_drawn_from_them() -> None:
    d = diagnosis(workers=2)
    v = d.workers
    assert v.bottleneck == why.UNKNOWN
    assert v.running_share is None and v.rss_bytes is None and v.cpu_cores_used is None
    assert ("rank 0: why the input is slow is unknown: no worker time figures; /proc figures "
            "(Linux) from a loader with workers would tell") in d.unknowns
    rec = setting(d, "num_workers")  # the configuration's advice, as without these figures
    assert rec.value == "8" and "can load in parallel" in rec.why
    for word in ("blocked", "run ", "wait for a CPU", "memory, not CPU"):
        assert word not in rec.why
    assert any("not checked against memory" in u and u.startswith("rank 0")
               for u in d.unknowns)


def test_a_loader_without_workers_is_unknown_because_it_has_none() -> None:
    d = diagnosis(workers=0)
    assert d.workers.bottleneck == why.UNKNOWN
    assert any("the loader has no workers (num_workers=0)" in u for u in d.unknowns)


def test_a_loader_without_workers_gets_the_tuners_first_move_from_its_loops_cpu_time() -> None:
    # 100 batches in 10 s, the loop waits 95%: 95 ms a fetch, 5 ms a step. The loop's
    # thread ran 1 s: at most 10 ms of each fetch is CPU (counted as the fetch's first),
    # so its samples mostly wait on storage: workers past the 8 cores, the model's 28 (the
    # tuner's first move; the machine's NVMe does not cap what was measured).
    blocked = diagnosis(workers=0, stall=0.95, loop_cpu=1.0)
    load = Load(0.095, 0.01, 0.005)
    assert setting(blocked, "num_workers").value == str(choose(load, 8.0)) == "28"
    assert "the tuner's model gives 28" in setting(blocked, "num_workers").why
    # The thread ran all the time: CPU-bound samples, no more workers than the cores.
    busy = diagnosis(workers=0, stall=0.95, loop_cpu=SECONDS)
    assert setting(busy, "num_workers").value == str(choose(Load(0.095, 0.095, 0.005), 8.0))
    assert int(setting(busy, "num_workers").value) == 8
    # Two ranks share the cores: each gets the model's count for its 4.
    assert setting(diagnosis(2, workers=0, stall=0.95, loop_cpu=SECONDS),
                   "num_workers").value == "4"
    # Without the loop's CPU time: the advice from the configuration, as before.
    unknown = setting(diagnosis(workers=0), "num_workers")
    assert "the tuner's model" not in unknown.why


def test_a_run_read_whole_takes_its_shares_from_totals_and_claims_no_swap_growth() -> None:
    text = exposition(1, workers=4, states=(8.0, 0.0, 32.0), pss=4 * GiB,
                      swap=(512 * MiB, 512 * MiB))
    [d] = build_report("test", MACHINE, loaders(Window.whole_run(Scrape.parse(text))),
                       1).diagnoses
    assert d.workers.blocked_share == pytest.approx(0.8)
    assert d.workers.bottleneck == why.BLOCKED and not d.workers.swapping


# --- failures ------------------------------------------------------------------------------
@pytest.mark.parametrize(("cause", "words"), [
    ("shm", ("/dev/shm full", "--shm-size=", "sizeLimit", "lower num_workers")),
    ("oom", ("OOM killer", "each worker holds 0.50 GiB (PSS)", "fewer workers",
             "higher memory limit")),
    ("killed", ("not by the OOM killer", "OOM-kill count did not rise")),
    ("crash", ("native code", "num_workers=0", "traceback")),
    ("error", ("the dataset or collate_fn raised", "num_workers=0")),
])
def test_each_failure_cause_is_a_finding_with_its_fix(cause: str, words: tuple[str, ...]
                                                      ) -> None:
    d = diagnosis(workers=2, states=(17.0, 1.0, 2.0), pss=GiB, failures={cause: 1.0})
    [entry] = d.failures
    assert entry["cause"] == cause and entry["count"] == 1.0 and entry["fix"]
    [finding] = [f for f in d.findings if f.kind == f"failure-{cause}"]
    for word in words:
        assert word in finding.message, (word, finding.message)


def test_a_shm_failure_gives_the_size_to_use_from_the_batches_in_flight() -> None:
    # 64 MiB batches x prefetch 2 x 2 workers x 1.5 = 384 MiB in flight, /dev/shm 256 MiB.
    d = diagnosis(workers=2, batch_bytes=64 * MiB, shm_size=256 * MiB, failures={"shm": 2})
    [entry] = d.failures
    assert entry["shm_size_bytes"] == 256 * MiB and entry["in_flight_bytes"] == 384 * MiB
    assert entry["shm_size"] == "1g" and entry["count"] == 2
    fix, seen = str(entry["fix"]), str(entry["seen"])
    assert "--shm-size=1g" in fix and "sizeLimit: 1Gi" in fix and "2 failures" in seen


def test_an_oom_failure_carries_the_per_worker_memory_and_stops_advice_to_add_workers() -> None:
    d = diagnosis(workers=2, states=(17.0, 1.0, 2.0), pss=2 * GiB, max_rss=1536 * MiB,
                  failures={"oom": 1}, cgroup=(32 * GiB, 8 * GiB))
    [entry] = d.failures
    assert entry["worker_memory_bytes"] == GiB and entry["memory_kind"] == "pss"
    assert entry["max_worker_rss_bytes"] == 1536 * MiB
    assert entry["memory_limit_bytes"] == 32 * GiB
    assert setting(d, "num_workers") is None  # cores are free, but memory already ran out


def test_only_causes_seen_are_listed() -> None:
    assert diagnosis(workers=2, failures={}).failures == []
    d = diagnosis(workers=2, failures={"crash": 1, "killed": 3})
    assert [(f["cause"], f["count"]) for f in d.failures] == [("killed", 3), ("crash", 1)]


def test_lost_workers_name_the_causes_seen_instead_of_guessing() -> None:
    d = diagnosis(workers=2, lost=1, failures={"oom": 1})
    [lost] = [f.message for f in d.findings if f.kind == "lost-workers"]
    assert "causes: oom 1" in lost and "dmesg" not in lost


def test_a_lost_worker_without_exported_causes_says_the_cause_is_not_known() -> None:
    d = diagnosis(workers=2, lost=1)
    [lost] = [f.message for f in d.findings if f.kind == "lost-workers"]
    assert "the cause is not known" in lost and cat.FAILURES.name in lost
    assert d.failures == []


def test_a_lost_worker_whose_cause_was_not_observed_says_so() -> None:
    d = diagnosis(workers=2, lost=1, failures={})
    [lost] = [f.message for f in d.findings if f.kind == "lost-workers"]
    assert "no cause was observed" in lost


# --- the report --------------------------------------------------------------------------
def test_the_json_has_workers_and_failures_for_each_loader() -> None:
    r = report(workers=2, states=(17.0, 1.0, 2.0), pss=600 * MiB, failures={"crash": 1})
    data = json.loads(json.dumps(r.as_dict()))
    [loader] = data["loaders"]
    assert set(loader["workers"]) >= WORKER_KEYS
    assert loader["workers"]["bottleneck"] in why.BOTTLENECKS
    assert loader["workers"]["rss_bytes"] == 300 * MiB
    assert loader["workers"]["memory_kind"] == "pss"
    assert [{k: f[k] for k in ("cause", "count")} for f in loader["failures"]] == [
        {"cause": "crash", "count": 1}]
    unknown = json.loads(json.dumps(report(workers=2).as_dict()))["loaders"][0]
    assert unknown["workers"]["bottleneck"] == "unknown"
    assert unknown["workers"]["running_share"] is None and unknown["failures"] == []


def test_the_text_says_where_the_workers_time_went_and_the_bottleneck() -> None:
    text = report(workers=2, states=(17.0, 1.0, 2.0), pss=600 * MiB).text()
    assert ("  workers: running 85%, waiting for a CPU 5%, blocked 10% of their time (1.7 "
            "cores running); 0.29 GiB each (PSS); bottleneck: cpu - the workers run 85% of their "
            "time: the samples cost CPU\n"
            ) in text
    assert "bottleneck: unknown" in report(workers=2).text()
    quiet = report(workers=0, stall=0.01).text()
    assert "workers:" not in quiet  # nothing measured, nothing waiting: no line


def test_the_env_line_carries_fewer_workers_for_cpu_contention() -> None:
    r = report(workers=8, states=(20.0, 50.0, 10.0), pss=8 * 300 * MiB)
    settings = parse(env_line(r)[0].partition("=")[2])
    assert for_loader(settings, "train")["num_workers"] == 2




# --- the loader tuner ----------------------------------------------------------------------
TRIED = {("num_workers", "starved"): 1.0, ("num_workers", "reverted"): 1.0}
BLOCKED: dict[str, Any] = {"workers": 2, "states": (2.0, 0.0, 18.0), "pss": 600 * MiB,
                           "persistent": "false"}  # untuned: num_workers=15, prefetch 4


def test_a_loader_the_tuner_still_tries_gets_no_workers_or_queue_advice_but_the_rest() -> None:
    untuned = diagnosis(**BLOCKED)
    assert setting(untuned, "num_workers").value == "15" and untuned.tuner is None
    d = diagnosis(**BLOCKED, stable=0, changes=TRIED)
    t = d.tuner
    assert t is not None and t.trying and t.state == "trying"
    assert (t.num_workers, t.prefetch_factor, t.changes) == (2, 2, 2)
    assert t.held == ["num_workers", "prefetch_factor"]
    assert setting(d, "num_workers") is None and setting(d, "prefetch_factor") is None
    assert setting(d, "persistent_workers").value == "True"  # not the tuner's: still advised
    assert setting(d, "non_blocking") is not None
    assert d.workers.bottleneck == why.BLOCKED  # the diagnosis itself is the same
    assert not [u for u in d.unknowns if "memory" in u]  # nothing judged for the held advice


def test_shm_advice_for_a_loader_the_tuner_tries_is_for_its_settings_now() -> None:
    # 256 MiB batches x prefetch 2 x 2 workers x 1.5 = 1.5 GiB in flight, /dev/shm 256 MiB.
    d = diagnosis(workers=2, batch_bytes=256 * MiB, shm_size=256 * MiB, stable=0)
    assert "shm-risk" in kinds(d) and setting(d, "num_workers") is None
    shm = setting(d, "--shm-size")
    assert shm.value == "2g" and "about 1.50 GiB are in flight" in shm.why


def test_a_stable_tuned_loader_says_where_it_settled_and_gets_the_doctors_advice() -> None:
    d = diagnosis(**BLOCKED, stable=1, changes=TRIED)
    assert d.tuner is not None and d.tuner.state == "stable" and d.tuner.held == []
    assert setting(d, "num_workers").value == "15"  # the tuner has stopped: advice again
    text = report(**BLOCKED, stable=1, changes=TRIED).text()
    assert ("\n  tuner: the loader tuner is stable at num_workers=2, prefetch_factor=2, after 2 "
            "changes (num_workers: starved 1, reverted 1); --format env keeps num_workers and "
            "prefetch_factor auto\n") in text


def test_the_text_says_the_tuner_still_tries_with_its_settings_now_and_its_changes() -> None:
    text = report(**BLOCKED, stable=0, changes=TRIED).text()
    assert ("\n  tuner: the loader tuner is still trying settings, now num_workers=2, "
            "prefetch_factor=2; 2 changes so far (num_workers: starved 1, reverted 1); no "
            "num_workers or prefetch_factor advice while it sets them\n") in text
    assert "    num_workers=" not in text and "    prefetch_factor=" not in text
    assert "    persistent_workers=True (now False)" in text
    first = report(workers=0, prefetch="", stable=0).text()  # before its first change
    assert ("now num_workers=0 (no prefetch_factor without workers); no change yet;"
            in first)
    assert "tuner:" not in report(**BLOCKED).text()  # not tuned: no line


def test_a_tuned_loaders_settings_without_dataloader_info_are_said_unknown() -> None:
    d = diagnosis(workers=2, info=False, stable=0)
    assert d.tuner is not None and d.tuner.num_workers is None
    assert d.tuner.prefetch_factor is None
    assert ("tuner: the loader tuner is still trying settings, now num_workers and "
            "prefetch_factor unknown (no dataloader_info in the metrics)") in report(
        workers=2, info=False, stable=0).text()
    unknown_queue = diagnosis(workers=2, prefetch="", stable=1)
    assert unknown_queue.tuner is not None and unknown_queue.tuner.prefetch_factor is None
    assert "stable at num_workers=2, prefetch_factor=unknown, without a change" in report(
        workers=2, prefetch="", stable=1).text()


def test_the_json_has_the_tuner_for_a_tuned_loader_and_null_otherwise() -> None:
    data = json.loads(json.dumps(report(**BLOCKED, stable=0, changes=TRIED).as_dict()))
    [loader] = data["loaders"]
    assert loader["tuner"] == {
        "state": "trying", "num_workers": 2, "prefetch_factor": 2, "changes": 2,
        "held": ["num_workers", "prefetch_factor"],
        "settings": ["num_workers", "prefetch_factor"],  # no settings label: both
        "persistent": None,  # only where the tuner sets persistent_workers
        "by_reason": [{"setting": "num_workers", "reason": "reverted", "count": 1},
                      {"setting": "num_workers", "reason": "starved", "count": 1}]}
    assert json.loads(json.dumps(report(**BLOCKED).as_dict()))["loaders"][0]["tuner"] is None


@pytest.mark.parametrize("stable", [0, 1])
def test_the_env_line_keeps_auto_for_a_tuned_loader_and_numbers_for_the_others(
        stable: float) -> None:
    tuned = exposition(1, **BLOCKED, stable=stable, changes=TRIED)
    untuned = exposition(1, **BLOCKED).replace('loader="train"', 'loader="val"')
    first = Scrape.parse(exposition(0, **BLOCKED, stable=stable, changes=TRIED) + exposition(
        0, **BLOCKED).replace('loader="train"', 'loader="val"'), at=1000.0)
    second = Scrape.parse(tuned + untuned, at=1000.0 + SECONDS)
    r = build_report("test", MACHINE, loaders(Window.between(first, second)), 1)
    line, skipped = env_line(r)
    settings = parse(line.partition("=")[2])  # "auto" parses: what the doctor prints applies
    assert skipped == [] and "train.num_workers=auto,train.prefetch_factor=auto" in line
    train, val = for_loader(settings, "train"), for_loader(settings, "val")
    assert train == {"num_workers": "auto", "prefetch_factor": "auto",
                     "persistent_workers": True}
    assert val == {"num_workers": 15, "prefetch_factor": 4, "persistent_workers": True}


def test_a_tuned_loader_with_nothing_else_to_change_still_keeps_auto_in_the_env_line() -> None:
    # Idle in the window: no advice at all, but the line replaces the one that asked for
    # the tuner, so its auto stays.
    text = exposition(1, workers=2, stable=1)
    r = build_report("test", MACHINE, loaders(Window.between(
        Scrape.parse(text, at=1000.0), Scrape.parse(text, at=1000.0 + SECONDS))), 1)
    [d] = r.diagnoses
    assert d.verdict == "idle" and d.recommendations == []
    assert env_line(r)[0].endswith("=train.num_workers=auto,train.prefetch_factor=auto")


def test_a_tuner_is_read_per_loader_and_rank() -> None:
    text = (exposition(1, workers=2, stable=1, changes={("num_workers", "cores"): 3})
            + exposition(1, workers=2).replace('rank="0"', 'rank="1"'))
    tuner = {s.rank: s.tuner for s in loaders(Window.whole_run(Scrape.parse(text)))}
    assert tuner["1"] is None
    assert tuner["0"] is not None and tuner["0"].stable
    assert tuner["0"].changes == {("num_workers", "cores"): 3}


def test_the_env_line_keeps_auto_only_for_the_settings_the_tuner_sets() -> None:
    # tune=("num_workers",): auto for it, and prefetch_factor stays the user's. Changes
    # that start at 0 are no changes.
    text = exposition(1, workers=2, stable=1, tuned="num_workers",
                      changes={("num_workers", "cores"): 0, ("num_workers", "starved"): 1})
    r = build_report("test", MACHINE, loaders(Window.between(
        Scrape.parse(text, at=1000.0), Scrape.parse(text, at=1000.0 + SECONDS))), 1)
    [d] = r.diagnoses
    assert d.tuner is not None and d.tuner.settings == ("num_workers",)
    assert [c["reason"] for c in d.tuner.by_reason] == ["starved"]
    assert env_line(r)[0].endswith("=train.num_workers=auto")


def test_only_the_settings_the_tuner_sets_are_held() -> None:
    # tune=("num_workers",): its advice waits for the tuner; prefetch_factor's does not.
    d = diagnosis(**BLOCKED, stable=0, changes=TRIED, tuned="num_workers")
    assert d.tuner is not None and d.tuner.held == ["num_workers"]
    assert setting(d, "num_workers") is None
    assert setting(d, "prefetch_factor").value == "4"  # as for the untuned loader
    assert "no num_workers advice while it sets it" in tuner_report.line(d.tuner)


def _persistent_advice(k_stable: float, changes: dict[tuple[str, str], float]) -> Any:
    tuned = "num_workers,prefetch_factor,persistent_workers"
    first = Scrape.parse(exposition(0, **BLOCKED, stable=k_stable,
                                    tuned=tuned, changes=changes), at=1000.0)
    second = Scrape.parse(exposition(1, **BLOCKED, stable=k_stable,
                                     tuned=tuned, changes=changes), at=1000.0 + SECONDS)
    [d] = build_report("test", MACHINE, loaders(Window.between(first, second)), 1).diagnoses
    return d


def test_the_doctor_holds_persistent_workers_advice_while_the_tuner_decides_it() -> None:
    d = _persistent_advice(0, {})
    assert d.tuner.held == ["num_workers", "prefetch_factor", "persistent_workers"]
    assert "persistent_workers" not in [r.setting for r in d.recommendations]
    assert "persistent_workers=false" in tuner_report.line(d.tuner)
    # Stable, with a pool it never had to let go: the doctor's own advice is back.
    d = _persistent_advice(1, {("persistent_workers", "dataset-changed"): 0.0})
    assert "persistent_workers" in [r.setting for r in d.recommendations]


def test_no_persistent_workers_advice_once_the_tuner_saw_the_dataset_change() -> None:
    d = _persistent_advice(1, {("persistent_workers", "dataset-changed"): 1.0})
    assert "persistent_workers" not in [r.setting for r in d.recommendations]
    assert any("change the dataset between epochs" in u for u in d.unknowns), d.unknowns


def test_the_doctor_and_the_tuner_give_one_count_for_the_same_figures() -> None:
    """BLOCKED's window as the tuner measures it: 100 batches in 10 s, the workers running
    2 s and blocked 18 s, the loop's step 2 s, on the same 8 cores: the tuner's move is
    the doctor's advice."""
    from dataloader_exporter.core.tuner.rules import Tuner
    from dataloader_exporter.core.tuner.types import Budget, Epoch, Setting

    epoch = Epoch(Setting(2, 2), 40.0, 0.8, running=0.1, waiting_cpu=0.0, blocked=0.9,
                  worker_bytes=300 * MiB, batch_bytes=MiB, load=Load(0.2, 0.02, 0.02))
    decision = Tuner(Setting(2, 2)).observe(epoch, Budget(cores=7, memory_room=16 * GiB,
                                                          shm_room=GiB, cpus=8.0))
    assert decision is not None and decision.name == "num_workers"
    assert setting(diagnosis(**BLOCKED), "num_workers").value == str(decision.new) == "15"
