"""Round trips a claim makes to PostgreSQL, counted with libpq's trace: the fleet and requests of bench_placement.py
on a fresh schema, each claim through Controller.request_vm(provision=False), its messages traced from the
connection's checkout to its checkin.

    .venv/bin/python scripts/count_round_trips.py --postgres postgresql://postgres@127.0.0.1:5432/test

A round trip is a wait for the server: a message to it followed by one from it. A ping of a pooled connection on
its checkout (one round trip; code before b96a3dd pinged on every checkout) runs before the trace starts, so the
pings are counted apart and added. Prints a table: claims, round trips per claim (mean, min, max) and where they
go (statement kinds of the first claim), and the mean claim time with the trace off, measured in the same run.
To compare code, run this file with PYTHONPATH at another tree.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_placement import build_store, pg_schema, prefill, request_sequence
from sqlalchemy import event

import vgpu_ctl
from vgpu_ctl.catalog import load_catalog
from vgpu_ctl.errors import NoCapacity
from vgpu_ctl.service.controller import Controller


def round_trips(lines: Sequence[str]) -> int:
    """Waits for the server in a libpq trace (regress mode): each run of frontend messages answered by the backend."""
    directions = [ln[0] for ln in lines if ln[:2] in ("F\t", "B\t")]  # a statement's text may go on over lines
    return sum(a == "F" and b == "B" for a, b in itertools.pairwise(directions))


def sent(lines: Sequence[str]) -> list[str]:
    """The statements (first words) and transaction commands of a trace, in order, each run ended by its Sync."""
    out = []
    for ln in lines:
        parts = ln.split("\t")
        if len(parts) > 3 and parts[0] == "F" and parts[2] in ("Parse", "Query"):
            words = parts[3].split('"')[3 if parts[2] == "Parse" else 1].split()
            out.append(" ".join(words[:2]) if words[0] in ("SELECT", "UPDATE", "INSERT", "DELETE") else words[0])
        elif len(parts) > 2 and parts[0] == "F" and parts[2] == "Sync":
            out.append("|")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres", required=True, help="base URL of a PostgreSQL database (a schema is made in it)")
    ap.add_argument("--gpus", type=int, default=1000)
    ap.add_argument("--prefill", type=float, default=0.5)
    ap.add_argument("--claims", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    from psycopg import pq

    catalog = load_catalog()
    with pg_schema(args.postgres) as url, tempfile.TemporaryDirectory() as tmp:
        build_store(url, Path(tmp), catalog, args.gpus, "auto")
        prefill(url, catalog, args.prefill, args.seed + 1)
        ctl = Controller(url, catalog=catalog, state_path=Path(tmp))
        trace: dict[str, Any] = {"file": None, "pings": 0}
        ping = ctl.engine.dialect.do_ping

        def counted_ping(dbapi: Any) -> bool:
            trace["pings"] += 1
            return bool(ping(dbapi))

        ctl.engine.dialect.do_ping = counted_ping  # type: ignore[method-assign]

        @event.listens_for(ctl.engine, "checkout")
        def _traced(dbapi: Any, _record: Any, _proxy: Any) -> None:
            if trace["file"] is not None:
                dbapi.pgconn.trace(trace["file"].fileno())
                dbapi.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

        @event.listens_for(ctl.engine, "checkin")
        def _untraced(dbapi: Any, _record: Any) -> None:
            if dbapi is not None:
                dbapi.pgconn.untrace()

        reqs = iter(request_sequence(catalog, args.seed, 10 * args.claims + 100))

        def claim(traced_to: Path | None) -> bool:
            r = next(reqs)
            trace["file"] = traced_to.open("w") if traced_to is not None else None
            try:
                ctl.request_vm(r.tenant, f"rt{r.index:07d}", [(r.profiles[0], len(r.profiles))], vcpus=r.vcpus,
                               memory_mib=r.memory_mib, pool=r.pool, provision=False)
                return True
            except NoCapacity:
                return False
            finally:
                if trace["file"] is not None:
                    trace["file"].close()
                trace["file"] = None

        try:
            for _ in range(5):  # statements compiled and prepared, the pool's connection made
                claim(None)
            counts: list[int] = []
            first: list[str] = []
            while len(counts) < args.claims:
                path = Path(tmp) / f"trace-{len(counts)}.txt"
                trace["pings"] = 0
                if not claim(path):
                    continue
                lines = path.read_text().splitlines()
                counts.append(round_trips(lines) + trace["pings"])
                first = first or sent(lines)
            times = []
            while len(times) < args.claims:
                t0 = time.perf_counter()
                if claim(None):
                    times.append((time.perf_counter() - t0) * 1000)
        finally:
            ctl.close()
    print(f"vgpu_ctl from {Path(vgpu_ctl.__file__).parent.parent}; {args.gpus} GPUs pre-filled to "
          f"{args.prefill:.0%}, {args.claims} claims traced, {args.claims} more timed untraced")
    print("| round trips per claim (mean) | min | max | mean claim ms (untraced) |")
    print("|---|---|---|---|")
    print(f"| {statistics.mean(counts):.2f} | {min(counts)} | {max(counts)} | {statistics.mean(times):.2f} |")
    print("first claim, after any ping ('|' ends what is sent before a wait):", " ".join(first))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
