"""The openb replay benchmark (scripts/bench_packing.py) on a tiny synthetic trace."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from vgpu_ctl.catalog import load_catalog  # noqa: E402
from vgpu_ctl.core.geometry import Mode, geometry_for  # noqa: E402
from vgpu_ctl.core.placement import TaskShape, get_policy  # noqa: E402


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_packing", _ROOT / "scripts" / "bench_packing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_packing"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = _load_script()

NODES = """sn,cpu_milli,memory_mib,gpu,model
node-0,32000,262144,2,G2
node-1,32000,262144,4,T4
node-2,16000,131072,1,V100M32
node-3,64000,524288,8,G3
"""
HEAD = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time"
TASKS = [  # name, cpu_milli, memory_mib, num_gpu, gpu_milli, gpu_spec
    ("t-whole", 4000, 16384, 1, 1000, ""),
    ("t-two", 4000, 16384, 2, 1000, ""),
    ("t-four", 8000, 32768, 4, 1000, ""),
    ("t-eight", 16000, 65536, 8, 1000, ""),
    ("t-470", 2000, 8192, 1, 470, ""),
    ("t-230", 2000, 8192, 1, 230, ""),
    ("t-810", 2000, 8192, 1, 810, ""),
    ("t-110", 1000, 4096, 1, 110, ""),
    ("t-t4-only", 1000, 4096, 1, 320, "T4"),
    ("t-cpu-only", 4000, 8192, 0, 0, ""),
    ("t-too-big", 999000, 4096, 1, 500, ""),  # more vCPUs than any node: always fails
]


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES)
    rows = [",".join(str(v) for v in t) + ",LS,Running,0,100,0" for t in TASKS]
    (tmp_path / "openb_pod_list_default.csv").write_text("\n".join([HEAD, *rows]) + "\n")
    short = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli", *(",".join(str(v) for v in t[:5]) for t in TASKS)]
    (tmp_path / "openb_pod_list_multigpu30.csv").write_text("\n".join(short) + "\n")
    return tmp_path


def _task(num_gpu: int, milli: int, cpu: int = 1000, mem: int = 1024) -> object:
    return bench.Task("t", cpu, mem, num_gpu, milli)


def test_table_rows_and_sane_percentages(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(trace_dir), "--trace", "default,multigpu30", "--seeds", "1..2", "--jobs", "1",
                       "--verify"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["default"], ["multigpu30"]) and "/" not in ln]
    assert len(rows) == 2 * 3 * 4
    assert {(r[0], r[1], r[2]) for r in rows} == {
        (t, m, p) for t in ("default", "multigpu30") for m in bench.MODES for p in bench.POLICY_NAMES}
    for r in rows:
        placed, consumed, placed_end = float(r[3]), float(r[5]), float(r[6])
        assert 0 < placed <= 100 and 0 < consumed <= 100 and 0 < placed_end <= 100
        assert placed <= consumed + 1e-9  # profiles round shares up
        lo, hi = (float(x) for x in r[4].strip("[]").split("-"))
        assert lo <= placed <= hi
    verdicts = [ln for ln in lines if ln.startswith(("default / ", "multigpu30 / "))]
    assert len(verdicts) == 6
    assert "machine:" in out and "date" in out


def test_json_and_failures_dropped(trace_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(trace_dir), "--trace", "default", "--modes", "mig", "--policies", "pack,first-fit",
                       "--seeds", "7", "--jobs", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["policy"]) for r in data["rows"]] == [("mig", "pack"), ("mig", "first-fit")]
    for run in data["runs"]:
        assert run["failed"] >= 1  # t-too-big never fits, and the run goes on
        assert run["skipped_cpu_only"] >= 1
        assert run["arrived_pct_end"] >= 130
        assert 0 < run["placed_pct"] <= run["placed_pct_end"] <= 100
        assert run["placed_pct_end"] <= run["consumed_pct_end"] <= 100
    assert data["header"]["gpus"] == 15 and data["header"]["cpus"] >= 1


def test_two_gpu_task_lands_on_one_host_on_two_gpus(trace_dir: Path) -> None:
    catalog = load_catalog()
    nodes = bench.load_nodes(trace_dir)
    for mode, policy, profile in (("vgpu-equal", "first-fit", "A100D-80C"), ("mig", "pack", "7g.80gb")):
        demand = {TaskShape((profile, "T4-16C"), gpus=2): 1.0}
        replay = bench.Replay(catalog, mode, nodes, get_policy(policy, demand), verify=True)
        p = replay.place(_task(2, 1000, cpu=3000, mem=2048))
        assert p is not None
        assert p.host_id == 0 and len({d.gpu_id for d in p.devices}) == 2
        assert [d.profile for d in p.devices] == [profile, profile]
        host = replay.fleet.views[0]
        assert host.free_vcpus == 32000 - 3000 and host.free_memory_mib == 262144 - 2048
        assert all(g.occupancy.free_units == 0 for g in host.gpus)
        # the next 2-GPU task no longer fits node-0: it goes to the next host with two free GPUs
        q = replay.place(_task(2, 1000))
        assert q is not None and q.host_id == 1 and len({d.gpu_id for d in q.devices}) == 2


def test_failure_leaves_fleet_unchanged(trace_dir: Path) -> None:
    replay = bench.Replay(load_catalog(), "vgpu-equal", bench.load_nodes(trace_dir), get_policy("best-fit"))
    before = list(replay.fleet.views)
    assert replay.place(_task(1, 500, cpu=10**9)) is None
    assert replay.place(_task(9, 1000)) is None
    assert replay.fleet.views == before


def test_profile_mapping() -> None:
    catalog = load_catalog()

    def prof(model: str, mode: Mode, milli: int) -> str | None:
        name: str | None = bench.profile_for(catalog, geometry_for(catalog, model, mode), milli)
        return name

    assert prof("A100-80GB", Mode.VGPU_EQUAL, 470) == "A100D-40C"
    assert prof("A100-80GB", Mode.VGPU_EQUAL, 1000) == "A100D-80C"
    assert prof("A100-80GB", Mode.MIG, 470) == "4g.40gb"  # 3g.40gb has only 3/7 of the compute
    assert prof("A100-80GB", Mode.MIG, 320) == "3g.40gb"
    assert prof("A100-80GB", Mode.MIG, 110) == "1g.10gb"
    assert prof("A100-80GB", Mode.MIG, 1000) == "7g.80gb"
    assert prof("T4", Mode.VGPU_EQUAL, 810) == "T4-16C"
    assert bench.mode_of(catalog, "T4", "vgpu-mixed") is Mode.VGPU_EQUAL
    assert bench.mode_of(catalog, "A10", "mig") is Mode.VGPU_EQUAL
    assert bench.mode_of(catalog, "H100-80GB", "mig") is Mode.MIG


def test_arrival_sequence_reaches_130_percent(trace_dir: Path) -> None:
    tasks = bench.load_tasks(trace_dir, "default")
    assert tasks[8].models == frozenset({"T4"})
    seq = bench.arrival_sequence(tasks, 15, 42)
    total = sum(t.gpu_request for t in seq)
    assert total >= 1.3 * 15 and total - seq[-1].gpu_request < 1.3 * 15
    assert seq == bench.arrival_sequence(tasks, 15, 42) != bench.arrival_sequence(tasks, 15, 43)
    assert bench.parse_seeds("42..44,50") == [42, 43, 44, 50]


def test_demand_mix_describes_task_shapes(trace_dir: Path) -> None:
    catalog = load_catalog()
    nodes = bench.load_nodes(trace_dir)
    mix = bench.demand_mix(catalog, "mig", nodes, bench.load_tasks(trace_dir, "default"))
    assert sum(mix.values()) == 10  # the tasks asking for GPUs, t-cpu-only left out
    two = next(s for s in mix if s.gpus == 2)
    assert (two.vcpus, two.memory_mib) == (4000, 0)  # memory left out, as in FGD
    assert two.profiles[0] == "7g.80gb" and "T4-16C" in two.profiles  # one per model, A100 and H100 share it
    t4_only = next(s for s in mix if s.vcpus == 1000 and "T4-8C" in s.profiles)
    assert t4_only.profiles == ("T4-8C",)


def test_host_state_cut_gives_the_plans_of_the_whole_fleet(tmp_path: Path) -> None:
    # many hosts alike, so the cut to one host per host state matters; --verify checks every plan
    rows = [f"node-{i},{6000 * (1 + i % 2)},{16384 * (1 + i % 4)},{(2, 4, 8)[i % 3]},{('G2', 'T4', 'G3')[i % 3]}"
            for i in range(24)]
    (tmp_path / "openb_node_list_gpu_node.csv").write_text("\n".join(["sn,cpu_milli,memory_mib,gpu,model", *rows]))
    short = ["name,cpu_milli,memory_mib,num_gpu,gpu_milli", *(",".join(str(v) for v in t[:5]) for t in TASKS)]
    (tmp_path / "openb_pod_list_default.csv").write_text("\n".join(short) + "\n")
    for mode in bench.MODES:
        result = bench.run_job(bench.Job(str(tmp_path), "default", mode, "pack", 3, verify=True))
        assert result["placed_pct"] > 30


def test_gpuspec_traces_restrict_a_share_of_gpu_tasks_to_one_model(trace_dir: Path) -> None:
    tasks = bench.load_tasks(trace_dir, "default")
    raw = bench.load_nodes(trace_dir, raw=True)
    assert {n.model for n in raw} == {"G2", "T4", "V100M32", "G3"}
    open_ = [t for t in tasks if t.num_gpu and t.models is None]
    for by in ("gpus", "nodes"):
        out = bench.restrict_to_models(tasks, raw, 0.5, "gpuspec-test", by)
        assert out == bench.restrict_to_models(tasks, raw, 0.5, "gpuspec-test", by)  # the same trace every time
        assert [t.name for t in out] == [t.name for t in tasks]
        changed = [(t, u) for t, u in zip(tasks, out, strict=True) if t != u]
        assert len(changed) == round(0.5 * len(open_))
        for before, after in changed:
            assert before.models is None and after.models is not None and len(after.models) == 1
            assert (after.cpu_milli, after.num_gpu, after.gpu_milli) == (before.cpu_milli, before.num_gpu,
                                                                          before.gpu_milli)
            widest = max(n.gpus for n in raw if bench.MODEL_MAP[n.model] in after.models)
            assert widest >= after.num_gpu  # never restricted to a model whose nodes are too small for it
        # tasks already restricted, and CPU-only tasks, are left as they were
        assert all(u == t for t, u in zip(tasks, out, strict=True) if t.models is not None or not t.num_gpu)
    many = [bench.Task(f"t{i}", 1000, 1024, 1, 500) for i in range(4000)]
    drawn = bench.restrict_to_models(many, raw, 1.0, "draw", "gpus")
    share = sum(1 for t in drawn if t.models == frozenset({"H100-80GB"})) / len(many)
    assert abs(share - 8 / 15) < 0.05  # G3 holds 8 of the 15 GPUs
    by_node = bench.restrict_to_models(many, raw, 1.0, "draw", "nodes")
    assert abs(sum(1 for t in by_node if t.models == frozenset({"H100-80GB"})) / len(many) - 1 / 4) < 0.05
    assert len(bench.load_tasks(trace_dir, "gpuspec33")) == len(tasks)


def test_store_replay_places_through_the_controller(trace_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(tmp_path / "outer"))
    catalog = load_catalog()
    nodes = bench.load_nodes(trace_dir)
    tasks = bench.load_tasks(trace_dir, "default")
    with bench.StoreReplay(catalog, "vgpu-equal", nodes, tasks) as store:
        assert store.models[0] == "H100-80GB"  # the model with the most GPUs is tried first
        pools = {p["name"]: p for p in store.ctl.pools()}
        assert set(pools) == {"gpu-h100-80gb", "gpu-a100-80gb", "gpu-t4", "gpu-v100-32gb"}
        assert all(p["policy"] == "pack" and p["demand"] for p in pools.values())
        took = store.place(bench.Task("x", 2000, 4096, 2, 1000))
        assert took == 2.0
        vms = store.ctl.list_vms()
        assert len(vms) == 1 and vms[0].pool == "gpu-h100-80gb" and len(vms[0].devices) == 2
        assert store.place(bench.Task("t4", 1000, 1024, 1, 300, frozenset({"T4"}))) == 0.5  # T4-8C
        assert store.place(bench.Task("big", 10**6, 1024, 1, 300)) is None  # no host has the vCPUs
        assert len(store.ctl.list_vms()) == 2
    assert bench.os.environ["VGPU_CTL_STATE_DIR"] == str(tmp_path / "outer")


def test_store_mode_reports_the_store_beside_the_pure_policy(trace_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(trace_dir), "--trace", "default", "--modes", "vgpu-equal,mig", "--policies", "pack",
                       "--seeds", "3", "--jobs", "1", "--store", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["mode"], r["policy"]) for r in data["rows"]] == [("vgpu-equal", "pack"), ("mig", "pack")]
    assert [r["mode"] for r in data["store"]] == ["vgpu-equal", "mig"]
    replays = sorted(r["replay"] for r in data["runs"])
    assert replays == ["pure", "pure", "pure-first", "pure-first", "store", "store"]
    for row in data["store"]:
        assert 0 < row["store"] <= 100 and 0 < row["pure_first"] <= 100
        assert row["store_gap"] == pytest.approx(row["store"] - row["pure_first"])
        assert row["store_within"] == (abs(row["store_gap"]) <= bench.STORE_GAP)
        assert row["cut"] is None and row["cut_gap"] is None


def test_cut_mode_replays_the_stores_pages_and_gives_the_stores_number(trace_dir: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([str(trace_dir), "--trace", "default", "--modes", "vgpu-equal,mig", "--policies", "",
                       "--seeds", "3", "--jobs", "1", "--store", "--cut", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert sorted(r["replay"] for r in data["runs"]) == ["cut", "cut", "pure-first", "pure-first", "store", "store"]
    for row in data["store"]:
        assert row["cut"] == pytest.approx(row["store"])  # the same hosts, order, pages and policies
        assert row["cut_gap"] == pytest.approx(row["cut"] - row["pure_first"])
        assert row["cut_within"] == (abs(row["cut_gap"]) <= bench.STORE_GAP)
