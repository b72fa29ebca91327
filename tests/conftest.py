"""Shared fixtures: fresh registries, promtool and Prometheus binaries; and the markers
`torch` and `slow` (pyproject.toml), given here by module, test and fixture name.

torch: the test needs torch, in its own process or one it starts. Every test of a module
outside TORCH_FREE has it, and the tests of TORCH_FREE modules named in NEEDS_TORCH.
Where torch is not installed (`make notorch`: the exporter, the doctor and the dashboards
must work without it), only TORCH_FREE modules are collected, and their tests marked torch
are deselected: a TORCH_FREE module that imports torch, or any helper that does
(torch_helpers.py), fails its collection there.

slow: the test takes seconds (a real Prometheus, torchrun, frameworks, many processes,
packaging venvs): `pytest -m "not slow"` (`make quick`) leaves them out.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import REPO, Prometheus
from prometheus_client import CollectorRegistry

TORCH_FREE = frozenset({
    "test_alerts.py",
    "test_auth_flood.py",
    "test_catalogue.py",
    "test_collectors_gpu.py",
    "test_collectors_shm_host.py",
    "test_compose.py",
    "test_dashboards.py",
    "test_dashboards_shapes.py",
    "test_doctor_dir.py",
    "test_doctor_why.py",
    "test_exporter_cli.py",
    "test_http_server.py",
    "test_imports.py",
    "test_jobs.py",
    "test_kubernetes.py",
    "test_recording_rules.py",
    "test_sidecar_floods.py",
    "test_snapshot_files.py",
    "test_snapshot_fuzz.py",
    "test_tuner.py",
    "test_webconfig.py",
})
# Tests of TORCH_FREE modules that run a trainer all the same (a process of their own, or
# files the instrumentation writes for them), by module and test function.
NEEDS_TORCH = {
    "test_compose.py": {"test_the_same_topology_without_containers_reaches_prometheus"},
    "test_doctor_dir.py": {  # a training script writes the directory the doctor reads
        "test_an_ended_input_bound_run_is_diagnosed_from_its_files",
        "test_the_whole_run_in_json_holds_what_the_script_handed_out",
        "test_the_env_format_prints_the_advice_for_an_ended_run",
        "test_fresh_files_with_no_batch_between_reads_are_a_live_run_never_an_ended_one",
        "test_the_doctor_never_deletes_nor_skips_an_old_file",
        "test_corrupt_files_beside_good_ones_are_skipped_and_counted",
        "test_an_earlier_runs_files_in_the_directory_are_left_out_and_said",
        "test_ranks_share_a_machine_only_when_their_files_name_the_same_host",
        "test_a_live_run_is_read_twice_as_a_window",
        "test_the_sidecar_of_a_run_that_has_ended_gives_whole_run_figures_not_idle",
        "test_samples_that_cannot_be_counted_are_unknown_not_zero",
        "test_a_trainer_killed_mid_epoch_ended_abruptly_one_that_exited_did_not",
    },
    "test_http_server.py": {  # the `snapshots` fixture: 4 ranks' files from bench/_snapshots
        "test_head_sends_the_headers_of_get_without_a_body_and_other_methods_get_405",
        "test_idle_and_slow_clients_are_closed_after_the_timeouts_while_scrapes_are_served",
        "test_a_thousand_idle_connections_leave_scrapes_answered_and_resources_bounded",
        "test_over_the_connection_cap_the_longest_idle_connection_makes_way",
        "test_clients_that_never_read_their_answers_cannot_lock_out_a_scrape",
        "test_fifty_concurrent_clients_get_valid_bodies_from_shared_collections",
        "test_a_symlinked_secret_never_reaches_the_log_and_a_bad_file_counts_once",
    },
    "test_imports.py": {  # they import the demo's and the drop-in's modules
        "test_every_command_module_loads_and_owns_its_arguments",
        "test_the_drop_in_loads_neither_the_server_nor_the_doctor",
    },
}
# slow: whole modules (torchrun, frameworks, packaging venvs, real Prometheus servers,
# many trainer processes), then single tests of a second or more on 2 cores, and every test
# that uses one of SLOW_FIXTURES.
SLOW_MODULES = frozenset({
    "test_bench.py",
    "test_dashboards_live.py",
    "test_data_libraries.py",
    "test_distributed.py",
    "test_exporter_e2e.py",
    "test_exposition_modes.py",
    "test_frameworks.py",
    "test_namespace.py",
    "test_packaging.py",
    "test_resources.py",
    "test_tuner_budgets.py",
    "test_tuner_loader.py",
    "test_worker_cases.py",
    "test_worker_liveness.py",
})
SLOW = {
    "test_alerts.py": {"test_promtool_unit_tests_pass_for_every_alert",
                       "test_the_unit_tests_catch_an_alert_that_never_fires"},
    "test_auth_flood.py": {
        "test_a_flood_from_ever_new_addresses_keeps_bcrypt_busy_but_a_cold_scraper_is_served",
        "test_sixteen_addresses_flooding_wrong_passwords_cannot_lock_out_a_cold_scraper"},
    "test_compose.py": {
        "test_make_certs_writes_a_web_config_that_loads_with_paths_beside_it",
        "test_the_sidecar_serves_https_with_the_generated_ca_and_password_and_401_without",
        "test_the_tls_prometheus_config_passes_promtool_and_scrapes_the_sidecar"},
    "test_doctor.py": {
        "test_a_tuned_loader_is_reported_with_the_settings_and_changes_the_tuner_made",
        "test_a_healthy_loader_exits_zero",
        "test_a_killed_worker_is_reported_as_lost",
        "test_a_starved_loader_is_input_bound_and_gets_workers",
        "test_batches_too_big_for_shm_are_a_risk_with_a_shm_size",
        "test_non_persistent_workers_with_a_slow_start_show_an_epoch_start_stall"},
    "test_doctor_dir.py": NEEDS_TORCH["test_doctor_dir.py"],  # they run a training script
    "test_http_server.py": NEEDS_TORCH["test_http_server.py"],  # and share its snapshots
    "test_imports.py": NEEDS_TORCH["test_imports.py"],
    "test_kubernetes.py": {
        "test_every_object_validates_strictly_against_kubernetes_and_the_crd_schemas"},
    "test_loader_transparent.py": {
        # torch 2.13 joins each worker of an iterator a dataset error ended for 5 s when it
        # is collected: 20 s at some later test's garbage collection
        "test_dataset_errors_reach_the_loop_with_the_same_type_and_message",
        "test_a_wrapped_torch_loader_raises_what_a_bare_one_raises",
        "test_every_start_method_gives_the_same_batches_and_worker_figures"},
    "test_serve_inprocess.py": {
        "test_a_client_in_a_tight_loop_waits_its_turn_and_others_are_answered_at_once"},
    "test_sidecar_floods.py": {
        "test_a_file_rewritten_in_place_a_hundred_times_a_second_is_neither_counted_nor_logged",
        "test_twenty_rejected_files_near_the_bounds_keep_the_sidecar_far_under_its_limit"},
    "test_snapshot_files.py": {
        "test_a_thousand_restarts_leave_only_recent_files_in_the_directory_and_the_caches"},
    "test_snapshot_fuzz.py": {
        "test_mutated_snapshots_never_damage_a_good_file_or_the_exposition"},
    "test_snapshots.py": {"test_a_short_run_writes_its_last_snapshot_at_exit",
                          "test_a_write_asked_for_while_one_is_under_way_is_not_lost",
                          "test_the_end_of_an_epoch_triggers_a_prompt_write"},
    "test_tls_auth.py": {
        "test_idle_connections_that_never_start_tls_cannot_starve_a_tls_scrape",
        "test_prometheus_scrapes_over_tls_with_basic_auth_and_others_are_refused",
        "test_wrong_passwords_queue_for_bcrypt_but_a_known_password_never_waits"},
    "test_top_and_demo.py": {
        "test_the_demo_runs_three_configurations_and_the_auto_one_settles_on_a_worker",
        "test_top_draws_in_a_terminal_and_quits_cleanly"},
    "test_zerocode.py": {
        "test_a_lookup_of_torch_before_its_import_does_not_switch_the_hook_off",
        "test_zero_code_mode_gives_a_program_what_torch_alone_gives_it"},
}
# Fixtures that start a real Prometheus, or a training run that a module's tests share.
SLOW_FIXTURES = frozenset({"prometheus", "env_switch", "odd_ranks"})

HAS_TORCH = importlib.util.find_spec("torch") is not None
if not HAS_TORCH:
    collect_ignore = sorted(p.name for p in Path(__file__).parent.glob("test_*.py")
                            if p.name not in TORCH_FREE)


def _listed(item: pytest.Item, names: dict[str, set[str]]) -> bool:
    function = getattr(item, "originalname", item.name)
    return function in names.get(item.path.name, set())


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    unknown = [m for m in (*TORCH_FREE, *NEEDS_TORCH, *SLOW_MODULES, *SLOW)
               if not (here / m).is_file()]
    if unknown:
        raise pytest.UsageError(f"tests/conftest.py names modules that do not exist: {unknown}")
    gone = [f"{m}::{n}" for m, names in (*NEEDS_TORCH.items(), *SLOW.items())
            for n in sorted(names) if f"def {n}(" not in (here / m).read_text()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py names tests that do not exist: {gone}")
    kept, deselected = [], []
    for item in items:
        module = item.path.name
        if module not in TORCH_FREE or _listed(item, NEEDS_TORCH):
            item.add_marker(pytest.mark.torch)
        if (module in SLOW_MODULES or _listed(item, SLOW)
                or SLOW_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.slow)
        torchless = not HAS_TORCH and item.get_closest_marker("torch")
        (deselected if torchless else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


IN_CI = os.environ.get("CI") == "true"


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A registry of the test's own; its hub's snapshot threads and servers are stopped
    after the test, so that they do not load the machine for every later test."""
    reg = CollectorRegistry()
    yield reg
    # none without the instrumentation imported
    hub = sys.modules.get("dataloader_exporter.instrument.hub")
    if hub is not None:
        hub.hub_for(reg).close()


def require_binary(name: str) -> str:
    """Path of a binary the test needs: skipped locally when missing, a failure in CI."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not installed (Debian package prometheus; `make test` installs it)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def require_module(name: str) -> Any:
    """A framework the test runs: skipped locally when missing, a failure in CI (`make test`
    installs the `frameworks` extra)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        msg = f"{name} not installed (the `frameworks` extra; `make test` installs it)"
        if IN_CI:
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_binary("promtool")


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """One real Prometheus for the whole session, evaluating the committed recording rules
    every second; tests add file_sd targets to it."""
    server = Prometheus(require_binary("prometheus"), tmp_path_factory.mktemp("prometheus"),
                        rule_files=[str(REPO / "deploy" / "prometheus" / "recording.yml")])
    yield server
    server.stop()
