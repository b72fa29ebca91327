"""Real frameworks on CPU, run as a user would: Accelerate under torchrun, the Hugging Face
Trainer and Lightning's DDP through `dataloader-exporter run` with no exporter code in the
script, and Lightning through instrument.wrap(). Each script (tests/frameworks/) records
its own truth (steps per epoch, what its snapshot said mid-epoch); each run is shared by
the assertions on it. Nothing is downloaded."""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from support.procs import REPO, SCRIPTS, Run, built_at, run_script
from support.required import require_module

from dataloader_exporter.core import advisor
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.core.tuner import model as tuner_model
from dataloader_exporter.instrument.zerocode import registry as zerocode_registry

pytestmark = [pytest.mark.torch, pytest.mark.slow]

ACCELERATE_LOADER = built_at("accelerate_train.py", "loader = DataLoader(", "main(sys.argv[1])")


def zero_code(tmp: Path, *command: str, settings: str = "") -> Run:
    flags = ["--settings", settings] if settings else []
    return run_script(tmp, [sys.executable, "-m", "dataloader_exporter", "run", "--metrics-dir",
                      str(tmp / "m"), *flags, "--", *command])


@pytest.fixture(scope="module")
def accelerate_torchrun(tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_module("accelerate")
    tmp = tmp_path_factory.mktemp("accelerate")
    # The tuner on: each rank's prepared loader is tuned.
    return zero_code(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node=2", str(SCRIPTS / "accelerate_train.py"), str(tmp),
                     settings="*.num_workers=auto")


@pytest.fixture(scope="module")
def hf_trainer(tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_module("transformers")
    tmp = tmp_path_factory.mktemp("hf")
    return zero_code(tmp, sys.executable, str(SCRIPTS / "hf_trainer.py"), str(tmp))


@pytest.fixture(scope="module")
def lightning_zero_code(tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_module("lightning")
    tmp = tmp_path_factory.mktemp("lightning-zero-code")
    # The tuner on: Lightning's own copy of the loader is tuned, per rank.
    return zero_code(tmp, sys.executable, str(SCRIPTS / "lightning_ddp.py"), str(tmp), "plain",
                     settings="*.num_workers=auto")


@pytest.fixture(scope="module")
def lightning_wrap(tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_module("lightning")
    tmp = tmp_path_factory.mktemp("lightning-wrap")
    return run_script(tmp, [sys.executable, str(SCRIPTS / "lightning_ddp.py"), str(tmp), "wrap"],
                {"PYTHONPATH": os.pathsep.join([str(SCRIPTS), str(REPO)]),
                 "DATALOADER_EXPORTER_DIR": str(tmp / "m")})


def assert_counts_match_the_script(run: Run, ranks: int, loader: str, epochs: int) -> None:
    assert sorted(run.truth) == list(range(ranks)), run.log[-3000:]
    assert len(run.files) == ranks, run.files  # one per rank; a launcher writes none
    for rank, truth in run.truth.items():
        assert run.value(rank, cat.BATCHES.name, loader=loader) == truth["steps"], truth
        assert run.value(rank, cat.EPOCHS.name, loader=loader) == epochs
        assert len(truth["per_epoch"]) == epochs


def assert_workers_seen_honestly(run: Run, loader: str, tuned: bool = False) -> None:
    """The script's one worker per rank is what the metrics show (tuned: the count the
    tuner set, one worker series per worker id it ever ran, and a live count seen
    mid-epoch that is one of the counts it ran), and none is lost."""
    for rank, truth in run.truth.items():
        workers = run.value(rank, cat.WORKERS_CONFIGURED.name, loader=loader)
        assert workers is not None and (workers >= 1 if tuned else workers == 1)
        ids = sorted(int(lab["worker"]) for lab in run.labels(rank, cat.WORKER_SAMPLES.name)
                     if lab["loader"] == loader)
        assert ids == list(range(len(ids))) and (len(ids) >= 1 if tuned else ids == [0]), ids
        assert run.value(rank, cat.WORKERS_LOST.name, loader=loader) == 0
        for seen in truth.get("seen", []):  # mid-epoch, while batches flowed
            assert seen["lost"] == 0, truth
            assert (1 <= seen["active"] <= len(ids)) if tuned else seen["active"] == workers


def test_accelerate_under_torchrun_counts_each_ranks_steps_with_no_code(
        accelerate_torchrun: Run) -> None:
    # No name anywhere in the script: the loader is named after the line that built it.
    assert_counts_match_the_script(accelerate_torchrun, 2, ACCELERATE_LOADER, 2)
    for rank in (0, 1):
        assert accelerate_torchrun.truth[rank]["per_epoch"] == [16, 16]  # 256 / 8 / 2 ranks


def test_accelerate_prepared_loader_has_worker_series_and_no_false_worker_loss(
        accelerate_torchrun: Run) -> None:
    # The tuner is on (the fixture): a batch takes about as long to make as a step, so it
    # may keep the one worker or add one; either is what the series must say.
    assert_workers_seen_honestly(accelerate_torchrun, ACCELERATE_LOADER, tuned=True)
    info = accelerate_torchrun.labels(0, cat.INFO.name)
    assert len(info) == 1 and info[0]["batch_size"] == "8"  # read from Accelerate's sampler


def test_hf_trainer_loader_is_named_train_and_counts_its_steps(hf_trainer: Run) -> None:
    assert_counts_match_the_script(hf_trainer, 1, "train", 2)
    assert hf_trainer.truth[0]["steps"] == hf_trainer.truth[0]["counted"] == 24  # 96 / 8 x 2


def test_hf_trainer_workers_are_seen_and_epoch_restarts_are_not_losses(hf_trainer: Run) -> None:
    assert_workers_seen_honestly(hf_trainer, "train")


def test_hf_trainer_eval_loader_built_mid_run_is_named_eval(hf_trainer: Run) -> None:
    # Evaluated after each epoch: 32 samples at 8 a batch, twice.
    assert hf_trainer.value(0, cat.BATCHES.name, loader="eval") == \
        hf_trainer.truth[0]["eval_batches"]
    assert {lab["loader"] for lab in hf_trainer.labels(0, cat.BATCHES.name)} == {"train",
                                                                                 "eval"}


def test_accelerate_copies_of_instrumented_and_wrapped_loaders_are_measured(
        registry: CollectorRegistry) -> None:
    """Without zero-code mode: prepare() of an instrument.DataLoader, and wrap() of what
    prepare() returns (both gave no metrics, or a false worker loss, before)."""
    accelerate = require_module("accelerate")
    import torch

    from dataloader_exporter import instrument

    sys.path.insert(0, str(SCRIPTS))
    try:
        from common import Points
    finally:
        sys.path.remove(str(SCRIPTS))
    acc = accelerate.Accelerator(cpu=True)
    mine = acc.prepare(instrument.DataLoader(Points(32), batch_size=8, num_workers=1,
                                             name="mine", registry=registry))
    theirs = instrument.wrap(acc.prepare(torch.utils.data.DataLoader(Points(32), batch_size=8,
                                                                     num_workers=1)),
                             name="theirs", registry=registry)
    assert isinstance(theirs, torch.utils.data.DataLoader)
    for loader in (mine, theirs):
        name = "mine" if loader is mine else "theirs"
        labels = {"loader": name, "rank": "0"}
        for i, _ in enumerate(loader):
            if i == 1:  # batches flowing: the worker is seen alive
                assert registry.get_sample_value(cat.WORKERS_ACTIVE.name, labels) == 1
        assert registry.get_sample_value(cat.BATCHES.name, labels) == 4
        assert registry.get_sample_value(cat.EPOCHS.name, labels) == 1
        assert registry.get_sample_value(cat.WORKERS_LOST.name, labels) == 0
        assert registry.get_sample_value(cat.WORKER_SAMPLES.name, {**labels, "worker": "0"}) \
            == 32
    info = {s.labels["loader"]: s.labels for f in registry.collect() if f.name == cat.INFO.name
            for s in f.samples}
    assert info["theirs"]["batch_size"] == "8"
    assert "mine" not in zerocode_registry.never_iterated() and (
        "theirs" not in zerocode_registry.never_iterated())


@pytest.mark.parametrize("mode", ["zero-code", "wrap"])
def test_lightning_ddp_still_shards_each_rank_to_16_batches_an_epoch(
        mode: str, request: pytest.FixtureRequest) -> None:
    run: Run = request.getfixturevalue("lightning_zero_code" if mode == "zero-code"
                                       else "lightning_wrap")
    assert_counts_match_the_script(run, 2, "train", 2)
    for truth in run.truth.values():
        # 512 samples, batch size 16, 2 ranks: 16, not 32 (Lightning's sampler is in).
        assert truth["per_epoch"] == [16, 16] and truth["sampler"] == "DistributedSampler"
    assert_workers_seen_honestly(run, "train", tuned=mode == "zero-code")
    assert "never iterated" not in run.log


@pytest.mark.parametrize("framework", ["lightning", "accelerate"])
def test_ddp_ranks_each_tune_their_loader_within_their_share_of_the_cores(
        framework: str, request: pytest.FixtureRequest) -> None:
    """`--settings '*.num_workers=auto'`: each rank's loader (Lightning's copy with its
    DistributedSampler; Accelerate's prepared one) is tuned, within the cores of one of 2
    local ranks, and the batches are the framework's own (the tests above, on the same
    runs)."""
    run: Run = request.getfixturevalue("lightning_zero_code" if framework == "lightning"
                                       else "accelerate_torchrun")
    loader = "train" if framework == "lightning" else ACCELERATE_LOADER
    cpus = advisor.local_cpu().usable / 2  # each rank's share, as CPU time
    for rank in (0, 1):
        stable = run.value(rank, cat.TUNER_STABLE.name, loader=loader)
        workers = run.value(rank, cat.WORKERS_CONFIGURED.name, loader=loader)
        assert stable in (0.0, 1.0), (rank, run.log[-3000:])  # absent: not tuned
        assert workers is not None and 1 <= workers <= tuner_model.ceiling(cpus)
    # Past its share of the cores only for workers the model saw blocked, not running.
    for moved in re.finditer(r"num_workers (\d+) -> (\d+): a batch takes [\d.]+ ms to make "
                             r"\((\d+)% of it on a CPU\)", run.log):
        if int(moved[2]) > max(1, math.ceil(cpus)):
            assert int(moved[3]) < 50, moved[0]
    assert "the tuner failed" not in run.log

