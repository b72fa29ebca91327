"""The loaders large jobs train with, through wrap(), side by side with the bare loader:
torchdata's StatefulDataLoader (resume included), Hugging Face style text batches,
batch_size=None over batches made in the workers, and webdataset's WebLoader with and
without rebatching. What the loop takes is what is counted; what cannot be counted is
not exported."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import scrape, value
from support.procs import REPO, SCRIPTS, Run, built_at, run_script
from support.required import require_module
from support.torch_helpers import SleepDataset
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat

pytestmark = [pytest.mark.torch, pytest.mark.slow]

L = {"loader": "t", "rank": "0"}


def plain(b: Any) -> Any:
    """A batch as comparable Python data."""
    if isinstance(b, torch.Tensor):
        return b.tolist()
    if isinstance(b, dict):
        return {k: plain(v) for k, v in b.items()}
    if isinstance(b, (list, tuple)):
        return [plain(x) for x in b]
    if hasattr(b, "tolist"):  # numpy
        return b.tolist()
    return b


def per_worker(registry: CollectorRegistry, metric: cat.Metric) -> dict[str, float]:
    return {dict(labels)["worker"]: v for (name, labels), v in scrape(registry).items()
            if name == metric.name}


# --- torchdata's StatefulDataLoader ------------------------------------------------------
def stateful(workers: int, persistent: bool = False) -> Any:
    sdl = require_module("torchdata.stateful_dataloader")
    return sdl.StatefulDataLoader(SleepDataset(20), batch_size=3, shuffle=True,
                                  num_workers=workers, persistent_workers=persistent,
                                  generator=torch.Generator().manual_seed(1))


def resumed_run(make: Any) -> tuple[list[Any], int, int]:
    """A full epoch, 5 batches, state_dict(), a fresh loader, load_state_dict(), the rest:
    every batch the loop saw, and its own count of batches and samples."""
    loader = make()
    seen = [plain(b) for b in loader]
    it = iter(loader)
    seen += [plain(next(it)) for _ in range(5)]
    state = loader.state_dict()
    fresh = make()
    fresh.load_state_dict(state)
    seen += [plain(b) for b in fresh]
    return seen, len(seen), sum(len(b[1]) for b in seen)


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_a_stateful_dataloader_is_measured_and_resumes_exactly_as_without_us(
        registry: CollectorRegistry, workers: int, persistent: bool) -> None:
    bare, bare_batches, _ = resumed_run(lambda: stateful(workers, persistent))
    ours, batches, samples = resumed_run(
        lambda: instrument.wrap(stateful(workers, persistent), name="t", registry=registry))
    assert ours == bare and batches == bare_batches == 7 + 7
    assert value(registry, cat.BATCHES.name, **L) == batches
    assert value(registry, cat.SAMPLES.name, **L) == samples == 20 + 20
    assert value(registry, cat.EPOCHS.name, **L) == 3  # the full one, the cut one, the rest
    if workers:
        produced = per_worker(registry, cat.WORKER_SAMPLES)
        assert set(produced) == {"0", "1"}
        # Workers produce ahead of the loop: at most prefetch_factor batches each more.
        assert samples <= sum(produced.values()) <= samples + 2 * 2 * 3
        assert value(registry, cat.WORKERS_CONFIGURED.name, **L) == 2
        assert value(registry, cat.WORKERS_LOST.name, **L) == 0


def test_a_stateful_dataloaders_full_epoch_has_worker_figures_equal_to_the_loop(
        registry: CollectorRegistry) -> None:
    loader = instrument.wrap(stateful(2), name="t", registry=registry)
    assert sum(len(b[1]) for b in loader) == 20
    assert sum(per_worker(registry, cat.WORKER_SAMPLES).values()) == 20
    assert value(registry, cat.SAMPLES.name, **L) == 20


def test_a_subclass_of_a_subclass_that_calls_super_is_counted_once(
        registry: CollectorRegistry) -> None:
    sdl = require_module("torchdata.stateful_dataloader")

    class Mine(sdl.StatefulDataLoader):  # type: ignore[misc,name-defined]
        def __iter__(self) -> Any:
            return super().__iter__()

    loader = instrument.wrap(Mine(SleepDataset(6), batch_size=2), name="t", registry=registry)
    assert sum(1 for _ in loader) == 3
    assert value(registry, cat.BATCHES.name, **L) == 3


# --- text batches ----------------------------------------------------------------------
class Rows(Dataset):  # type: ignore[type-arg]
    """Hugging Face style rows: a text column first, then token ids."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"text": f"row {i}", "input_ids": torch.arange(4) + i, "label": i % 2}


class Keyed(Dataset):  # type: ignore[type-arg]
    """webdataset's key-first tuples: (key, payload, class)."""

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> tuple[str, torch.Tensor, int]:
        return f"k{i:04d}", torch.full((3,), float(i)), i


@pytest.mark.parametrize("dataset", [Rows, Keyed])
@pytest.mark.parametrize("workers", [0, 2])
def test_text_first_batches_count_their_samples(registry: CollectorRegistry, dataset: type,
                                                workers: int) -> None:
    bare = TorchDataLoader(dataset(), batch_size=4, num_workers=workers)
    ours = instrument.DataLoader(dataset(), batch_size=4, num_workers=workers, name="t",
                                 registry=registry)
    assert [plain(b) for b in ours] == [plain(b) for b in bare]
    assert value(registry, cat.SAMPLES.name, **L) == 10  # not one a batch (3)
    if workers:
        assert sum(per_worker(registry, cat.WORKER_SAMPLES).values()) == 10


def _rows_collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A custom collate_fn as HF data collators make them: a dict of batched tensors."""
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "text": [r["text"] for r in rows]}


def _tensors_only(rows: list[Any]) -> list[Any]:
    return [r[1] for r in rows]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_custom_collate_is_counted_when_its_count_is_checked_and_not_when_it_fails(
        registry: CollectorRegistry, workers: int) -> None:
    counted = instrument.DataLoader(Rows(), batch_size=4, num_workers=workers, name="c",
                                    collate_fn=_rows_collate, registry=registry)
    listed = instrument.DataLoader(Keyed(), batch_size=4, num_workers=workers, name="l",
                                   collate_fn=_tensors_only, registry=registry)
    assert [plain(b) for b in counted] == [plain(b) for b in TorchDataLoader(
        Rows(), batch_size=4, num_workers=workers, collate_fn=_rows_collate)]
    assert [plain(b) for b in listed] == [plain(b) for b in TorchDataLoader(
        Keyed(), batch_size=4, num_workers=workers, collate_fn=_tensors_only)]
    assert value(registry, cat.SAMPLES.name, loader="c", rank="0") == 10
    # A list of each sample's tensor of 3: read as fields that agree on 3, which the
    # check against the 4 samples collated refutes. Not exported rather than wrong.
    assert value(registry, cat.SAMPLES.name, loader="l", rank="0") is None
    assert value(registry, cat.BATCHES.name, loader="l", rank="0") == 3
    if workers:
        assert per_worker(registry, cat.WORKER_SAMPLES)  # the workers' own counts are exact


# --- batch_size=None: batches made in the workers ------------------------------------------
class Shards(IterableDataset):  # type: ignore[type-arg]
    """Pre-batched shards, as webdataset's .batched() makes them in the workers: each item
    (keys, features, labels) of up to 4 samples; 11 samples per worker."""

    def __iter__(self) -> Iterator[tuple[list[str], torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        wid = 0 if info is None else info.id
        for start in range(0, 11, 4):
            ids = list(range(start, min(start + 4, 11)))
            yield ([f"w{wid}-{i}" for i in ids], torch.ones(len(ids), 2) * wid,
                   torch.tensor(ids))


def test_batch_size_none_counts_the_samples_of_batches_made_in_the_workers(
        registry: CollectorRegistry) -> None:
    bare = TorchDataLoader(Shards(), batch_size=None, num_workers=2)
    ours = instrument.DataLoader(Shards(), batch_size=None, num_workers=2, name="t",
                                 registry=registry)
    assert [plain(b) for b in ours] == [plain(b) for b in bare]
    assert value(registry, cat.BATCHES.name, **L) == 6
    assert value(registry, cat.SAMPLES.name, **L) == 22
    assert per_worker(registry, cat.WORKER_SAMPLES) == {"0": 11, "1": 11}  # not 3 batches


# --- webdataset ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two tar shards of 14 samples, written with webdataset's own writer."""
    wds = require_module("webdataset")
    directory = tmp_path_factory.mktemp("shards")
    urls = []
    for s in range(2):
        path = directory / f"shard-{s}.tar"
        with wds.TarWriter(str(path)) as writer:
            for i in range(s * 14, s * 14 + 14):
                writer.write({"__key__": f"k{i:04d}", "txt": f"sample {i}", "cls": i})
        urls.append(str(path))
    return urls


def web_loader(urls: list[str]) -> Any:
    """webdataset's documented pattern: batches of 4 made in 2 workers, batch_size=None."""
    wds = require_module("webdataset")
    dataset = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple(
        "__key__", "txt", "cls").batched(4)
    return wds.WebLoader(dataset, batch_size=None, num_workers=2)


@pytest.mark.parametrize("rebatch", [False, True])
def test_webdataset_is_measured_as_the_loop_takes_its_batches(
        registry: CollectorRegistry, shards: list[str], rebatch: bool) -> None:
    bare = web_loader(shards)
    ours = instrument.wrap(web_loader(shards), name="t", registry=registry)
    if rebatch:  # the fluid chain after wrap(): still measured
        bare, ours = bare.unbatched().batched(5), ours.unbatched().batched(5)
    seen = [plain(b) for b in ours]
    assert seen == [plain(b) for b in bare]
    assert len(seen) == (6 if rebatch else 8)  # 28 samples: in 5s, or 4s per worker shard
    assert value(registry, cat.BATCHES.name, **L) == len(seen)  # once, as the loop took them
    assert value(registry, cat.SAMPLES.name, **L) == 28
    assert per_worker(registry, cat.WORKER_SAMPLES) == {"0": 14, "1": 14}
    assert value(registry, cat.WORKERS_CONFIGURED.name, **L) == 2
    assert value(registry, cat.EPOCHS.name, **L) == 1


class Fluid:
    """A loader with a fluid interface: chain methods return new loaders."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.ones(2, 3)] * self.n)

    def more(self) -> Fluid:  # a new loader of its own kind
        return Fluid(self.n + 1)

    def same(self) -> Fluid:  # itself, configured
        return self

    def elsewhere(self) -> list[torch.Tensor]:  # something else
        return list(self)

    def other(self) -> Other:
        return Other()


class Other:
    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.ones(2)])


def test_chain_methods_after_wrap_keep_measuring_or_say_they_stopped(
        registry: CollectorRegistry, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "dataloader_exporter.instrument")
    ours = instrument.wrap(Fluid(2), name="t", registry=registry)
    assert ours.same() is ours
    more = ours.more().more()
    assert isinstance(more, instrument.WrappedLoader) and more.loader.n == 4
    assert sum(1 for _ in more) == 4
    assert value(registry, cat.BATCHES.name, **L) == 4
    assert value(registry, cat.SAMPLES.name, **L) == 8
    assert len(ours.elsewhere()) == 2  # a list: nothing to say
    for _ in range(2):
        assert isinstance(ours.other(), Other)
    assert caplog.text.count("Fluid.other() returned a Other, which is not measured") == 1
    assert "elsewhere" not in caplog.text


# --- torch's own loader beside them ----------------------------------------------------
class Lonely(TorchDataLoader):  # type: ignore[type-arg]
    """A loader class whose __iter__ is a generator that never reaches torch's."""

    def __iter__(self) -> Iterator[Any]:
        yield from self.dataset  # type: ignore[attr-defined]


def test_a_loader_class_nothing_can_time_is_named_as_such_at_exit(tmp_path: Path) -> None:
    code = ("import dataloader_exporter, torch\n"
            "from test_data_libraries import Lonely\n"
            "loader = dataloader_exporter.wrap(Lonely([torch.ones(2)] * 3), name='odd')\n"
            "assert sum(1 for _ in loader) == 3\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60,
                         env={"PYTHONPATH": f"{REPO / 'tests'}:{REPO}", "PATH": "/usr/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("dataloader 'odd': no batch of it was measured") == 1
    assert "Lonely.__iter__ is a generator" in out.stderr
    assert "dataloader-exporter run" not in out.stderr  # it could not measure it either


# --- zero-code mode -----------------------------------------------------------------------
STATEFUL = built_at("data_libraries.py", "return StatefulDataLoader(", "loader = stateful()")


@pytest.fixture(scope="module")
def zero_code_libraries(tmp_path_factory: pytest.TempPathFactory, shards: list[str]) -> Run:
    """tests/frameworks/data_libraries.py under `dataloader-exporter run`, with a setting
    for the StatefulDataLoader by the name zero-code mode gives it."""
    require_module("torchdata")
    tmp = tmp_path_factory.mktemp("libraries")
    return run_script(tmp, [sys.executable, "-m", "dataloader_exporter", "run", "--metrics-dir",
                            str(tmp / "m"), "--settings", f"{STATEFUL}.prefetch_factor=3", "--",
                            sys.executable, str(SCRIPTS / "data_libraries.py"), str(tmp),
                            *shards], {"PYTHONPATH": f"{SCRIPTS}{os.pathsep}{REPO}"})


def test_zero_code_mode_measures_a_stateful_dataloader_and_applies_its_settings(
        zero_code_libraries: Run) -> None:
    truth = zero_code_libraries.truth[0]["stateful"]
    assert truth["name"] == STATEFUL
    assert truth["prefetch_factor"] == [3, 3]  # applied to both loaders built there
    run = zero_code_libraries
    assert run.value(0, cat.BATCHES.name, loader=STATEFUL) == truth["batches"] == 7 + 5 + 2
    assert run.value(0, cat.SAMPLES.name, loader=STATEFUL) == truth["samples"] == 40
    info = [lab for lab in run.labels(0, cat.INFO.name) if lab["loader"] == STATEFUL]
    assert len(info) == 1 and info[0]["prefetch_factor"] == "3"
    assert {lab["worker"] for lab in run.labels(0, cat.WORKER_SAMPLES.name)
            if lab["loader"] == STATEFUL} == {"0", "1"}
    assert "was built but never iterated" not in run.log


def test_zero_code_mode_measures_webdataset_as_the_loop_takes_its_batches(
        zero_code_libraries: Run) -> None:
    truth = zero_code_libraries.truth[0]["web"]
    run = zero_code_libraries
    names = {lab["loader"] for lab in run.labels(0, cat.BATCHES.name)}
    assert names == {STATEFUL, truth["name"]}  # the inner torch loader is not counted apart
    assert run.value(0, cat.BATCHES.name, loader=truth["name"]) == truth["batches"] == 6
    assert run.value(0, cat.SAMPLES.name, loader=truth["name"]) == truth["samples"] == 28
    assert sum(v for n, lab, v in run.samples[0] if n == cat.WORKER_SAMPLES.name
               and lab["loader"] == truth["name"]) == 28


SUBCLASSES = """
import torch
from torch.utils.data import DataLoader, TensorDataset

class Fixed(DataLoader):  # takes no num_workers, passes its own on to torch's
    def __init__(self, ds):
        super().__init__(ds, batch_size=2)

class Own(DataLoader):  # never calls torch's __init__ (as torchdata does), takes no settings
    def __init__(self, ds):
        self.__dict__.update(DataLoader(ds, batch_size=2).__dict__)

ds = TensorDataset(torch.arange(4.0))
print(Fixed(ds).num_workers, Own(ds).num_workers)
"""


def test_settings_reach_a_subclass_through_torchs_init_or_are_said_not_to(
        tmp_path: Path) -> None:
    env = {**os.environ, "DATALOADER_EXPORTER_AUTO": "1",
           "DATALOADER_EXPORTER_SETTINGS": "*.num_workers=1",
           "PYTHONPATH": os.pathsep.join([str(REPO / "instrument" / "autorun"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", SUBCLASSES], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Fixed: applied where torch's __init__ takes it. Own builds a plain loader inside (at
    # its own line, applied there too), but Own itself takes no num_workers: said once.
    assert out.stdout.split() == ["1", "1"]
    assert out.stderr.count("num_workers not applied: Own.__init__ takes no such argument") \
        == 1, out.stderr
    assert "Fixed.__init__ takes no" not in out.stderr


# --- the counting rules themselves (instrument/hotpath/batch.py) ----------------------------
def _t(*shape: int) -> torch.Tensor:
    return torch.zeros(shape)


@pytest.mark.parametrize(("batch", "custom", "item"), [
    ((_t(4, 3), _t(4)), 4, 4),  # default_collate's tuple of columns
    ({"text": ["a"] * 4, "input_ids": _t(4, 7)}, 4, 4),  # a text column first
    ((["k"] * 4, ["t"] * 4, np.arange(4)), 4, 4),  # webdataset's keys, texts, classes
    ([("k", "t", 1)] * 6, 6, 6),  # webdataset's .listed(6): rows of (key, text, class)
    ([("k", _t(3), 1)] * 4, 4, 4),  # a collate_fn that returns its samples
    (((_t(3),) * 4, ({"box": _t(4)},) * 4), 4, None),  # zip(*samples): columns of one kind
    ({"input_ids": _t(7), "attention_mask": _t(7)}, 7, None),  # one sample, or 7 scalars?
    ((_t(3, 8, 8), _t(3, 8, 8)), 3, None),  # one image and its mask
    (_t(5, 2), 5, None),  # a lone tensor: a batch, by a loader's contract, or one sample
    ([_t(3)] * 4, 3, None),  # four samples' tensors: misread, and caught by the check
    (3, 1, 1),
    (torch.tensor(2.0), 1, 1),
    ({"id": 1, "text": "a"}, 1, 1),  # a record of scalars is one sample
])
def test_sample_counts_are_given_only_where_the_batch_shows_them(
        batch: Any, custom: int | None, item: int | None) -> None:
    from dataloader_exporter.instrument.hotpath.batch import batch_len, item_len, loader_len

    assert batch_len(batch) == loader_len(batch) == custom
    assert item_len(batch) == item


def test_default_collate_is_counted_by_its_first_column_whatever_the_sample() -> None:
    from dataloader_exporter.instrument.hotpath.batch import collated_len

    samples = [{"text": f"r{i}", "ids": [i, i + 1], "label": i % 2, "raw": b"x"}
               for i in range(5)]
    assert collated_len(torch.utils.data.default_collate(samples)) == 5
    assert collated_len(torch.utils.data.default_collate([("k", 1.0)] * 3)) == 3
    assert collated_len(torch.utils.data.default_collate([torch.ones(2)] * 4)) == 4


def test_a_stateful_dataloader_asked_for_its_state_first_keeps_its_worker_series(
        registry: CollectorRegistry) -> None:
    """torchdata starts the iterator's workers in state_dict() when it comes first (as
    Accelerate does with use_stateful_dataloader): they report per worker all the same."""
    loader = instrument.wrap(stateful(2, persistent=True), name="t", registry=registry)
    loader.state_dict()
    assert sum(len(b[1]) for b in loader) == 20
    assert sum(per_worker(registry, cat.WORKER_SAMPLES).values()) == 20
    assert sum(len(b[1]) for b in loader) == 20
    assert value(registry, cat.SAMPLES.name, **L) == 40
    assert sum(per_worker(registry, cat.WORKER_SAMPLES).values()) == 40


def _fail_at_five(sample: tuple[str, str, int]) -> tuple[str, str, int]:
    if sample[2] == 5:
        raise ValueError("bad record 5")
    return sample


def test_an_error_through_webdataset_is_counted_once(registry: CollectorRegistry,
                                                     shards: list[str]) -> None:
    wds = require_module("webdataset")
    dataset = wds.WebDataset(shards, shardshuffle=False).decode().to_tuple(
        "__key__", "txt", "cls").map(_fail_at_five).batched(4)
    loader = instrument.wrap(wds.WebLoader(dataset, batch_size=None, num_workers=2), name="t",
                             registry=registry)
    with pytest.raises(ValueError, match="bad record 5"):
        for _ in loader:
            pass
    assert value(registry, cat.FAILURES.name, **L, cause="error") == 1
