"""Shared fixtures: an isolated state folder, SQLite and PostgreSQL stores, and a Controller with the demo
inventory applied, run once per store."""

from __future__ import annotations

import itertools
import json
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "inventory" / "demo.yaml"
PG_BASE = os.environ.get("VGPU_CTL_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
PG_DB = os.environ.get("VGPU_CTL_TEST_PG_DB", "test")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True)
def user_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test its own user cache ($XDG_CACHE_HOME): none writes the user's, none sees another's."""
    path = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path


@pytest.fixture
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Simulated hosts (and the default SQLite store) keep their state under tmp_path."""
    path = tmp_path / "state"
    path.mkdir()
    monkeypatch.setenv("VGPU_CTL_STATE_DIR", str(path))
    monkeypatch.delenv("VGPU_CTL_DATABASE_URL", raising=False)
    monkeypatch.delenv("VGPU_CTL_TOKEN", raising=False)
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite file."""
    return f"sqlite:///{tmp_path / 'store.db'}"


def pg_admin() -> Any:
    """An autocommit psycopg connection to the test database, outside any store's pool."""
    import psycopg
    return psycopg.connect(f"{PG_BASE}/{PG_DB}", autocommit=True, connect_timeout=5)


@contextmanager
def pg_schema() -> Iterator[str]:
    """A fresh schema in the test database, dropped afterwards; yields a store URL whose connections use
    only that schema. Skipped (visibly) when the server can't be reached; with CI=true that fails instead."""
    try:
        admin = pg_admin()
    except Exception as exc:
        msg = f"PostgreSQL not reachable at {PG_BASE}/{PG_DB}: {exc}"
        if _in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    name = f"vgpu_test_{uuid.uuid4().hex[:12]}"
    try:
        admin.execute(f'CREATE SCHEMA "{name}"')
        yield f"{PG_BASE}/{PG_DB}?options=-csearch_path%3D{name}"
    finally:
        try:
            admin.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        finally:
            admin.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A store URL on the local PostgreSQL with a fresh, empty schema per test (dropped afterwards)."""
    with pg_schema() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, state_dir: Path) -> str:
    """The store URL, once for SQLite and once for PostgreSQL (a fresh database each test)."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def ctl(store_url: str, state_dir: Path) -> Iterator[Any]:
    """A Controller on the store with inventory/demo.yaml applied."""
    from vgpu_ctl import Controller
    c = Controller(store_url)
    c.apply_inventory(DEMO)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def pg_acme(pg_url: str, state_dir: Path) -> Iterator[Any]:
    """A Controller on a fresh PostgreSQL schema with inventory/demo.yaml applied and tenant acme."""
    from vgpu_ctl import Controller
    c = Controller(pg_url)
    try:
        c.apply_inventory(DEMO)
        c.create_tenant("acme")
        yield c
    finally:
        c.close()


@contextmanager
def libpq_trace(engine: Any, path: Path, when: Any = None) -> Iterator[None]:
    """libpq's trace (regress mode, no timestamps) to `path` of every connection the engine checks out inside
    the block (only while `when()` is true, if given), from its checkout to its checkin; the pool's pre-ping on
    checkout comes before it."""
    from psycopg import pq
    from sqlalchemy import event

    out = path.open("w")

    def traced(dbapi: Any, _record: Any, _proxy: Any) -> None:
        if when is None or when():
            dbapi.pgconn.trace(out.fileno())
            dbapi.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def untraced(dbapi: Any, _record: Any) -> None:
        if dbapi is not None:
            dbapi.pgconn.untrace()

    event.listen(engine, "checkout", traced)
    event.listen(engine, "checkin", untraced)
    try:
        yield
    finally:
        event.remove(engine, "checkout", traced)
        event.remove(engine, "checkin", untraced)
        out.close()


def trace_messages(path: Path) -> list[str]:
    """The messages of a libpq trace, each a line starting F (to the server) or B (from it); a statement's text
    that goes on over several lines is left out."""
    return [ln for ln in path.read_text().splitlines() if ln[:2] in ("F\t", "B\t")]


def round_trips(messages: list[str]) -> int:
    """The waits for the server in trace messages: each run of messages to it answered by one from it."""
    return sum(a[0] == "F" and b[0] == "B" for a, b in itertools.pairwise(messages))


def load_script(name: str) -> ModuleType:
    """scripts/`name`.py loaded as a module, the scripts folder on sys.path (for the benchmarks it imports)."""
    import importlib.util
    scripts = REPO / "scripts"
    if str(scripts) not in sys.path:
        sys.path.insert(0, str(scripts))
    spec = importlib.util.spec_from_file_location(name, scripts / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_inventory(tmp_path: Path, text: str, name: str = "inv.yaml") -> Path:
    """Write an inventory file under tmp_path."""
    path = tmp_path / name
    path.write_text(text)
    return path


def store_snapshot(c: Any) -> dict[str, Any]:
    """What a refused call must leave as it was: inventory, tenants, usage, VMs, devices, events, quotas."""
    from sqlalchemy import select

    from vgpu_ctl.store import tables
    from vgpu_ctl.store.tables import EVENT, VM

    def rows(table: Any, order: Any) -> list[dict[str, Any]]:
        with c.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(select(table).order_by(order)).all()]

    return {
        "inventory": c.inventory(),
        "tenants": rows(tables.TENANT, tables.TENANT.c.id),
        "scoped": rows(tables.SCOPED, tables.SCOPED.c.id),
        "vms": rows(VM, VM.c.id),
        "devices": rows(tables.DEVICE, tables.DEVICE.c.id),
        "gpus": rows(tables.GPU, tables.GPU.c.id),
        "hosts": rows(tables.HOST, tables.HOST.c.id),
        "events": rows(EVENT, EVENT.c.id),
    }


def check_store_invariants(engine: Any) -> dict[str, Any]:
    """Check the design's invariants from the tables themselves, with plain SQL (not the service code):
    devices never overlap on a GPU; each GPU's layout, free units, device count and active type mirror its
    devices; tenants' usage (global and scoped) equals the sum of what their VMs hold and never passes a
    limit; hosts' used vCPUs and memory equal the sum of their VMs; each host summary (host_fit) adds up its
    GPUs. Returns the per-tenant sums."""
    from sqlalchemy import text

    holding = "('requested', 'placed', 'devices-ready', 'defined', 'running', 'stopped', 'releasing', 'hibernated')"
    with engine.connect() as conn:
        gpus = {r.id: r for r in conn.execute(text("SELECT * FROM gpu"))}
        devices = conn.execute(text("SELECT d.*, v.state AS vm_state, v.tenant_id, v.pool_id "
                                    "FROM device d JOIN vm v ON v.id = d.vm_id")).all()
        vms = conn.execute(text(f"SELECT * FROM vm WHERE state IN {holding}")).all()
        tenants = conn.execute(text("SELECT * FROM tenant")).all()
        scoped = conn.execute(text("SELECT * FROM scoped_quota")).all()
        hosts = conn.execute(text("SELECT * FROM host")).all()
        pools = {r.id: r.name for r in conn.execute(text("SELECT id, name FROM pool"))}
        summaries = {tuple(r[:5]): tuple(r[5:]) for r in conn.execute(text(
            "SELECT host_id, pool_id, model, mode, bitval, n_fit, free_units FROM host_fit WHERE n_fit > 0"))}
        bits = [r[0] for r in conn.execute(text("SELECT bitval FROM fit_bit"))]

    by_gpu: dict[int, list[Any]] = {}
    for d in devices:
        assert d.vm_state != "failed", f"device {d.id} still held by failed VM {d.vm_id}"
        by_gpu.setdefault(d.gpu_id, []).append(d)
    for gid, g in gpus.items():
        devs = sorted(by_gpu.get(gid, []), key=lambda d: d.start)
        for a, b in itertools.pairwise(devs):
            assert a.start + a.size <= b.start, f"GPU {g.id}: {a.profile}@{a.start} overlaps {b.profile}"
        assert all(d.start >= 0 and d.start + d.size <= g.axis_units for d in devs)
        layout = ";".join(f"{d.profile}@{d.start}+{d.size}" for d in devs)
        assert g.layout == layout, f"GPU {g.id} layout {g.layout!r} != devices {layout!r}"
        assert g.free_units == g.axis_units - sum(d.size for d in devs), f"GPU {g.id} free_units"
        assert g.device_count == len(devs), f"GPU {g.id} device_count"
        if g.mode == "vgpu-equal":
            assert len({d.profile for d in devs} | ({g.pinned_type} if g.pinned_type else set())) <= 1
            assert g.active_type == (devs[0].profile if devs else None)

    expected: dict[tuple[Any, ...], tuple[int, int]] = {}
    for g in gpus.values():  # each host summary row adds up its host's GPUs in the pool that can take its bit
        for bit in (b for b in bits if g.pool_id is not None and g.fits & b):
            n, free = expected.get((g.host_id, g.pool_id, g.model, g.mode, bit), (0, 0))
            expected[(g.host_id, g.pool_id, g.model, g.mode, bit)] = (n + 1, free + g.free_units)
    assert summaries == expected, "host_fit differs from the GPU rows: " + \
        str(sorted(set(summaries.items()) ^ set(expected.items()))[:5])

    sums: dict[int, dict[tuple[str, str], int]] = {t.id: {} for t in tenants}

    def add(tid: int, scope: str, resource: str, n: int) -> None:
        sums[tid][(scope, resource)] = sums[tid].get((scope, resource), 0) + n

    for v in vms:
        for scope in ("*", pools.get(v.pool_id, "?")):
            add(v.tenant_id, scope, "vms", 1)
            add(v.tenant_id, scope, "vcpus", v.vcpus)
            add(v.tenant_id, scope, "memory_mib", v.memory_mib)
    for d in devices:
        if d.vm_state == "failed":
            continue
        for scope in ("*", pools.get(d.pool_id, "?")):
            add(d.tenant_id, scope, "vgpus", 1)
            add(d.tenant_id, scope, "framebuffer_mib", d.framebuffer_mib)
            add(d.tenant_id, scope, f"profile:{d.profile}", 1)
    for t in tenants:
        for r in ("vms", "vgpus", "framebuffer_mib", "vcpus", "memory_mib"):
            used = getattr(t, f"{r}_used")
            assert used == sums[t.id].get(("*", r), 0), f"tenant {t.name} {r}_used {used} != allocations"
            limit = getattr(t, f"{r}_limit")
            assert limit is None or used <= limit, f"tenant {t.name} over its {r} limit"
    for q in scoped:
        assert q.used == sums[q.tenant_id].get((q.scope, q.resource), 0), \
            f"scoped {q.scope}/{q.resource} used {q.used} != allocations"
        assert q.used <= q.limit_value, f"scoped {q.scope}/{q.resource} over its limit"
    for h in hosts:
        mine = [v for v in vms if v.host_id == h.id and v.state != "hibernated"]  # hibernated: host share back
        assert h.used_vcpus == sum(v.vcpus for v in mine), f"host {h.name} used_vcpus"
        assert h.used_memory_mib == sum(v.memory_mib for v in mine), f"host {h.name} used_memory_mib"
        assert h.used_vcpus <= h.vcpus * h.cpu_overcommit
        assert h.used_memory_mib <= h.memory_mib * h.memory_overcommit
    return {t.name: sums[t.id] for t in tenants}


def assert_unchanged_but_refusal(c: Any, before: dict[str, Any], action: str = "vm.create") -> None:
    """The store is as `before`, except for one audit event recording the refusal."""
    after = store_snapshot(c)
    assert {k: v for k, v in after.items() if k != "events"} == {k: v for k, v in before.items() if k != "events"}
    new = after["events"][len(before["events"]):]
    assert after["events"][:len(before["events"])] == before["events"]
    assert len(new) == 1, new
    assert new[0]["action"] == action and new[0]["result"] == "refused", new


class Cli:
    """vgpuctl on one store, in process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.runner = CliRunner()

    def __call__(self, *args: str) -> Any:
        from vgpu_ctl.cli.main import app
        return self.runner.invoke(app, ["--db", self.url, *args])

    def json(self, *args: str, code: int = 0) -> Any:
        result = self(*args, "--json")
        assert result.exit_code == code, (result.exit_code, result.output)
        return json.loads(result.stdout)

    def readme_block(self, pattern: str) -> list[tuple[list[str], str]]:
        """Run each `vgpuctl` line of the README's ```sh block that `pattern` (a regex ending where the block
        starts) finds, asserting exit 0; each line's arguments with its output."""
        import re
        import shlex
        block = re.search(pattern + r".*?```sh\n(.*?)```", (REPO / "README.md").read_text(), re.S)
        assert block is not None, pattern
        outputs = []
        for line in block.group(1).splitlines():
            args = shlex.split(line, comments=True)
            assert args[0] == "vgpuctl"
            result = self(*args[1:])
            assert result.exit_code == 0, (line, result.output)
            outputs.append((args[1:], result.output))
        return outputs


@pytest.fixture
def cli(state_dir: Path, sqlite_url: str) -> Iterator[Cli]:
    """The CLI on a SQLite store with the demo inventory and tenant acme."""
    c = Cli(sqlite_url)
    c.json("inventory", "apply", str(DEMO))
    c.json("tenant", "create", "acme")
    yield c
