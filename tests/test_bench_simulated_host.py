"""scripts/bench_simulated_host.py runs end to end, and side by side with a baseline tree (here this checkout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_each_domain_count_gets_a_row_per_tree(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_simulated_host")
    assert bench.main(["--domains", "0,3", "--vms", "2", "--rounds", "1", "--baseline", str(ROOT), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["domains"], r["tree"]) for r in rows] == [(0, "before"), (0, "after"), (3, "before"), (3, "after")]
    for r in rows:
        steps = [r["create_device"], r["define_domain"], r["start_domain"]]
        assert all(t > 0 for t in steps) and r["per_vm"] == pytest.approx(sum(steps))
    assert bench.main(["--domains", "1", "--vms", "1", "--rounds", "1"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| domains on the host |") and table[2].startswith("| 1 |  |")
