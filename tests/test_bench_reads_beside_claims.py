"""scripts/bench_reads_beside_claims.py runs end to end, side by side with a baseline tree (here this checkout)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


def test_each_round_has_both_phases_per_tree(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_reads_beside_claims")
    assert bench.main(["--gpus", "1000", "--requests", "30", "--rounds", "1", "--baseline", str(ROOT),
                       "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tree"], r["admin"]) for r in rows] == [("before", False), ("before", True), ("after", False),
                                                      ("after", True)]
    for r in rows:
        assert r["claims_per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert (r["admin_runs"] > 0) == r["admin"]
    table = bench.render(rows).splitlines()
    assert table[0].startswith("| round | code |") and table[3].startswith("| 1 | before | status + doctor |")
