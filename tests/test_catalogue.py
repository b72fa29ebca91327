"""The catalogue is the one source of metric names; the docs' metric table comes from it."""

from __future__ import annotations

import re
from pathlib import Path

from dataloader_exporter.core import catalogue as cat

REPO = Path(__file__).resolve().parents[1]
UNIT_SUFFIX = {"seconds": "_seconds", "bytes": "_bytes", "ratio": "_ratio",
               "celsius": "_celsius", "watts": "_watts", "bytes_per_second": "_per_second"}


def test_names_follow_prometheus_conventions() -> None:
    assert len(cat.BY_NAME) == len(cat.ALL)
    for m in cat.ALL:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", m.name), m.name
        assert (m.type == cat.COUNTER) == m.name.endswith("_total"), m.name
        if m.unit:
            assert UNIT_SUFFIX[m.unit] in m.name, m.name
        assert m.help.endswith(".") and m.help[0].isupper(), m.name
        assert all(re.fullmatch(r"[a-z][a-z0-9_]*", label) for label in m.labels)
        assert m.type == cat.HISTOGRAM or not m.buckets, m.name
        assert list(m.buckets) == sorted(set(m.buckets)), m.name


def test_no_metric_name_is_typed_outside_the_catalogue() -> None:
    names = {m.name for m in cat.ALL} | {m.family for m in cat.ALL}
    # (diagnosis/ is a reader: its JSON report has keys such as shm_size_bytes of its own.)
    for package in ("core", "exporter", "instrument", "dashboards"):
        for path in (REPO / package).rglob("*.py"):
            if path.name == "catalogue.py":
                continue
            text = path.read_text()
            found = [n for n in names if re.search(rf"[\"']{n}(_bucket|_sum|_count)?[\"']", text)]
            assert not found, f"{path}: {found}"


def test_the_docs_metric_table_is_the_generated_one() -> None:
    text = (REPO / "docs" / "metrics.md").read_text()
    found = re.search(r"<!-- BEGIN METRIC TABLE[^\n]*-->\n(.*?)<!-- END METRIC TABLE -->",
                      text, re.S)
    assert found, "docs/metrics.md lost its METRIC TABLE markers"
    assert found.group(1) == cat.markdown_table(), (
        "docs/metrics.md's table is out of date; put the output of "
        "`python -m dataloader_exporter.core.catalogue` between its markers")
