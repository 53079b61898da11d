"""scripts/bench_plan.py runs (on a small fleet) and prints its table and verdicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"


def test_bench_plan_small(capsys: pytest.CaptureFixture[str]) -> None:
    if not TRACES.is_dir():
        pytest.skip(f"no traces at {TRACES}")
    spec = importlib.util.spec_from_file_location("bench_plan", ROOT / "scripts" / "bench_plan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_plan"] = module
    spec.loader.exec_module(module)
    assert module.main([str(TRACES), "--gpus", "300"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "trace default 300 GPUs, MIG" in out
    assert "PASS  the advisor's layout places more of the demo demand than the demo's carving: 29 vs 23 VMs" in out
    assert "FAIL" not in out
