"""The placement benchmark runs end to end on a tiny fleet and reports sane numbers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_placement.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_placement", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_placement"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_tiny_fleet_table(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load()
    rc = bench.main(["--sizes", "64", "--requests", "50", "--provision-requests", "5", "--multi-requests", "4",
                     "--raw-transactions", "50", "--in-process"])
    out = capsys.readouterr().out
    # no target applies to 64 GPUs but memory, which must pass, and multi-GPU requests (machine-bound: either)
    assert rc == (1 if "FAIL  requests for 2, 4 and 8 GPUs" in out else 0), out
    lines = out.splitlines()
    assert lines[0].startswith("machine: ") and " CPUs, " in lines[0] and "date " in lines[0]
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("fleet GPUs"))
    for col in bench.COLUMNS:
        assert col in lines[header]
    cells = lines[header + 1].split()
    assert len(cells) == len(bench.COLUMNS)
    row = dict(zip(bench.COLUMNS, cells, strict=True))
    assert row["fleet GPUs"] == "64" and row["build"] == "declare"
    requests, placed, refused = int(row["requests"]), int(row["placed"]), int(row["refused"])
    assert 0 < requests <= 50 and placed + refused == requests and placed > 0
    assert 0 <= float(row["prefill %"]) <= float(row["fill %"]) <= 100
    assert float(row["placements/s"]) > 0 and float(row["core placements/s"]) > 0
    p50, p99 = float(row["p50 ms"]), float(row["p99 ms"])
    assert 0 < p50 <= p99 < 10_000
    assert 10 < float(row["peak MiB"]) < 4096
    assert float(row["store/core"]) > 0
    agree, compared = (int(x) for x in row["agree"].split("/"))
    assert compared == requests and agree == compared  # store and core made the same choices
    assert any("provisioning through simulated hosts" in line for line in lines)
    assert any("requests from 2 processes at once" in line for line in lines)
    assert float(row["raw sqlite3/s"]) > 0 and float(row["store/raw"]) > 0
    # requests for 1, 2, 4 and 8 GPUs on the empty fleet: each size's mean and its ratio to one GPU
    multi = next(i for i, line in enumerate(lines) if line.startswith("requests for k GPUs"))
    assert lines[multi + 1].split()[:6] == ["fleet", "GPUs", "k=1", "k=2", "k=4", "k=8"]
    cells = lines[multi + 2].split()
    assert cells[0] == "64" and cells[2] == "(1.00)" and len(cells) == 10 and float(cells[-1]) > 0
    verdicts = [line.split()[0] for line in lines if line[:4] in ("PASS", "FAIL", "n/a ")]
    assert verdicts[:2] == ["n/a", "n/a"] and verdicts[2] in ("PASS", "FAIL") and verdicts[3] == "PASS"
    assert len(verdicts) == 4
    assert any("requests for 2, 4 and 8 GPUs within 2x of 1 GPU at 64 GPUs" in line for line in lines)


def test_json_and_bulk_build_match_declared(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load()
    rc = bench.main(["--sizes", "40", "--requests", "20", "--provision-requests", "0", "--build", "bulk",
                     "--multi-requests", "0", "--raw-transactions", "20", "--in-process", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0
    (row,) = report["rows"]
    assert row["build"] == "bulk" and row["fleet_gpus"] == 40
    assert row["agree"] == row["compared"] == row["requests"] > 0
    assert row["placements_per_s"] > 0 and row["p50_ms"] <= row["p99_ms"]
    assert {"cpus", "platform", "python", "sqlite"} <= report["machine"].keys()
    # the same requests from two processes at once, on a copy of the same pre-filled store
    c = row["concurrent"]
    assert c["clients"] == 2 and c["requests"] == row["requests"] and 0 < c["placed"] <= c["requests"]
    assert c["placements_per_s"] > 0 and c["p50_ms"] <= c["p99_ms"]


def test_prefill_is_consistent(tmp_path: Path) -> None:
    """Pre-filled GPUs agree with their devices: layout, free units, device count, host usage."""
    bench = _load()
    from sqlalchemy import func, select

    from vgpu_ctl.catalog import load_catalog
    from vgpu_ctl.service import allocation as alloc
    from vgpu_ctl.store import tables
    from vgpu_ctl.store.engine import make_engine

    catalog = load_catalog()
    url = f"sqlite:///{tmp_path / 'store.db'}"
    bench.build_store(url, tmp_path / "state", catalog, 48, "bulk")
    fill = bench.prefill(url, catalog, 0.6, 3)
    assert 0.6 <= fill <= 1.0
    engine = make_engine(url)
    with engine.connect() as conn:
        gpus = conn.execute(select(tables.GPU)).all()
        for g in gpus:
            occ = alloc.occupancy_of(catalog, g._mapping)
            devs = conn.execute(select(tables.DEVICE.c.start, tables.DEVICE.c.size)
                                .where(tables.DEVICE.c.gpu_id == g.id)).all()
            assert sorted((s.start, s.size) for s in occ.slots) == sorted((d.start, d.size) for d in devs)
            assert g.free_units == occ.free_units and g.device_count == len(devs)
        used = dict(conn.execute(select(tables.HOST.c.id, tables.HOST.c.used_vcpus)).all())
        from vgpu_ctl.store.tables import VM
        per_host = dict(conn.execute(select(VM.c.host_id, func.sum(VM.c.vcpus)).group_by(VM.c.host_id)).all())
        assert all(used[h] == per_host.get(h, 0) for h in used)
    engine.dispose()
