"""Samples counted without walking each batch (full batches of a fixed size) stay exact:
the last, partial batch, a batch lost to an error, two loaders sharing a name, a loader
whose batches are not all full, and a config changed between epochs."""

from __future__ import annotations

import itertools

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import value
from torch.utils.data import Dataset, RandomSampler, Sampler, Subset, TensorDataset

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.facts.shm import SHM_PATH, shm_space
from dataloader_exporter.instrument.iter_start import fixed_size
from dataloader_exporter.instrument.preflight import process_shm_size

pytestmark = pytest.mark.torch

L = {"loader": "t", "rank": "0"}


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, 3), torch.arange(n))


def _samples(registry: CollectorRegistry, name: str = "t") -> float | None:
    return value(registry, cat.SAMPLES.name, loader=name, rank="0")


@pytest.mark.parametrize(("n", "batch_size", "drop_last"), [
    (200, 1, False), (200, 3, False), (200, 3, True), (130, 64, False), (129, 64, True),
    (5, 8, False), (640, 8, False)])
def test_samples_are_exact_for_every_batch_size_and_last_batch(
        registry: CollectorRegistry, n: int, batch_size: int, drop_last: bool) -> None:
    loader = instrument.DataLoader(_data(n), batch_size=batch_size, drop_last=drop_last,
                                   shuffle=True, name="t", registry=registry)
    seen = 0
    for _ in range(3):
        seen += sum(len(b[1]) for b in loader)
    assert seen == 3 * (n // batch_size * batch_size if drop_last else n)
    assert _samples(registry) == seen
    assert value(registry, cat.BATCHES.name, **L) == 3 * len(loader)


def test_samples_are_exact_while_the_loop_reads_the_figures(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(_data(150), batch_size=4, name="t", registry=registry)
    seen = 0
    for batch in loader:
        seen += len(batch[1])
        assert _samples(registry) == seen  # each batch counted before the loop gets it


class _Flaky(Dataset[tuple[torch.Tensor, int]]):
    """Fails for one index: its whole batch is lost, and the loop goes on."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.bad:
            raise ValueError(f"bad sample {i}")
        return torch.zeros(2), i


def test_a_batch_lost_to_an_error_leaves_the_last_batch_counted_right(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(_Flaky(203, bad=100), batch_size=4, name="t",
                                   registry=registry)
    it, seen, errors = iter(loader), 0, 0
    while True:
        try:
            seen += len(next(it)[1])
        except StopIteration:
            break
        except ValueError:
            errors += 1
    assert errors == 1 and seen == 203 - 4
    assert _samples(registry) == seen


def test_two_loaders_sharing_a_name_count_their_own_samples(
        registry: CollectorRegistry) -> None:
    a = instrument.DataLoader(_data(131), batch_size=4, name="t", registry=registry)
    b = instrument.DataLoader(_data(70), batch_size=3, name="t", registry=registry)
    seen = 0
    for x, y in itertools.zip_longest(a, b):
        seen += sum(len(batch[1]) for batch in (x, y) if batch is not None)
    assert seen == 131 + 70
    assert _samples(registry) == seen


class _Short(Sampler[int]):
    """Says it yields more indices than it does: its batches cannot be assumed full."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.n - 5))

    def __len__(self) -> int:
        return self.n


def test_a_sampler_whose_length_is_not_what_it_yields_is_counted_batch_by_batch(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(_data(100), batch_size=4, sampler=_Short(100), name="t",
                                   registry=registry)
    assert fixed_size(loader) is None
    assert sum(len(b[1]) for b in loader) == 95
    assert _samples(registry) == 95


def test_only_torch_samplers_of_known_length_and_plain_fetches_count_full_batches() -> None:
    data = _data(10)
    assert fixed_size(torch.utils.data.DataLoader(data, batch_size=2)) is not None
    assert fixed_size(torch.utils.data.DataLoader(Subset(data, range(5)), batch_size=2,
                                                  sampler=RandomSampler(range(5))))
    assert fixed_size(torch.utils.data.DataLoader(data, batch_size=None)) is None
    assert fixed_size(torch.utils.data.DataLoader(data, batch_size=2,
                                                  num_workers=2, in_order=False)) is None

    class Batched(TensorDataset):
        def __getitems__(self, indices: list[int]) -> list[object]:
            return [self[i] for i in indices]

    assert fixed_size(torch.utils.data.DataLoader(Batched(torch.zeros(4)), batch_size=2)) is None


def test_settings_changed_between_epochs_are_counted_and_labelled_anew(
        registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(_data(50), batch_size=4, name="t", registry=registry)
    first = sum(len(b[1]) for b in loader)
    loader.batch_sampler.batch_size = 7  # what a framework's batch-size finder may do
    loader.num_workers, loader.prefetch_factor = 1, 3  # what the tuner, or a user, does
    second = sum(len(b[1]) for b in loader)
    assert first == second == 50
    assert _samples(registry) == 100
    shm = process_shm_size()
    assert shm == str(shm_space(SHM_PATH).size)
    assert value(registry, cat.INFO.name, **L, num_workers="1", batch_size="4",
                 prefetch_factor="3", pin_memory="false", persistent_workers="false",
                 gpu_uuid="", dev_shm_bytes=shm) == 1


def _own_collate(samples: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    return torch.utils.data.default_collate(samples)


def test_a_plan_kept_across_epochs_is_made_again_when_a_setting_changes(
        registry: CollectorRegistry) -> None:
    """An iter() without workers whose settings did not change takes the last one's plan;
    each change below plans again, and every epoch is counted and labelled as it ran,
    side by side with torch's own loader."""
    data = _data(30)
    bare = torch.utils.data.DataLoader(data, batch_size=4)
    ours = instrument.DataLoader(data, batch_size=4, name="t", registry=registry)
    changes = [
        lambda dl: None, lambda dl: None,  # the same settings: the kept plan
        lambda dl: setattr(dl.batch_sampler, "batch_size", 7),
        lambda dl: setattr(dl, "collate_fn", _own_collate),  # counted and checked
        lambda dl: setattr(dl, "collate_fn", torch.utils.data.default_collate),
        lambda dl: setattr(dl, "prefetch_factor", 2),  # not used without workers
        lambda dl: setattr(dl, "num_workers", 1),
        lambda dl: setattr(dl, "num_workers", 0),
        lambda dl: setattr(dl, "in_order", False)]
    kept = []
    samples = batches = 0
    for change in changes:
        change(bare)
        change(ours)
        got, want = list(ours), list(bare)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert type(a) is type(b) and all(map(torch.equal, a, b))
        batches += len(want)
        samples += sum(len(b[1]) for b in want)
        kept.append(ours._instruments.kept is not None)
        assert _samples(registry) == samples
        assert value(registry, cat.BATCHES.name, **L) == batches
        prefetch = ours.prefetch_factor
        assert value(registry, cat.INFO.name, **L, num_workers=str(ours.num_workers),
                     batch_size="4", prefetch_factor="" if prefetch is None else str(prefetch),
                     pin_memory="false", persistent_workers="false", gpu_uuid="",
                     dev_shm_bytes=process_shm_size()) == 1
    assert kept == [True, True, True, False, True, True, False, True, True]


def test_samples_are_exact_with_two_workers(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(_data(37), batch_size=4, num_workers=2, name="t",
                                   registry=registry)
    assert sum(len(b[1]) for b in loader) == 37
    assert _samples(registry) == 37
