#!/usr/bin/env python3
"""Time `vgpuctl plan` and `vgpuctl advise carving` at demo size and on a 10k-GPU fleet built from a trace, and
compare the placed demand of today's carving with the advisor's, in one run.

Demo: inventory/demo.yaml with inventory/demo-demand.yaml. Large: the trace's node list repeated until the fleet
has --gpus GPUs (every GPU vgpu-equal, as the trace's cluster is carved today; then again with every GPU that has
MIG in MIG mode, a carving the advisor should undo), and the trace's tasks that ask for GPUs cloned (a seeded draw)
until their GPU request is --arrived times the fleet's GPUs. Each row runs the same
code as the CLI (demand and fleet read from their files, the replay, stranded capacity, hosts to add, the HTML
report for plan; the candidates and their replays for advise) and is timed by wall clock.

Usage: bench_plan.py [TRACE_DIR (default ../shared/traces/alibaba-gpu-v2023)] [--gpus 10000] [--arrived 1.0]
       [--trace default] [--policy pack] [--json]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.planning.carving import advise
from vgpu_ctl.planning.demand import Demand, load_demand, scaled
from vgpu_ctl.planning.fleet import Fleet, fleet_from_inventory, fleet_from_trace
from vgpu_ctl.planning.replay import asked_gpus
from vgpu_ctl.planning.report_html import render
from vgpu_ctl.planning.whatif import hypothetical, make_plan

REPO = Path(__file__).resolve().parent.parent
TARGET_S = 60.0
T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn() and the seconds it took."""
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def case(name: str, load: Callable[[], tuple[Fleet, Demand]], policy: str) -> dict[str, Any]:
    """Plan and advise one fleet and demand; times include reading the files."""
    catalog = load_catalog()

    def do_plan() -> tuple[Any, str]:
        """What `vgpuctl plan --report` does."""
        fleet, demand = load()
        result = make_plan(catalog, fleet, demand, policy)
        return result, render(result.to_dict())

    (result, html), plan_s = timed(do_plan)

    def do_advise() -> Any:
        """What `vgpuctl advise carving` does."""
        fleet, demand = load()
        return advise(catalog, hypothetical(catalog, fleet, demand), demand, policy)

    advice, advise_s = timed(do_advise)
    fleet, demand = result.fleet, result.demand
    return {"case": name, "hosts": len(fleet.hosts), "gpus": fleet.gpu_count, "vms": demand.vms,
            "demand_gpus": round(sum(asked_gpus(catalog, demand.asks[i]) for i in demand.order), 1),
            "plan_s": round(plan_s, 2), "advise_s": round(advise_s, 2), "report_kib": round(len(html) / 1024, 1),
            "refused_today": result.outcome.refused_vms, "add_hosts": list(result.add_hosts),
            "today_pct": round(100 * advice.today.placed_share, 2),
            "advised_pct": round(100 * advice.advised.placed_share, 2),
            "today_vms": advice.today.placed_vms, "advised_vms": advice.advised.placed_vms, "winner": advice.winner,
            "candidates": [(s.name, round(100 * s.placed_share, 2), s.sampled) for s in advice.scores]}


def main(argv: list[str] | None = None) -> int:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("trace_dir", type=Path, nargs="?", default=REPO.parent / "shared" / "traces" / "alibaba-gpu-v2023")
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--arrived", type=float, default=1.0, help="the large demand's GPU request / the fleet's GPUs")
    ap.add_argument("--trace", default="default")
    ap.add_argument("--policy", default="pack")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    catalog = load_catalog()
    nodes = args.trace_dir / "openb_node_list_gpu_node.csv"
    tasks = args.trace_dir / f"openb_pod_list_{args.trace}.csv"

    def demo() -> tuple[Fleet, Demand]:
        """The demo fleet and demand."""
        return (fleet_from_inventory(REPO / "inventory" / "demo.yaml", catalog),
                load_demand(REPO / "inventory" / "demo-demand.yaml", catalog))

    def large(mode: str) -> Callable[[], tuple[Fleet, Demand]]:
        """A loader of the trace fleet carved in `mode` and the trace demand at --arrived."""
        def load() -> tuple[Fleet, Demand]:
            """The trace fleet and demand."""
            fleet = fleet_from_trace(nodes, catalog, mode, args.gpus)
            demand = load_demand(tasks, catalog)
            asked = sum(asked_gpus(catalog, demand.asks[i]) for i in demand.order)
            return fleet, scaled(demand, args.arrived * fleet.gpu_count / asked, seed=42)
        return load

    started = time.perf_counter()
    rows = [case("demo", demo, args.policy),
            case(f"trace {args.trace} {args.gpus} GPUs", large("vgpu-equal"), args.policy),
            case(f"trace {args.trace} {args.gpus} GPUs, MIG", large("mig"), args.policy)]
    header = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpus": os.cpu_count(),
              "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
              "policy": args.policy, "arrived": args.arrived, "wall_s": round(time.perf_counter() - started, 1),
              "load": os.getloadavg()[0]}
    if args.json:
        print(json.dumps({"header": header, "rows": rows}, indent=2))
        return 0
    print(f"bench_plan: {header['date']}, {header['cpus']} CPUs {header['machine']}, Python {header['python']}, "
          f"policy {args.policy}, large demand at {args.arrived:g}x the fleet's GPUs; wall {header['wall_s']} s, load "
          f"average {header['load']:.1f} at the end")
    cols = (f"{'case':<28} {'hosts':>6} {'GPUs':>6} {'VMs':>6} {'plan s':>7} {'advise s':>8} {'today %':>8} "
            f"{'advised %':>9} {'gain VMs':>8}  winner")
    print(cols)
    print("-" * len(cols))
    for r in rows:
        gain = r["advised_vms"] - r["today_vms"]
        print(f"{r['case']:<28} {r['hosts']:>6} {r['gpus']:>6} {r['vms']:>6} {r['plan_s']:>7.2f} "
              f"{r['advise_s']:>8.2f} {r['today_pct']:>8.2f} {r['advised_pct']:>9.2f} {gain:>+8d}  {r['winner']}")
    for r in rows:
        cands = ", ".join(f"{n} {p:.2f}{' (sample)' if s else ''}" for n, p, s in r["candidates"])
        print(f"  {r['case']}: candidates {cands}; HTML report {r['report_kib']:g} KiB")
        if r["add_hosts"]:
            print(f"  {r['case']}: {r['add_hosts'][0]}" + (f" (+{len(r['add_hosts']) - 1} more)"
                                                          if len(r["add_hosts"]) > 1 else ""))
    for r in rows:
        for what in ("plan", "advise"):
            ok = r[f"{what}_s"] < TARGET_S
            print(f"{'PASS' if ok else 'FAIL'}  {what} on {r['case']} in < {TARGET_S:g} s: {r[f'{what}_s']:.2f} s")
    demo_row = rows[0]
    better = demo_row["advised_vms"] > demo_row["today_vms"]
    print(f"{'PASS' if better else 'FAIL'}  the advisor's layout places more of the demo demand than the demo's "
          f"carving: {demo_row['advised_vms']} vs {demo_row['today_vms']} VMs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
