"""The process limit the tuner's budget reads beside the open-file limit
(instrument/tuner/budget.py worker_limit): a container's pids cgroup (pids.max less
pids.current, v2 or v1), read from fixtures and from a real cgroup v1 pids controller."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dataloader_exporter.core.facts.cgroup import cgroup_pids_room


def tree(tmp_path: Path, self_cgroup: str, files: dict[str, str]) -> tuple[str, str]:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(self_cgroup)
    for name, text in files.items():
        path = tmp_path / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(tmp_path / "proc"), str(tmp_path / "cgroup")


def test_a_v2_pids_limit_leaves_its_max_less_its_current(tmp_path: Path) -> None:
    roots = tree(tmp_path, "0::/job\n", {"job/pids.max": "100\n", "job/pids.current": "37\n"})
    assert cgroup_pids_room(*roots) == 63


def test_a_v1_pids_limit_is_read_from_its_own_controller(tmp_path: Path) -> None:
    roots = tree(tmp_path, "8:pids:/pod\n4:memory:/other\n0::/\n",
                 {"pids/pod/pids.max": "64\n", "pids/pod/pids.current": "70\n"})
    assert cgroup_pids_room(*roots) == 0  # past its limit: no room, never negative


def test_no_limit_or_no_pids_controller_is_unknown_and_the_tightest_limit_wins(
        tmp_path: Path) -> None:
    assert cgroup_pids_room(*tree(tmp_path / "a", "0::/\n", {})) is None
    assert cgroup_pids_room(*tree(tmp_path / "b", "0::/\n", {
        "pids.max": "max\n", "pids.current": "12\n"})) is None
    assert cgroup_pids_room(*tree(tmp_path / "c", "0::/pod\n", {
        "pod/pids.max": "500\n", "pod/pids.current": "10\n",
        "pids.max": "50\n", "pids.current": "30\n"})) == 20  # the mount's root is tighter


@pytest.mark.torch
def test_a_real_pids_cgroup_caps_the_workers_the_tuner_may_add() -> None:
    """A process in a cgroup v1 pids controller limited to 48: the tuner's budget allows
    at most 48 / 4 more workers (a worker and the threads it may start), fewer than its
    sibling outside the group."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a pids cgroup")
    group = Path("/sys/fs/cgroup/pids") / f"dataloader-exporter-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "pids.max").write_text("48")
    except OSError as e:
        pytest.skip(f"no writable cgroup v1 pids controller here ({e})")
    probe = ("from dataloader_exporter.instrument.tuner.budget import worker_limit; "
             "print(worker_limit())")
    try:
        inside = subprocess.run(
            ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh",
             sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    finally:
        group.rmdir()
    outside = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120)
    assert inside.returncode == 0, inside.stderr
    limit = int(inside.stdout)
    assert 0 < limit <= 48 // 4, inside.stdout
    assert outside.stdout.strip() == "None" or int(outside.stdout) > limit, outside.stdout
