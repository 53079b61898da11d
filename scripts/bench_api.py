#!/usr/bin/env python3
"""Benchmark VM creation over HTTP (`vgpuctl serve`) beside the in-process Controller, in one run.

One fleet (default 10,000 GPUs, the fleet of bench_placement.py: pools ampere/hopper/ada with pack, simulated
hosts) is built once per store backend (SQLite, and PostgreSQL when it answers); each phase starts from a
copy of it, so every phase places the same request sequence on the same fleet:

- in-process: `Controller.request_vm` (claim, then devices and domain on the simulated hosts) from C threads of
  one process sharing one ServiceContext: what a Python program embedding vgpu-ctl gets.
- http x1: one `vgpuctl serve` (its workers = C) and C client threads, each `POST /v1/vms?wait=60s` (the
  request is accepted as an operation, run by a worker, answered when done): what a remote tenant gets.
- http x2: two replicas on the same store, clients alternating between them.

Reported per phase: VMs created per second of wall clock, p50/p99 latency, the ratio to in-process, and what
`vgpuctl doctor` finds in the store once the phase is over (a fast phase that breaks an invariant is a bug).
Target (issue 11): HTTP >= 0.5 of the in-process rate at 10,000 GPUs.

Usage: bench_api.py [--gpus 10000] [--requests 400] [--clients 4] [--backends sqlite,postgres] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_placement import Req, build_store, request_sequence

from vgpu_ctl import Controller, load_catalog
from vgpu_ctl.errors import Refused
from vgpu_ctl.service.context import ServiceContext

VGPUCTL = str(Path(sys.executable).parent / "vgpuctl")
PG_BASE = os.environ.get("VGPU_CTL_TEST_PG", "postgresql://postgres@127.0.0.1:5432")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vgpus(req: Req) -> list[tuple[str, int]]:
    return list(collections.Counter(req.profiles).items())


def _stats(latencies: Sequence[float], wall: float, created: int, refused: int,
           failed: collections.Counter[str] | None = None) -> dict[str, Any]:
    lat = sorted(latencies)
    failed = failed or collections.Counter()
    return {"created": created, "refused": refused, "failed": sum(failed.values()), "errors": dict(failed),
            "wall_s": wall, "per_s": created / wall if wall else 0.0,
            "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
            "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0}


def _fan_out(reqs: Sequence[Req], clients: int, one: Callable[[int, Req], bool]) -> dict[str, Any]:
    """Run `one(client, req)` for every request from `clients` threads (request i on thread i mod clients); a
    request that fails (raises) is counted by its error and its thread goes on."""
    latencies: list[float] = []
    outcome = {"created": 0, "refused": 0}
    failed: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def worker(k: int) -> None:
        start.wait()
        for req in reqs[k::clients]:
            t0 = time.perf_counter()
            try:
                ok: bool | None = one(k, req)
            except Exception as exc:  # the table reports it
                ok, why = None, f"{type(exc).__name__}: {str(exc)[:120]}"
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
                if ok is None:
                    failed[why] += 1
                else:
                    outcome["created" if ok else "refused"] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return _stats(latencies, time.perf_counter() - t0, outcome["created"], outcome["refused"], failed)


class Store:
    """A built fleet and fresh copies of it."""

    def __init__(self, backend: str, work: Path, n_gpus: int) -> None:
        self.backend, self.work, self.n = backend, work, n_gpus
        self._copies = 0
        self.base_url = self._url("base")
        if backend == "postgres":
            self._create_db("base", template=None)
        build_store(self.base_url, self.state("base"), load_catalog(), n_gpus, "auto")
        if backend == "postgres":
            from sqlalchemy import create_engine
            create_engine(self.base_url).dispose()

    def _url(self, name: str) -> str:
        if self.backend == "sqlite":
            return f"sqlite:///{self.work / name / 'store.db'}"
        return f"{PG_BASE}/bench_api_{os.getpid()}_{name}"

    def state(self, name: str) -> Path:
        path = self.work / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _admin_pg(self, sql: str) -> None:
        from sqlalchemy import create_engine, text
        eng = create_engine(f"{PG_BASE}/postgres", isolation_level="AUTOCOMMIT")
        with eng.connect() as conn:
            conn.execute(text(sql))
        eng.dispose()

    def _create_db(self, name: str, template: str | None) -> None:
        db = f"bench_api_{os.getpid()}_{name}"
        self._admin_pg(f"DROP DATABASE IF EXISTS {db}")
        self._admin_pg(f"CREATE DATABASE {db}" + (f" TEMPLATE bench_api_{os.getpid()}_{template}" if template else ""))

    def copy(self) -> tuple[str, Path]:
        """A fresh copy of the built fleet: its URL and its state folder (simulated hosts included)."""
        self._copies += 1
        name = f"copy{self._copies}"
        dest = self.state(name)
        shutil.copytree(self.state("base"), dest, dirs_exist_ok=True)
        if self.backend == "postgres":
            self._create_db(name, template="base")
        return self._url(name), dest

    def drop(self) -> None:
        """Remove the PostgreSQL databases made."""
        if self.backend == "postgres":
            for i in range(self._copies + 1):
                self._admin_pg(f"DROP DATABASE IF EXISTS bench_api_{os.getpid()}_{'base' if i == 0 else f'copy{i}'}")


def phase_in_process(url: str, state: Path, reqs: Sequence[Req], clients: int) -> dict[str, Any]:
    """C threads of one process, one shared context, each calling request_vm."""
    ctx = ServiceContext(url, state_path=state)
    admin = Controller(context=ctx)  # the admin, on the shared context

    def one(k: int, req: Req) -> bool:
        try:
            admin.request_vm(req.tenant, f"vm-{req.index}", _vgpus(req), vcpus=req.vcpus,
                             memory_mib=req.memory_mib, pool=req.pool)
            return True
        except Refused:
            return False

    try:
        return _fan_out(reqs, clients, one)
    finally:
        ctx.close()


def _serve(url: str, state: Path, workers: int,
           serve_args: Sequence[str] = ()) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = dict(os.environ, VGPU_CTL_STATE_DIR=str(state))
    with open(state / f"serve-{port}.log", "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([VGPUCTL, "--db", url, "serve", *serve_args, "--listen", f"127.0.0.1:{port}",
                                 "--workers", str(workers), "--reconcile-interval", "0", "--log-level", "warning"],
                                env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            log_text = (state / f"serve-{port}.log").read_text()[-2000:]
            raise RuntimeError(f"vgpuctl serve exited {proc.returncode}:\n{log_text}")
        time.sleep(0.1)
    raise RuntimeError("vgpuctl serve did not answer /healthz within 60 s")


def phase_http(url: str, state: Path, reqs: Sequence[Req], clients: int, replicas: int,
               serve_args: Sequence[str] = ()) -> dict[str, Any]:
    """`replicas` servers on one store (`vgpuctl serve` with `serve_args` too), C client threads alternating
    between them."""
    env = dict(os.environ, VGPU_CTL_STATE_DIR=str(state))
    token = subprocess.run([VGPUCTL, "--db", url, "token", "create", "bench", "--role", "admin"], env=env,
                           check=True, capture_output=True, text=True).stdout.strip()
    servers = [_serve(url, state, clients, serve_args) for _ in range(replicas)]
    sessions = [httpx.Client(base_url=servers[k % replicas][1], timeout=120,
                             headers={"Authorization": f"Bearer {token}"}) for k in range(clients)]

    def one(k: int, req: Req) -> bool:
        body = {"tenant": req.tenant, "name": f"vm-{req.index}", "vcpus": req.vcpus, "memory_mib": req.memory_mib,
                "pool": req.pool, "vgpus": [{"profile": p, "count": n} for p, n in _vgpus(req)]}
        r = sessions[k].post("/v1/vms", params={"wait": "60s"}, json=body)
        if r.status_code == 201:
            return True
        if r.status_code == 409 and r.json().get("code") in ("quota_exceeded", "no_capacity", "refused"):
            return False
        raise RuntimeError(f"POST /v1/vms: {r.status_code} {r.text[:300]}")

    try:
        return _fan_out(reqs, clients, one)
    finally:
        for s in sessions:
            s.close()
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in servers:
            proc.wait(60)


def store_problems(url: str, state: Path) -> dict[str, int]:
    """The store's invariants that `vgpuctl doctor` finds broken: check name -> problems found (empty: clean)."""
    from vgpu_ctl.ops.doctor import diagnose
    ctx = ServiceContext(url, state_path=state)
    try:
        return {r.name: len(r.problems) for r in diagnose(Controller(context=ctx)) if r.problems}
    finally:
        ctx.close()


def _pg_up() -> bool:
    try:
        from sqlalchemy import create_engine, text
        eng = create_engine(f"{PG_BASE}/postgres", connect_args={"connect_timeout": 3})
        with eng.connect() as conn:
            conn.execute(text("SELECT 1"))
        eng.dispose()
        return True
    except Exception:
        return False


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every phase on every backend asked for."""
    reqs = request_sequence(load_catalog(), args.seed, args.requests)
    rows = []
    for backend in args.backends.split(","):
        if backend == "postgres" and not _pg_up():
            print(f"postgres at {PG_BASE} does not answer: skipped", file=sys.stderr)
            continue
        with tempfile.TemporaryDirectory(prefix=f"bench-api-{backend}-") as d:
            t0 = time.perf_counter()
            store = Store(backend, Path(d), args.gpus)
            build_s = time.perf_counter() - t0
            try:
                url, state = store.copy()
                base = phase_in_process(url, state, reqs, args.clients)
                rows.append({"backend": backend, "phase": "in-process", "build_s": build_s, **base, "ratio": 1.0,
                             "doctor": store_problems(url, state)})
                for replicas in (1, 2):
                    url, state = store.copy()
                    r = phase_http(url, state, reqs, args.clients, replicas)
                    rows.append({"backend": backend, "phase": f"http x{replicas}", "build_s": build_s, **r,
                                 "ratio": r["per_s"] / base["per_s"] if base["per_s"] else 0.0,
                                 "doctor": store_problems(url, state)})
            finally:
                store.drop()
    return rows


def render(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> str:
    """The table (Markdown)."""
    out = [f"VM creates at {args.gpus:,} GPUs, {args.requests} requests, {args.clients} concurrent callers "
           "(simulated hosts; ratio = rate / in-process rate in the same run; target: http >= 0.5)", "",
           "| store | phase | created | refused | failed | VMs/s | p50 ms | p99 ms | ratio | target | doctor |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        target = "-" if r["phase"] == "in-process" else ("met" if r["ratio"] >= 0.5 else "missed")
        out.append(f"| {r['backend']} | {r['phase']} | {r['created']} | {r['refused']} | {r['failed']} | "
                   f"{r['per_s']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['ratio']:.2f} | {target} | "
                   f"{doctor_cell(r.get('doctor', {}))} |")
    return "\n".join(out + failures(rows))


def doctor_cell(problems: dict[str, int]) -> str:
    """What doctor found, for a table cell: `check: problems, ...`, or `clean`."""
    return ", ".join(f"{name}: {n}" for name, n in sorted(problems.items())) or "clean"


def failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line per phase and error that failed requests (not refusals), with how many, and one per phase that left
    the store inconsistent."""
    return ([f"  {r['phase']}: {n} failed with {why}" for r in rows for why, n in r.get("errors", {}).items()]
            + [f"  {r['phase']}: doctor found {doctor_cell(r['doctor'])}" for r in rows if r.get("doctor")])


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the options, run, print the table (or JSON)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--backends", default="sqlite,postgres")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name in ("gpus", "requests", "clients"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    rows = run(args)
    print(json.dumps(rows, indent=2) if args.json else render(rows, args))
    return 1 if any(r["doctor"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
