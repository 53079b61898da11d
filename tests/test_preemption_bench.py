"""scripts/bench_scheduling.py on a small slice of the trace: both policies replay, the table has every class, the
scheduler preempts only preemptible work for higher classes, and the PNG is a PNG."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACES = REPO.parent / "shared" / "traces" / "alibaba-gpu-v2023"


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_scheduling", REPO / "scripts" / "bench_scheduling.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scheduling"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not TRACES.exists(), reason="the Alibaba trace is not in ../shared/traces")
def test_small_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    out_png = tmp_path / "plot.png"
    assert bench.main(["--tasks", "300", "--gpus", "40", "--png", str(out_png)]) == 0  # type: ignore[attr-defined]
    text = capsys.readouterr().out
    for policy in ("fifo", "scheduler"):
        for cls in ("prod", "std", "batch"):
            assert any(line.split()[:2] == [policy, cls] for line in text.splitlines()), (policy, cls)
    assert "fifo: Jain's index over shares" in text and "preemptions 0" in text
    fifo_prod = next(line for line in text.splitlines() if line.split()[:2] == ["fifo", "prod"])
    sched_prod = next(line for line in text.splitlines() if line.split()[:2] == ["scheduler", "prod"])
    assert int(sched_prod.split()[5]) == 0 and int(fifo_prod.split()[5]) == 0  # prod is never preempted
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not TRACES.exists(), reason="the Alibaba trace is not in ../shared/traces")
def test_small_replay_through_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    assert bench.main(["--tasks", "120", "--gpus", "40", "--store",  # type: ignore[attr-defined]
                       "--png", str(tmp_path / "plot.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split()[:2]): line.split() for line in lines if line.split()[:1] == ["store"]}
    assert set(rows) == {("store", "prod"), ("store", "std"), ("store", "batch")}
    assert rows[("store", "prod")][5] == "0"  # prod is never preempted through the service either
    core = {tuple(line.split()[:2]): line.split() for line in lines if line.split()[:1] == ["scheduler"]}
    assert [rows[("store", c)][2] for c in ("prod", "std", "batch")] == \
        [core[("scheduler", c)][2] for c in ("prod", "std", "batch")]  # the same tasks
    assert any(line.startswith("store: Jain's index") for line in lines)
    assert any("store" in line and "tasks/s" in line for line in lines if line.startswith("replayed in"))
