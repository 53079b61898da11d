#!/usr/bin/env python3
"""Benchmark claims while an admin reads the store: one stream of `request_vm(provision=False)` on a pre-filled
fleet (the fleet of bench_placement.py, SQLite), alone and with `vgpuctl status` and `vgpuctl doctor` run in a
loop by another process, side by side on copies of one fleet.

Reads on SQLite hold no lock (`Database.read`), so the claims beside the admin's reads should keep their rate
and tail: the `max ms` column shows a claim held behind a read (before 2026-12-07, a read's BEGIN IMMEDIATE,
then the WAL checkpointer's RESTART waiting for the read, held claims for as long as a read lasted: 1-2 s at
10k GPUs). With `--baseline TREE` each round also runs another checkout's code (TREE: its root), alternating.

Usage: bench_reads_beside_claims.py [--gpus 10000] [--requests 3000] [--rounds 2] [--baseline TREE] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VGPUCTL = str(Path(sys.executable).parent / "vgpuctl")

# Run by each tree's Python: the claims of one phase, with or without the admin's loop beside them.
_RUN = """
import json, subprocess, sys, threading, time
from pathlib import Path
sys.path[:0] = [sys.argv[1] + "/scripts", sys.argv[1]]
from bench_allocator import _vgpus
from bench_placement import request_sequence
from vgpu_ctl import Controller, load_catalog
from vgpu_ctl.errors import Refused
url, admin, vgpuctl, seed, n = sys.argv[2], sys.argv[3] == "1", sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
stop, runs = threading.Event(), []
def loop():
    while not stop.is_set():
        for cmd in ("status", "doctor"):
            t = time.perf_counter()
            subprocess.run([vgpuctl, "--db", url, cmd], capture_output=True, check=False)
            runs.append(time.perf_counter() - t)
ctl = Controller(url)
beside = threading.Thread(target=loop)
if admin:
    beside.start()
    time.sleep(1.0)  # the first command has started reading
lat = []
start = time.perf_counter()
for r in request_sequence(load_catalog(), seed, n):
    t = time.perf_counter()
    try:
        ctl.request_vm(r.tenant, f"vm-{r.index}", _vgpus(r), vcpus=r.vcpus, memory_mib=r.memory_mib, pool=r.pool,
                       provision=False)
    except Refused:
        pass
    lat.append(time.perf_counter() - t)
wall = time.perf_counter() - start
stop.set()
if admin:
    beside.join()
ctl.close()
print(json.dumps({"lat": lat, "wall": wall, "runs": runs}))
"""


def _q(sorted_ms: Sequence[float], p: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(p * len(sorted_ms)))]


def run_phase(tree: Path, url: str, state: Path, admin: bool, seed: int, n: int) -> dict[str, Any]:
    """One phase in a process of its own running `tree`'s code: claims/s, p50, p99 and max ms, admin runs."""
    env = dict(os.environ, PYTHONPATH=str(tree), VGPU_CTL_STATE_DIR=str(state))
    out = subprocess.run([sys.executable, "-c", _RUN, str(tree), url, "1" if admin else "0", VGPUCTL, str(seed),
                          str(n)], env=env, cwd=tree, capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    ms = sorted(1000 * x for x in got["lat"])
    return {"claims_per_s": len(ms) / got["wall"], "p50_ms": _q(ms, 0.5), "p99_ms": _q(ms, 0.99),
            "max_ms": ms[-1], "admin_runs": len(got["runs"]),
            "admin_mean_s": sum(got["runs"]) / len(got["runs"]) if got["runs"] else 0.0}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every phase of every round, alternating trees."""
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
    from bench_allocator import Fleet
    trees = [("after", ROOT)] + ([("before", Path(args.baseline).resolve())] if args.baseline else [])
    if args.baseline:
        trees.reverse()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-reads-") as tmp:
        fleet = Fleet(Path(tmp), args.gpus, args.requests, args.seed)
        for rnd in range(1, args.rounds + 1):
            for name, tree in trees:
                for admin in (False, True):
                    url, state = fleet.copy()
                    rows.append({"round": rnd, "tree": name, "admin": admin,
                                 **run_phase(tree, url, state, admin, args.seed, args.requests)})
                    shutil.rmtree(state, ignore_errors=True)
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The table."""
    out = ["| round | code | admin reads beside | claims/s | p50 ms | p99 ms | max ms | admin runs (mean s) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['round']} | {r['tree']} | {'status + doctor' if r['admin'] else 'none'} | "
                   f"{r['claims_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['max_ms']:.1f} | "
                   f"{r['admin_runs']} ({r['admin_mean_s']:.2f}) |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run and print the table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=3_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--baseline", metavar="TREE", help="another checkout's root, run alternating as 'before'")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = run(args)
    print(json.dumps(rows, indent=1) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
