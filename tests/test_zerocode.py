"""Zero-code mode switched on by the environment alone, names without code, no double
counting, and wrap() that leaves a framework's view of the loader unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.helpers import value
from support.procs import REPO, SCRIPTS, Run, built_at, run_script
from support.torch_helpers import SleepDataset
from torch.utils.data import DataLoader as TorchDataLoader

from dataloader_exporter import instrument
from dataloader_exporter.core import catalogue as cat
from dataloader_exporter.instrument.zerocode import hooks as zerocode_hooks
from dataloader_exporter.run import autorun_dir

pytestmark = pytest.mark.torch

PLAIN = built_at("plain_torch.py", "plain = DataLoader(")
SETTINGS = (f"train.prefetch_factor=3,train.persistent_workers=true,{PLAIN}.num_workers=1,"
            "trian.pin_memory=true")


@pytest.fixture(scope="module")
def env_switch(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """tests/frameworks/plain_torch.py with only environment variables set (no `run`), and
    a sitecustomize of the user's own further down the path, which must still run."""
    tmp = tmp_path_factory.mktemp("env-switch")
    theirs = tmp / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import pathlib\npathlib.Path('their-sitecustomize-ran').touch()\n")
    path = os.pathsep.join([autorun_dir(), str(SCRIPTS), str(REPO), str(theirs)])
    return run_script(tmp, [sys.executable, str(SCRIPTS / "plain_torch.py"), str(tmp)],
                {"PYTHONPATH": path, "DATALOADER_EXPORTER_AUTO": "1",
                 "DATALOADER_EXPORTER_DIR": str(tmp / "m"),
                 "DATALOADER_EXPORTER_SETTINGS": SETTINGS})


@pytest.mark.slow  # `env_switch`: a shared training run
def test_the_environment_switch_alone_instruments_every_loader_once(env_switch: Run) -> None:
    truth = env_switch.truth[0]
    names = {lab["loader"] for lab in env_switch.labels(0, cat.BATCHES.name)}
    assert names == set(truth["batches"])  # nothing else, and nothing counted twice
    for name, batches in truth["batches"].items():
        assert env_switch.value(0, cat.BATCHES.name, loader=name) == batches, name
    assert truth["wrapped_is_a_dataloader"]


@pytest.mark.slow  # `env_switch`: a shared training run
def test_loaders_built_at_different_places_never_share_a_name(env_switch: Run) -> None:
    """A plain script's train and validation loaders over one dataset class, and two
    loaders one helper builds for two callers: each its own series and dataloader_info."""
    truth = env_switch.truth[0]
    assert truth["plain_at"] == PLAIN and truth["val_at"] != PLAIN
    helper = [n for n in truth["batches"] if "-" in n]
    assert len(helper) == 2  # a name for each caller of the helper, with the caller's site
    info = {lab["loader"]: lab for lab in env_switch.labels(0, cat.INFO.name)}
    assert info[PLAIN]["batch_size"] == "3" and info[truth["val_at"]]["batch_size"] == "1"
    assert env_switch.value(0, cat.SAMPLES.name, loader=PLAIN) == 6
    assert env_switch.value(0, cat.SAMPLES.name, loader=truth["val_at"]) == 4


@pytest.mark.slow  # `env_switch`: a shared training run
def test_a_framework_probe_that_fetches_nothing_is_not_an_epoch(env_switch: Run) -> None:
    assert env_switch.value(0, cat.EPOCHS.name, loader="train") == 2


@pytest.mark.slow  # `env_switch`: a shared training run
def test_settings_from_the_environment_are_applied_logged_and_in_dataloader_info(
        env_switch: Run) -> None:
    truth = env_switch.truth[0]
    assert truth["train"] == {"num_workers": 1, "prefetch_factor": 3, "persistent_workers": True}
    assert truth["plain_workers"] == 1
    info = {lab["loader"]: lab for lab in env_switch.labels(0, cat.INFO.name)}
    assert info["train"]["prefetch_factor"] == "3"
    assert info["train"]["persistent_workers"] == "true"
    assert info[PLAIN]["num_workers"] == "1"
    assert "dataloader 'train': prefetch_factor=3 from DATALOADER_EXPORTER_SETTINGS (was None)" \
        in env_switch.log
    assert env_switch.log.count("persistent_workers=True from") == 1  # once, not per epoch
    assert "names loader 'trian', but no loader of that name was built" in env_switch.log


@pytest.mark.slow  # `env_switch`: a shared training run
def test_a_loader_built_but_never_iterated_is_reported_once_at_exit(env_switch: Run) -> None:
    assert env_switch.log.count("dataloader 'lonely' was built but never iterated") == 1
    # Zero-code mode is on: the line does not point at it, as if it could do more.
    assert "dataloader-exporter run" not in env_switch.log
    assert "'mine' was built but never" not in env_switch.log


@pytest.mark.slow  # `env_switch`: a shared training run
def test_a_users_own_sitecustomize_still_runs(env_switch: Run) -> None:
    assert (env_switch.files[0].parent.parent / "their-sitecustomize-ran").exists()


def test_a_process_that_never_imports_torch_never_loads_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([autorun_dir(), str(REPO)]),
           "DATALOADER_EXPORTER_AUTO": "1"}
    code = "import sys; print(sorted({'torch', 'instrument', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
def test_a_lookup_of_torch_before_its_import_does_not_switch_the_hook_off(
        tmp_path: Path) -> None:
    """transformers asks importlib.util.find_spec("torch") when it is imported; scripts
    import it before torch. The hook must still be installed when torch is imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([autorun_dir(), str(REPO)]),
           "DATALOADER_EXPORTER_AUTO": "1"}
    code = ("import importlib.util; importlib.util.find_spec('torch'); import torch; "
            "from dataloader_exporter.instrument.zerocode import hooks as zerocode_hooks; "
            "print(torch.utils.data.DataLoader.__iter__ is zerocode_hooks._hooked_iter)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


@pytest.mark.parametrize("via", ["run", "env"])
def test_a_bad_settings_line_stops_the_program_before_it_starts(tmp_path: Path, via: str) -> None:
    bad = "train.num_workers=-1,*.nm_workers=2"
    script = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(script)!r}, 'w')"]
    if via == "run":
        argv = [sys.executable, "-m", "dataloader_exporter", "run", "--settings", bad, "--",
                *command]
        env = dict(os.environ)
    else:
        argv = command
        env = {**os.environ, "DATALOADER_EXPORTER_AUTO": "1", "DATALOADER_EXPORTER_SETTINGS": bad,
               "PYTHONPATH": os.pathsep.join([autorun_dir(), str(REPO)])}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 2
    assert "'train.num_workers=-1': num_workers must be 0 or more" in out.stderr
    assert "unknown setting 'nm_workers'" in out.stderr
    assert not script.exists()


# --- in this process: wrap() ---------------------------------------------------------
def test_wrap_keeps_a_torch_loader_a_torch_loader(registry: CollectorRegistry) -> None:
    inner = TorchDataLoader(SleepDataset(4), batch_size=2)
    assert instrument.wrap(inner, name="t", registry=registry) is inner
    mine = instrument.DataLoader(SleepDataset(4), batch_size=2, name="m", registry=registry)
    assert instrument.wrap(mine, name="again", registry=registry) is mine
    for _ in mine:
        pass
    assert value(registry, cat.BATCHES.name, loader="m", rank="0") == 2
    assert value(registry, cat.BATCHES.name, loader="again", rank="0") is None


def test_an_iter_that_fetches_no_batch_is_not_an_epoch(registry: CollectorRegistry) -> None:
    loader = instrument.wrap(TorchDataLoader(SleepDataset(4), batch_size=2), name="t",
                             registry=registry)
    iter(loader)
    iter(loader)
    assert not value(registry, cat.EPOCHS.name, loader="t", rank="0")
    assert sum(1 for _ in loader) == 2
    assert value(registry, cat.EPOCHS.name, loader="t", rank="0") == 1


def test_a_wrapped_loader_with_workers_gets_per_worker_series(
        registry: CollectorRegistry) -> None:
    loader = instrument.wrap(TorchDataLoader(SleepDataset(4), batch_size=2, num_workers=1),
                             name="t", registry=registry)
    assert sum(1 for _ in loader) == 2
    assert value(registry, cat.WORKER_SAMPLES.name, loader="t", rank="0", worker="0") == 4
    assert value(registry, cat.WORKERS_LOST.name, loader="t", rank="0") == 0


def test_workers_that_cannot_be_seen_are_not_reported_as_none_active(
        registry: CollectorRegistry) -> None:
    batches = instrument.wrap((torch.ones(2) for _ in range(3)), name="g", registry=registry)
    assert sum(1 for _ in batches) == 3
    assert value(registry, cat.BATCHES.name, loader="g", rank="0") == 3
    assert value(registry, cat.WORKERS_ACTIVE.name, loader="g", rank="0") is None


def test_zero_workers_are_known_to_be_zero(registry: CollectorRegistry) -> None:
    loader = instrument.DataLoader(SleepDataset(2), batch_size=2, name="z", registry=registry)
    assert sum(1 for _ in loader) == 1
    assert value(registry, cat.WORKERS_ACTIVE.name, loader="z", rank="0") == 0


def test_names_come_from_the_framework_method_on_the_stack() -> None:
    def train_dataloader() -> str | None:
        return zerocode_hooks.role_from_stack()

    def get_eval_dataloader() -> str | None:
        return zerocode_hooks.role_from_stack()

    assert train_dataloader() == "train"
    assert get_eval_dataloader() == "eval"
    assert zerocode_hooks.role_from_stack() is None


def test_run_prints_the_environment_for_an_image_and_needs_a_command(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "dataloader_exporter", "run", *args],
                              capture_output=True, text=True, timeout=60, cwd=REPO)

    printed = cli("--metrics-dir", str(tmp_path), "--print-env")
    assert printed.returncode == 0
    lines = printed.stdout.splitlines()
    assert f"PYTHONPATH={autorun_dir()}" in lines[0]
    assert "DATALOADER_EXPORTER_AUTO=1" in lines
    assert f"DATALOADER_EXPORTER_DIR={tmp_path}" in lines
    missing = cli("--metrics-dir", str(tmp_path))
    assert missing.returncode == 2 and "no command given" in missing.stderr


def test_a_users_own_plain_loader_over_the_same_dataset_is_not_counted_as_a_copy(
        registry: CollectorRegistry) -> None:
    """A framework's loop iterating the user's own plain loader over the dataset of an
    instrumented one (say a validation loader over the training set): not a copy of it."""
    import types

    ds = SleepDataset(32)
    train = instrument.DataLoader(ds, batch_size=4, name="own-train", registry=registry)
    plain = TorchDataLoader(ds, batch_size=8)
    loop = types.ModuleType("lightning.fake_loop")  # code of a framework, as on the stack
    exec("def run(loader):\n    return sum(1 for _ in loader)\n", loop.__dict__)
    assert loop.run(train) == 8 and loop.run(plain) == 4
    assert value(registry, cat.BATCHES.name, loader="own-train", rank="0") == 8


SIDE_BY_SIDE = """
import gc, json, os, time
import torch
from torch.utils.data import DataLoader
from support.torch_helpers import FailingDataset, SleepDataset

def fds():
    return len(os.listdir('/proc/self/fd'))

for _ in DataLoader(SleepDataset(4), batch_size=2, num_workers=2):  # torch's own first-use
    pass                                                              # descriptors, once
gc.collect()
before = fds()
loader = DataLoader(SleepDataset(10), batch_size=3, shuffle=True, num_workers=2,
                    generator=torch.Generator().manual_seed(7))
seen = [[[x.tolist() if isinstance(x, torch.Tensor) else x for x in b] for b in loader]
        for _ in range(2)]
types = [type(x).__name__ for x in next(iter(loader))]
try:
    for _ in DataLoader(FailingDataset(6, 3), batch_size=2):
        pass
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
del loader
gc.collect()
deadline = time.monotonic() + 10
while fds() > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"seen": seen, "types": types, "error": error, "fds_back": fds() <= before,
                  "hooked": hasattr(DataLoader.__iter__, "__dataloader_exporter_original__")}))
"""


@pytest.mark.slow
def test_zero_code_mode_gives_a_program_what_torch_alone_gives_it(tmp_path: Path) -> None:
    """The same program with the environment switch off and on: the same batches, order,
    types and exception, and no descriptor left behind by its loaders."""
    def once(switch: bool) -> dict[str, object]:
        path = [str(REPO / "tests"), str(REPO)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [autorun_dir(), *path] if switch else path)}
        env.pop("DATALOADER_EXPORTER_AUTO", None)
        if switch:
            env["DATALOADER_EXPORTER_AUTO"] = "1"
        out = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE], env=env,
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    bare, ours = once(False), once(True)
    assert (bare["hooked"], ours["hooked"]) == (False, True)
    for key in ("seen", "types", "error"):
        assert ours[key] == bare[key], key
    assert ours["error"] == "ValueError: corrupt sample 3"
    assert ours["fds_back"] and bare["fds_back"]


# --- loader subclasses of every shape, on two ranks --------------------------------------
@pytest.fixture(scope="module")
def odd_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Run]:
    """tests/frameworks/odd_loaders.py under the environment switch, as rank 0 (which
    builds a probe loader first) and rank 1, with a settings line for every loader."""
    runs = {}
    for rank in (0, 1):
        tmp = tmp_path_factory.mktemp(f"odd-{rank}")
        path = os.pathsep.join([autorun_dir(), str(SCRIPTS), str(REPO)])
        runs[rank] = run_script(tmp, [sys.executable, str(SCRIPTS / "odd_loaders.py"),
                                      str(tmp)],
                                {"PYTHONPATH": path, "DATALOADER_EXPORTER_AUTO": "1",
                                 "DATALOADER_EXPORTER_DIR": str(tmp / "m"), "RANK": str(rank),
                                 "DATALOADER_EXPORTER_SETTINGS": "*.pin_memory=false"})
    return runs


@pytest.mark.slow  # `odd_ranks`: shared training runs
def test_names_are_the_same_on_every_rank_whatever_was_built_before(
        odd_ranks: dict[int, Run]) -> None:
    train = built_at("odd_loaders.py", "return DataLoader(data(n)", "train = make(16)")
    probe = built_at("odd_loaders.py", "return DataLoader(data(n)", "probe = make(4)")
    for rank, run in odd_ranks.items():
        assert run.value(rank, cat.BATCHES.name, loader=train) == 8, rank
    assert odd_ranks[0].value(0, cat.BATCHES.name, loader=probe) == 2
    assert odd_ranks[1].value(1, cat.BATCHES.name, loader=probe) is None


@pytest.mark.slow  # `odd_ranks`: shared training runs
def test_subclasses_of_every_shape_are_counted_once_and_run_as_without_us(
        odd_ranks: dict[int, Run]) -> None:
    run, truth = odd_ranks[1], odd_ranks[1].truth[1]
    for key in ("lazy", "pinned", "multi"):  # [name, batches, samples] as the loop saw
        name, batches, samples = truth["seen"][key]
        assert run.value(1, cat.BATCHES.name, loader=name) == batches, key
        assert run.value(1, cat.SAMPLES.name, loader=name) == samples, key
    # __iter__ returning a generator that reaches torch's later: two epochs, not four.
    assert run.value(1, cat.EPOCHS.name, loader=truth["seen"]["lazy"][0]) == 2
    # A setting reaches torch's __init__ through a subclass that takes **kwargs and
    # passes its own value: applied there, never "multiple values" for it.
    assert truth["pinned"] is False
    assert "got multiple values" not in run.log
    # A subclass with none of torch's attributes runs as without us, and is said to take
    # no settings.
    assert truth["facade"] == [3, 6]
    assert "pin_memory not applied: Facade.__init__ takes no such argument" in run.log
    assert "cannot instrument" not in run.log
