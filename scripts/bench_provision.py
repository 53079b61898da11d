#!/usr/bin/env python3
"""Benchmark full provisioning through simulated hosts against the claim alone, side by side in one run.

For each fleet size, one store built and pre-filled as `bench_placement.py` builds it (same layout, pools,
tenants, request sequence), then, each from its own copy of the pre-filled store and in its own forked
process, the same first `--requests` requests through `Controller.request_vm` with `provision=False` (the
claim alone) and with `provision=True` (claim, devices, domain defined and started on simulated hosts),
alternating for `--rounds` rounds; the best round of each is reported, with their ratio and the raw sqlite3
claim+quota transaction of bench_placement measured in the same run as a reference. `--profile DIR` writes a
cProfile of each mode's last round (`DIR/{claim,provision}-N.prof`). `--baseline TREE` also runs both modes
with the vgpu_ctl of another checkout (TREE: its root), in the same rounds on copies of the same store, so that a
change's before and after are measured side by side.

Usage: bench_provision.py [--sizes 1000,10000] [--requests 200] [--rounds 2] [--seed 7] [--json] [--profile DIR]
                          [--baseline TREE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_placement as bp  # the fleet, the requests and the phases are bench_placement's


def _phase_in(tree: str, *args: Any) -> dict[str, Any]:
    """bench_placement's phase_store run by another checkout's code (its scripts and its vgpu_ctl)."""
    code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/scripts']; import bench_placement as bp; "
            "print(json.dumps(bp.phase_store(*json.loads(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, tree, json.dumps(args)], capture_output=True, text=True,
                          cwd=tree)
    if done.returncode:
        raise SystemExit(f"the baseline at {tree} failed:\n{done.stderr}")
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


def bench_size(n_gpus: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Build and pre-fill one fleet, then time the claim alone and full provisioning on copies of it (with this
    tree's code, and the baseline's if given)."""
    work = tmp / f"fleet-{n_gpus}"
    work.mkdir()
    url = f"sqlite:///{work / 'store.db'}"
    target = max(0.0, bp.FILL_TARGET - bp.expected_fill(bp.load_catalog(), n_gpus, args.requests) - 0.02)
    built = bp._run(True, bp.phase_build, url, str(work / "state"), n_gpus, "auto", min(0.88, target),
                    args.seed)
    snap = work / "store.db"
    raw_copy = work / "raw.db"
    bp._backup(snap, raw_copy)
    raw = bp._run(True, bp.phase_raw, str(raw_copy), args.raw_transactions)
    trees = ["after", "before"] if args.baseline else ["after"]
    best: dict[tuple[str, bool], dict[str, Any]] = {}
    for rnd in range(args.rounds):
        for tree in trees:
            for prov in (False, True):
                name = f"r{rnd}-{tree}-{int(prov)}"
                copy = work / f"{name}.db"
                bp._backup(snap, copy)
                prof = (str(Path(args.profile) / f"{'provision' if prov else 'claim'}-{tree}-{n_gpus}.prof")
                        if args.profile and rnd == args.rounds - 1 else None)
                phase = (f"sqlite:///{copy}", str(work / f"state-{name}"), args.requests, args.seed,
                         built["prefill"], n_gpus, prov, prof)
                out = (_phase_in(args.baseline, *phase) if tree == "before"
                       else bp._run(True, bp.phase_store, *phase))
                placed = sum(1 for r in out["results"] if r is not None)
                stats = {"requests": len(out["results"]), "placed": placed, **bp._stats(out["latencies"], placed),
                         "cpu_ms_per_request": 1000 * out["cpu_s"] / max(len(out["latencies"]), 1)}
                if (tree, prov) not in best or stats["mean_ms"] < best[tree, prov]["mean_ms"]:
                    best[tree, prov] = stats
    rows = []
    for tree in trees:
        claim, full = best[tree, False], best[tree, True]
        rows.append({"fleet_gpus": n_gpus, "tree": tree if args.baseline else "", "claim_only": claim,
                     "provisioned": full, "ratio": full["mean_ms"] / claim["mean_ms"] if claim["mean_ms"] else 0.0,
                     "p50_ratio": full["p50_ms"] / claim["p50_ms"] if claim["p50_ms"] else 0.0,
                     "raw_ms": 1000 / raw["per_s"] if raw["per_s"] else 0.0})
    return rows[::-1]


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    out = ["| GPUs | code | claim only: mean / p50 / p99 ms, CPU ms | provisioned: mean / p50 / p99 ms, CPU ms | "
           "ratio of means (target <= 2) | ratio of p50s | raw sqlite3 claim ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c, p = r["claim_only"], r["provisioned"]
        out.append(f"| {r['fleet_gpus']:,} | {r['tree']} | {c['mean_ms']:.2f} / {c['p50_ms']:.2f} / {c['p99_ms']:.2f}, "
                   f"{c['cpu_ms_per_request']:.2f} | {p['mean_ms']:.2f} / {p['p50_ms']:.2f} / {p['p99_ms']:.2f}, "
                   f"{p['cpu_ms_per_request']:.2f} | {r['ratio']:.2f} | {r['p50_ratio']:.2f} | {r['raw_ms']:.3f} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print its table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--sizes", default="1000,10000", help="fleet sizes in GPUs, comma-separated")
    ap.add_argument("--requests", type=int, default=200, help="requests per mode and round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both modes (best one kept)")
    ap.add_argument("--raw-transactions", type=int, default=2000, help="raw sqlite3 reference transactions")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile", help="folder for cProfile files of the last round")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--baseline", help="root of another checkout whose code also runs both modes (before)")
    args = ap.parse_args(argv)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-provision-") as tmp:
        rows = [row for s in args.sizes.split(",") for row in bench_size(int(s), args, Path(tmp))]
    print(json.dumps(rows, indent=1) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
