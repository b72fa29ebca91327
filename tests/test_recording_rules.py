"""The recording rules that aggregate across ranks: promtool's check and unit tests, a case
for every rule, names that say what they keep, and a wrong aggregation caught by the
cases. (test_dashboards_live runs them in a real Prometheus against a real run.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from support.rulefiles import FILES, promtool_run, write_rule_file
from test_dashboards import known_series, metric_names

from dataloader_exporter.dashboards import recording


def test_the_recording_rules_pass_promtool_check_rules(tmp_path: Path, promtool: str) -> None:
    write_rule_file(tmp_path, "recording")
    result = promtool_run(promtool, "check", "rules", str(tmp_path / "recording.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(recording.RULES)} rules found" in result.stdout


def test_promtool_unit_tests_pass_for_every_recording_rule(tmp_path: Path,
                                                          promtool: str) -> None:
    result = promtool_run(promtool, "test", "rules", str(write_rule_file(tmp_path, "recording")))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_recording_rule_has_a_case_and_every_case_checks_a_rule() -> None:
    tests = yaml.safe_load(FILES["prometheus/recording.test.yml"])["tests"]
    assert len(tests) == len(recording.CASES)
    checked = {t["expr"] for test in tests for t in test["promql_expr_test"]}
    assert checked == set(recording.NAMES)
    # Every rule is checked with a value somewhere; an empty expectation (a record that
    # must be absent, as for an idle loader) comes only on top of that.
    valued = {t["expr"] for test in tests for t in test["promql_expr_test"] if t["exp_samples"]}
    assert valued == set(recording.NAMES)
    absent = {t["expr"] for test in tests for t in test["promql_expr_test"]
              if not t["exp_samples"]}
    assert absent == {recording.RANK_FETCH_PER_BATCH, recording.RANK_STEP_PER_BATCH,
                      recording.FETCH_PER_BATCH, recording.MEDIAN_FETCH_PER_BATCH,
                      recording.BATCH_PERIOD, recording.INPUT_STALL, recording.STRAGGLER,
                      recording.WAIT_FOR_RANKS}


def test_names_say_the_labels_they_keep_and_rules_read_only_known_series() -> None:
    assert len(set(recording.NAMES)) == len(recording.NAMES)
    rules = yaml.safe_load(FILES["prometheus/recording.yml"])["groups"]
    assert [g["name"] for g in rules] == [recording.GROUP]
    for rule in recording.RULES:
        level = rule.record.split(":")[0].split("_")
        kept = re.findall(r"\b(?:sum|max|count|avg) by \(([^)]*)\)", rule.expr)
        for labels in kept:
            assert labels.split(", ") == ["namespace", *level], (rule.record, labels)
        assert "$" not in rule.expr, rule.record
        names = metric_names(rule.expr)
        assert names and names <= known_series(), (rule.record, names - known_series())
        earlier = set(recording.NAMES[:recording.NAMES.index(rule.record)])
        assert names & set(recording.NAMES) <= earlier, f"{rule.record} reads a later rule"


def test_the_job_stall_is_the_worst_rank_not_the_mean_over_ranks(tmp_path: Path,
                                                                  promtool: str) -> None:
    """Averaging over ranks, a plausible mistake, fails the two-rank case."""
    wrong = recording.recording_rules()
    for rule in wrong["groups"][0]["rules"]:
        if rule["record"] in (recording.FETCH_PER_BATCH, recording.BATCH_PERIOD):
            rule["expr"] = rule["expr"].replace("max by", "avg by")
    tests = write_rule_file(tmp_path, "recording", wrong)
    result = promtool_run(promtool, "test", "rules", str(tests))
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert recording.INPUT_STALL in out and "3.125E-01" in out  # the mean, not 5E-01
