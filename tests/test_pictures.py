"""The pictures of the dashboards under docs/pictures/ are current: their manifest lists the
panels and queries the code generates now, every panel drawn had data, the core panels
were drawn, and every PNG is the one the manifest names. `make pictures`
(tools/draw_dashboards.py) redraws them from a real run; nothing here starts one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from dataloader_exporter.dashboards.build import BOARDS
from dataloader_exporter.dashboards.render import render

REPO = Path(__file__).resolve().parents[1]
PICTURES = REPO / "docs" / "pictures"
REGENERATE = "regenerate with make pictures"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Panels a reader of the docs must see with data, by dashboard uid.
CORE = {
    "dataloader-overview": {
        "Input stall share of the job", "Input stall share", "Fetch wait per batch",
        "Throughput: samples per second", "Throughput: batches per second",
        "Workers active against configured", "/dev/shm used against size"},
    "dataloader-gpu": {
        "Mean GPU utilization", "GPU utilization", "GPU memory used against total",
        "PCIe throughput", "GPU temperature", "GPU power draw"},
    "dataloader-jobs": {"Input stall share by job", "Input stall share"},
}


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((PICTURES / "manifest.json").read_text(encoding="utf-8"))
    return data


def generated(uid: str) -> list[dict[str, Any]]:
    """Title and queries of each panel of the dashboard the code renders now, in order."""
    board = next(b for b in BOARDS if b.uid == uid)
    return [{"title": p["title"], "exprs": [t["expr"] for t in p["targets"]]}
            for p in render(board)["panels"] if p["type"] != "row"]


def test_the_manifest_lists_every_panel_and_query_the_dashboards_have_now(
        manifest: dict[str, Any]) -> None:
    assert sorted(manifest["dashboards"]) == sorted(b.uid for b in BOARDS), REGENERATE
    for uid, board in manifest["dashboards"].items():
        listed = [{"title": p["title"], "exprs": p["exprs"]} for p in board["panels"]]
        now = generated(uid)
        changed = [n["title"] for n, old in zip(now, listed, strict=False) if n != old]
        assert listed == now, (f"{uid}: panels changed ({changed[:3] or 'added or removed'}): "
                               f"{REGENERATE}")


def test_every_panel_drawn_had_data_and_every_panel_left_out_says_why(
        manifest: dict[str, Any]) -> None:
    for uid, board in manifest["dashboards"].items():
        for panel in board["panels"]:
            if panel["drawn"]:
                assert panel["series"] > 0 and panel["points"] > 0, (uid, panel["title"])
            else:
                assert panel["series"] == panel["points"] == 0, (uid, panel["title"])
                assert panel["why"], (uid, panel["title"])


def test_the_core_panels_were_drawn(manifest: dict[str, Any]) -> None:
    for uid, titles in CORE.items():
        drawn = {p["title"] for p in manifest["dashboards"][uid]["panels"] if p["drawn"]}
        assert titles <= {p["title"] for p in generated(uid)}, (uid, "a core panel was renamed")
        assert titles <= drawn, (uid, sorted(titles - drawn), REGENERATE)


def test_every_picture_is_a_png_named_by_its_uid_with_the_digest_the_manifest_holds(
        manifest: dict[str, Any]) -> None:
    for uid, board in manifest["dashboards"].items():
        assert board["file"] == f"{uid}.png"
        data = (PICTURES / board["file"]).read_bytes()
        assert data.startswith(PNG_SIGNATURE), board["file"]
        assert hashlib.sha256(data).hexdigest() == board["sha256"], (board["file"], REGENERATE)
    assert sorted(p.name for p in PICTURES.glob("*.png")) == sorted(
        b["file"] for b in manifest["dashboards"].values())


def test_the_manifest_says_how_and_when_it_was_made_and_is_written_deterministically(
        manifest: dict[str, Any]) -> None:
    assert "tools/draw_dashboards.py" in manifest["command"]
    assert manifest["date"]
    text = (PICTURES / "manifest.json").read_text(encoding="utf-8")
    assert text == json.dumps(manifest, sort_keys=True, indent=2) + "\n"
