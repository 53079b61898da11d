#!/usr/bin/env python3
"""Benchmark the server's in-memory allocator (vgpu_ctl/service/allocator.py) beside the store path, in one run.

One SQLite fleet (default 10,000 GPUs: the fleet of bench_placement.py, pools ampere/hopper/ada with pack, its
tenants and quotas), pre-filled as bench_placement pre-fills it; each phase starts from a copy of it and places
the same request sequence (bench_placement's):

- raw sqlite3: bench_placement's hand-written claim+quota transaction (charge the tenant, read a candidate
  page, take the host, compare-and-set the GPU), the reference every figure is a ratio to.
- store path: `Controller.request_vm(provision=False)` without an allocator (service/claim.py: read, plan,
  one write transaction per claim), from 1 caller and from C threads sharing one context.
- allocator: the same calls with the context's allocator (plan in memory, group commit), 1 caller and C.
- http: `vgpuctl serve` (allocator = false, then true) and C client threads each `POST /v1/vms?wait=60s`:
  a create over HTTP is an operation, run by a worker, and provisions the VM on its simulated host, so these
  rows measure the whole create, not the claim alone.

Reported: placements per second of wall clock, p50/p99 latency, ratio to the raw reference, what `vgpuctl
doctor` finds in the phase's store afterwards (any broken invariant is also listed under the table and makes the
exit status 1), and for the allocator how many claims each group commit wrote, how many batches had to be
written again claim by claim (a claim of the batch lost a race or was refused), and the time per claim spent
planning in memory and writing.
Targets (issue 12): >= 5,000 placements/s through the allocator at 10,000 GPUs with p99 <= 5 ms.
`--profile FILE` writes a cProfile of the committer's group commits (allocator, many callers).

`--postgres URL` runs the store path and allocator phases on PostgreSQL instead (each on a fleet built and
pre-filled again in a schema of its own; the raw reference stays sqlite3's).

Usage: bench_allocator.py [--gpus 10000] [--requests 2000] [--clients 16] [--raw 2000] [--postgres URL] [--json]
                          [--profile F]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_api
from bench_api import _fan_out, _vgpus, failures
from bench_placement import (
    FILL_TARGET,
    Req,
    _backup,
    build_store,
    expected_fill,
    pg_schema,
    phase_raw,
    prefill,
    request_sequence,
)

from vgpu_ctl import Controller, load_catalog
from vgpu_ctl.errors import Refused
from vgpu_ctl.service.allocator import Allocator
from vgpu_ctl.service.context import ServiceContext


class Fleet:
    """The pre-filled fleet and fresh copies of it (store file and state folder)."""

    def __init__(self, work: Path, n_gpus: int, n_requests: int, seed: int) -> None:
        self.work = work
        self.base = work / "base"
        self.base.mkdir()
        url = f"sqlite:///{self.base / 'store.db'}"
        catalog = load_catalog()
        build_store(url, self.base, catalog, n_gpus, "auto")
        target = min(0.88, max(0.0, FILL_TARGET - expected_fill(catalog, n_gpus, n_requests) - 0.02))
        self.fill = prefill(url, catalog, target, seed)
        self._n = 0

    def copy(self) -> tuple[str, Path]:
        """A copy: its URL and state folder."""
        self._n += 1
        dest = self.work / f"copy{self._n}"
        shutil.copytree(self.base, dest, ignore=shutil.ignore_patterns("store.db*"))
        _backup(self.base / "store.db", dest / "store.db")
        return f"sqlite:///{dest / 'store.db'}", dest


class PgFleet:
    """The same fleet on PostgreSQL: each copy built and pre-filled again, as the SQLite one was, in a schema of
    its own (dropped when the fleet closes)."""

    def __init__(self, base_url: str, work: Path, n_gpus: int, n_requests: int, seed: int) -> None:
        self.base_url, self.work, self.n_gpus, self.seed = base_url, work, n_gpus, seed
        catalog = load_catalog()
        self.target = min(0.88, max(0.0, FILL_TARGET - expected_fill(catalog, n_gpus, n_requests) - 0.02))
        self.fill = 0.0
        self._schemas = contextlib.ExitStack()
        self._n = 0

    def copy(self) -> tuple[str, Path]:
        """A fresh copy: its URL and state folder."""
        self._n += 1
        state = self.work / f"pg{self._n}"
        state.mkdir()
        url = self._schemas.enter_context(pg_schema(self.base_url))
        catalog = load_catalog()
        build_store(url, state, catalog, self.n_gpus, "auto")
        self.fill = prefill(url, catalog, self.target, self.seed)
        return url, state

    def close(self) -> None:
        """Drop every copy's schema."""
        self._schemas.close()


def phase_claims(url: str, state: Path, reqs: Sequence[Req], clients: int, allocator: bool,
                 profile: str | None = None) -> dict[str, Any]:
    """`request_vm(provision=False)` from `clients` threads sharing one context, with or without its
    allocator."""
    ctx = ServiceContext(url, state_path=state)
    if allocator:
        ctx.allocator = Allocator(ctx)
    admin = Controller(context=ctx)

    def one(k: int, req: Req) -> bool:
        try:
            admin.request_vm(req.tenant, f"vm-{req.index}", _vgpus(req), vcpus=req.vcpus,
                             memory_mib=req.memory_mib, pool=req.pool, provision=False)
            return True
        except Refused:
            return False

    if profile and ctx.allocator is not None:  # the committer thread's group commits
        prof = cProfile.Profile()
        commit = ctx.allocator._commit

        def profiled(batch: Any) -> None:
            prof.enable()
            try:
                commit(batch)
            finally:
                prof.disable()

        ctx.allocator._commit = profiled  # type: ignore[method-assign]
    try:
        out = _fan_out(reqs, clients, one)
        if ctx.allocator is not None:
            s = ctx.allocator.stats
            claimed = s["claims"] or 1
            out.update(per_batch=s["claims"] / s["batches"] if s["batches"] else 0.0, store_path=s["store_path"],
                       lost=s["lost"], split=s["split"], plan_ms=1000 * s["plan_s"] / claimed,
                       write_ms=1000 * s["write_s"] / claimed)
            if profile:
                prof.dump_stats(profile)
        return out
    finally:
        ctx.close()


def phase_http(url: str, state: Path, reqs: Sequence[Req], clients: int, allocator: bool) -> dict[str, Any]:
    """One server (with or without its allocator), C client threads, each `POST /v1/vms?wait=60s`."""
    config = state / "serve.toml"
    config.write_text(f"[server]\nallocator = {'true' if allocator else 'false'}\n")
    return bench_api.phase_http(url, state, reqs, clients, 1, ["--config", str(config)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase on copies of one fleet."""
    reqs = request_sequence(load_catalog(), args.seed, args.requests)
    with tempfile.TemporaryDirectory(prefix="bench-allocator-") as d, contextlib.ExitStack() as stack:
        fleet: Fleet | PgFleet = Fleet(Path(d), args.gpus, args.requests, args.seed)
        raw = phase_raw(fleet.copy()[0].removeprefix("sqlite:///"), args.raw)
        if args.postgres:
            fleet = PgFleet(args.postgres, Path(d), args.gpus, args.requests, args.seed)
            stack.callback(fleet.close)
        rows: list[dict[str, Any]] = []
        for name, clients, allocator in (("store path", 1, False), (f"store path, {args.clients} callers",
                                                                    args.clients, False),
                                         ("allocator", 1, True),
                                         (f"allocator, {args.clients} callers", args.clients, True)):
            prof = args.profile if allocator and clients > 1 else None
            url, state = fleet.copy()
            rows.append({"phase": name, **phase_claims(url, state, reqs, clients, allocator, prof),
                         "doctor": bench_api.store_problems(url, state)})
        if args.http:
            n = min(len(reqs), args.http)
            for allocator in (False, True):
                url, state = fleet.copy()
                rows.append({"phase": f"http create, {'allocator' if allocator else 'store path'}, "
                                      f"{args.clients} clients",
                             **phase_http(url, state, reqs[:n], args.clients, allocator),
                             "doctor": bench_api.store_problems(url, state)})
        for r in rows:
            r["ratio_raw"] = r["per_s"] / raw["per_s"] if raw["per_s"] else 0.0
        return {"gpus": args.gpus, "prefill": fleet.fill, "requests": len(reqs), "raw": raw, "rows": rows,
                "store": "PostgreSQL" if args.postgres else "SQLite"}


def render(report: dict[str, Any]) -> str:
    """The table (Markdown) and the targets."""
    raw = report["raw"]
    out = [f"{report['gpus']:,} GPUs, pre-filled {100 * report['prefill']:.1f} %, {report['requests']} requests "
           f"({report['store']}); raw sqlite3 claim+quota reference: {raw['per_s']:,.0f}/s", "",
           "| phase | placed | refused | failed | placements/s | p50 ms | p99 ms | ratio to raw | claims per commit "
           "| batches split | plan ms per claim | write ms per claim | doctor |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        extra = (f"{r['per_batch']:.1f} | {r['split']:.0f} | {r['plan_ms']:.3f} | {r['write_ms']:.3f}"
                 if "per_batch" in r else " | | |")
        out.append(f"| {r['phase']} | {r['created']} | {r['refused']} | {r['failed']} | {r['per_s']:,.0f} | "
                   f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['ratio_raw']:.3f} | {extra} | "
                   f"{bench_api.doctor_cell(r['doctor'])} |")
    out += failures(report["rows"])
    best = max((r for r in report["rows"] if r["phase"].startswith("allocator")), key=lambda r: r["per_s"])
    ok = best["per_s"] >= 5000 and best["p99_ms"] <= 5
    out += ["", f"{'PASS' if ok else 'MISS'}  >= 5,000 placements/s with p99 <= 5 ms through the allocator: "
                f"{best['per_s']:,.0f}/s, p99 {best['p99_ms']:.2f} ms ({best['phase']})"]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run and print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=16, help="concurrent callers of the many-callers phases")
    ap.add_argument("--raw", type=int, default=2000, help="raw sqlite3 reference transactions")
    ap.add_argument("--http", type=int, default=300, help="requests of each HTTP phase (0: no HTTP phases)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--postgres", metavar="URL", help="run the store and allocator phases on PostgreSQL (a schema "
                    "per phase in this database); the raw reference stays sqlite3's")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", metavar="FILE", help="cProfile of the committer in the many-callers allocator phase")
    args = ap.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if any(r["doctor"] for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
