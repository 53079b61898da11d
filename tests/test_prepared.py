"""`store.prepared.Prepared` on SQLite and PostgreSQL: binding by name (a bind used twice, literals the
statement binds itself), JSON and DATETIME values converted exactly as SQLAlchemy converts them, named-tuple
rows, driver errors raised as SQLAlchemy's, executemany, bad parameters and statements, and running inside
the caller's transaction."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Integer, bindparam, func, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from vgpu_ctl.store import migrate
from vgpu_ctl.store.engine import make_engine
from vgpu_ctl.store.prepared import Prepared, fill_defaults, generic_plans, insert_all, sent_together
from vgpu_ctl.store.tables import EVENT, HOST, TENANT


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    """An engine on a fresh store with the current schema."""
    e = make_engine(store_url)
    migrate.upgrade(e)
    try:
        yield e
    finally:
        e.dispose()


def _tenants(conn: Connection, name: str | None = None) -> list[str]:
    q = select(TENANT.c.name).order_by(TENANT.c.name)
    if name is not None:
        q = q.where(TENANT.c.name == name)
    return [r[0] for r in conn.execute(q)]


# -- binding ----------------------------------------------------------------------------------------------


def _add_hosts(engine: Engine) -> None:
    with engine.begin() as conn:
        for name, state, vcpus, mem in [("h1", "active", 8, 8), ("h2", "active", 16, 4), ("h3", "draining", 32, 32),
                                         ("h4", "active", 2, 64)]:
            conn.execute(HOST.insert().values(name=name, uri=f"simulated:///{name}", driver="simulated", labels={},
                                              state=state, vcpus=vcpus, memory_mib=mem))


def test_binds_by_name_with_a_repeated_bind_and_a_literal(engine: Engine) -> None:
    _add_hosts(engine)
    stmt = (select(HOST.c.name).where(HOST.c.state == "active",  # a literal the statement binds itself
                                      HOST.c.vcpus >= bindparam("n", type_=Integer),
                                      HOST.c.memory_mib >= bindparam("n", type_=Integer))  # the same bind twice
            .order_by(HOST.c.name))
    p = Prepared(stmt)
    expected = {1: ["h1", "h2", "h4"], 2: ["h1", "h2", "h4"], 4: ["h1", "h2"], 5: ["h1"], 8: ["h1"], 9: []}
    with engine.connect() as conn:
        for n, names in expected.items():
            got = [r[0] for r in p.run(conn, {"n": n}).fetchall()]
            assert got == names, n
            assert got == [r[0] for r in conn.execute(stmt, {"n": n})], n  # what SQLAlchemy itself returns
            assert [r.name for r in p.rows(conn, {"n": n})] == names
        assert "h3" not in [r[0] for r in p.run(conn, {"n": 0}).fetchall()]  # the literal is bound, not dropped


def test_binds_of_several_names_in_any_order(engine: Engine) -> None:
    _add_hosts(engine)
    p = Prepared(select(HOST.c.name).where(HOST.c.vcpus >= bindparam("min_cpu", type_=Integer),
                                           HOST.c.memory_mib <= bindparam("max_mem", type_=Integer),
                                           HOST.c.name != bindparam("skip"))
                 .order_by(HOST.c.name))
    with engine.connect() as conn:
        assert [r.name for r in p.rows(conn, {"skip": "h1", "max_mem": 32, "min_cpu": 4})] == ["h2", "h3"]
        assert [r.name for r in p.rows(conn, {"max_mem": 64, "min_cpu": 1, "skip": "h3"})] == ["h1", "h2", "h4"]


# -- types ------------------------------------------------------------------------------------------------

PARAMS = {"a": [1, 2, {"b": None, "c": True}], "text": "ünïcode ✓", "n": 1.5, "empty": {}, "big": 2 ** 40}
AWARE = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def _event(target: str, **kw: Any) -> dict[str, Any]:
    return {"actor": "tester", "action": "test.roundtrip", "target": target, **kw}


def _as_utc(t: datetime) -> datetime:
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def test_json_and_datetime_round_trip_as_through_sqlalchemy(engine: Engine) -> None:
    ins = insert_all(EVENT)
    with engine.begin() as conn:
        ins.run(conn, fill_defaults(EVENT, _event("prepared", time=AWARE, params=PARAMS, tenant="acme")))
        conn.execute(EVENT.insert().values(**_event("sqlalchemy", time=AWARE, params=PARAMS, tenant="acme")))
        ins.run(conn, fill_defaults(EVENT, _event("prepared-null", time=AWARE, params=[], tenant=None)))
        conn.execute(EVENT.insert().values(**_event("sqlalchemy-null", time=AWARE, params=[], tenant=None)))
    with engine.connect() as conn:
        rows = {r.target: r._asdict() for r in conn.execute(select(EVENT))}
    for ours, theirs in [("prepared", "sqlalchemy"), ("prepared-null", "sqlalchemy-null")]:
        a, b = dict(rows[ours]), dict(rows[theirs])
        for r in (a, b):
            del r["id"], r["target"]
        assert a == b
        assert type(a["time"]) is type(b["time"]) and a["time"].tzinfo == b["time"].tzinfo
    assert rows["prepared"]["params"] == PARAMS
    assert rows["prepared-null"]["params"] == [] and rows["prepared-null"]["tenant"] is None
    assert _as_utc(rows["prepared"]["time"]) == AWARE


def test_fill_defaults_gives_the_column_defaults(engine: Engine) -> None:
    row = fill_defaults(EVENT, _event("prepared", params={"k": 1}))
    assert "id" not in row  # the generated key is left to the database
    assert row["result"] == "ok" and row["error"] is None and row["tenant"] is None
    assert abs(_as_utc(row["time"]) - datetime.now(UTC)) < timedelta(minutes=1)
    assert fill_defaults(EVENT, {**_event("x"), "result": "refused"})["result"] == "refused"  # given wins
    before = datetime.now(UTC) - timedelta(seconds=5)
    with engine.begin() as conn:
        insert_all(EVENT).run(conn, row)
        conn.execute(EVENT.insert().values(**_event("sqlalchemy", params={"k": 1})))  # SQLAlchemy's defaults
    with engine.connect() as conn:
        rows = {r.target: r for r in conn.execute(select(EVENT))}
    ours, theirs = rows["prepared"], rows["sqlalchemy"]
    assert (ours.params, ours.result, ours.error, ours.tenant) == (theirs.params, theirs.result, theirs.error,
                                                                   theirs.tenant) == ({"k": 1}, "ok", None, None)
    assert ours.id is not None and _as_utc(ours.time) >= before and type(ours.time) is type(theirs.time)
    assert abs(_as_utc(ours.time) - _as_utc(theirs.time)) < timedelta(minutes=1)


def test_rows_are_named_tuples_with_decoded_values(engine: Engine) -> None:
    with engine.begin() as conn:
        for i in range(3):
            conn.execute(EVENT.insert().values(**_event(f"t{i}", time=AWARE + timedelta(hours=i),
                                                        params={**PARAMS, "i": i})))
    stmt = (select(EVENT.c.id, EVENT.c.params, EVENT.c.time.label("at"), func.upper(EVENT.c.target).label("big"))
            .where(EVENT.c.actor == bindparam("actor"), EVENT.c.target != "t1").order_by(EVENT.c.id))
    p = Prepared(stmt)
    with engine.connect() as conn:
        reference = conn.execute(stmt, {"actor": "tester"}).all()
        for _ in range(2):  # the second call uses the cached result processors
            rows = p.rows(conn, {"actor": "tester"})
            assert [r._fields for r in rows] == [("id", "params", "at", "big")] * 2
            assert [tuple(r) for r in rows] == [tuple(r) for r in reference]
            assert [r.params for r in rows] == [{**PARAMS, "i": 0}, {**PARAMS, "i": 2}]
            assert all(isinstance(r.params, dict) and isinstance(r.at, datetime) for r in rows)
            assert [_as_utc(r.at) for r in rows] == [AWARE, AWARE + timedelta(hours=2)]
            assert [r.big for r in rows] == ["T0", "T2"]
        assert p.rows(conn, {"actor": "nobody"}) == []
        # the raw cursor gives the driver's values, one plain tuple per row
        raw = p.run(conn, {"actor": "tester"}).fetchall()
        assert [r[0] for r in raw] == [r.id for r in rows]


# -- errors -----------------------------------------------------------------------------------------------

_INSERT_TENANT = insert_all(TENANT)


def test_unique_violation_is_sqlalchemys_integrity_error(engine: Engine) -> None:
    with engine.begin() as conn:
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "acme"}))
    with engine.connect() as conn:
        trans = conn.begin()
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "other"}))
        with pytest.raises(IntegrityError) as err:
            _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "acme"}))
        assert isinstance(err.value.orig, engine.dialect.loaded_dbapi.IntegrityError)
        assert "tenant" in str(err.value) and "INSERT INTO tenant" in str(err.value.statement)
        trans.rollback()
    with engine.connect() as conn:
        assert _tenants(conn) == ["acme"]  # "other" was rolled back with the transaction
    # the statement still works afterwards (nothing cached broke)
    with engine.begin() as conn:
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "beta"}))
    with engine.connect() as conn:
        assert _tenants(conn) == ["acme", "beta"]


def test_statements_sent_together_write_in_order_and_raise_a_violation_as_sqlalchemys(engine: Engine) -> None:
    with engine.begin() as conn:
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "acme"}))
    with engine.begin() as conn, sent_together(conn):
        for name in ("b1", "b2", "b3"):
            _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": name}))
    with engine.connect() as conn:
        assert _tenants(conn) == ["acme", "b1", "b2", "b3"]
    with engine.connect() as conn:
        trans = conn.begin()
        with pytest.raises(IntegrityError) as err, sent_together(conn):
            _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "c1"}))
            _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "acme"}))  # taken: raised by the end
        assert isinstance(err.value.orig, engine.dialect.loaded_dbapi.IntegrityError)
        assert "tenant" in str(err.value.orig).lower()
        trans.rollback()
    with engine.begin() as conn:  # nothing of the failed block stayed, and the connection works on
        assert _tenants(conn) == ["acme", "b1", "b2", "b3"]
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "c1"}))
    with engine.connect() as conn:
        assert _tenants(conn) == ["acme", "b1", "b2", "b3", "c1"]


def test_a_violation_seen_inside_the_block_is_raised_once_and_the_pipeline_ends_quietly(
        engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    # On PostgreSQL a statement's error can come back while later ones are still being sent (here forced by
    # reading a result inside the block): it is the error raised, and the driver logs nothing about the
    # pipeline it aborted.
    names = Prepared(select(TENANT.c.name).order_by(TENANT.c.name))
    with engine.begin() as conn:
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "acme"}))
    with caplog.at_level(logging.WARNING), engine.connect() as conn:
        trans = conn.begin()
        with pytest.raises(IntegrityError) as err, sent_together(conn):
            _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "acme"}))  # taken
            names.rows_sent(conn)()
        assert isinstance(err.value.orig, engine.dialect.loaded_dbapi.IntegrityError)
        trans.rollback()
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    with engine.begin() as conn:  # the connection works on
        assert names.rows(conn) == [("acme",)]


def test_a_result_left_unread_holds_no_snapshot_on_sqlite(sqlite_url: str) -> None:
    """A statement whose rows nobody read to the end (a claim's charge when a later write of it failed, or a
    multi-row read asked for one row) is finished when it runs: the connection's next write starts though
    another connection wrote meanwhile. An unfinished SQLite statement keeps its connection in a read of the
    old snapshot, and BEGIN IMMEDIATE then fails at once with 'database is locked'."""
    e = make_engine(sqlite_url)
    migrate.upgrade(e)
    with e.begin() as conn:
        for name in ("acme", "beta", "gamma"):
            _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": name}))
    names = Prepared(select(TENANT.c.name).order_by(TENANT.c.name))
    renamed = Prepared(update(TENANT).where(TENANT.c.name != "acme").values(vms_limit=10)
                       .returning(TENANT.c.name))
    try:
        with e.connect() as conn:
            with conn.begin():
                changed = renamed.run(conn)  # two rows, none read before the commit
            first = names.run(conn)
            assert first.fetchone() == ("acme",)  # one of three rows read
            with e.begin() as other:  # another connection writes
                other.execute(update(TENANT).values(vms_limit=20))
            with conn.begin():  # BEGIN IMMEDIATE on the connection holding both results
                _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "delta"}))
            assert first.fetchall() == [("beta",), ("gamma",)]
            assert changed.rowcount == 2 and sorted(changed.fetchall()) == [("beta",), ("gamma",)]
        with e.connect() as conn:
            assert _tenants(conn) == ["acme", "beta", "delta", "gamma"]
    finally:
        e.dispose()


def test_run_many(engine: Engine) -> None:
    names = ["t-a", "t-b", "t-c"]
    with engine.begin() as conn:
        _INSERT_TENANT.run_many(conn, [fill_defaults(TENANT, {"name": n, "vms_limit": i}) for i, n in enumerate(names)])
    with engine.connect() as conn:
        got = conn.execute(select(TENANT.c.name, TENANT.c.vms_limit, TENANT.c.has_scoped_limits)
                           .order_by(TENANT.c.name)).all()
    assert [tuple(r) for r in got] == [("t-a", 0, False), ("t-b", 1, False), ("t-c", 2, False)]
    with engine.connect() as conn:
        trans = conn.begin()
        with pytest.raises(IntegrityError):
            _INSERT_TENANT.run_many(conn, [fill_defaults(TENANT, {"name": n}) for n in ("t-d", "t-a")])
        trans.rollback()
    with engine.connect() as conn:
        assert _tenants(conn) == names
    with engine.begin() as conn:
        _INSERT_TENANT.run_many(conn, [])  # nothing to insert is fine
    with engine.connect() as conn:
        assert _tenants(conn) == names


def test_run_many_of_a_row_insert_writes_rows_a_statement_as_row_by_row(engine: Engine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ins = insert_all(EVENT)
    monkeypatch.setattr(ins, "per_statement", 3)
    statements: list[str] = []
    run = Prepared.run

    def counted(self: Prepared, conn: Connection, params: Any = None) -> Any:
        if str(self.statement).startswith("INSERT"):  # not the BEGIN of the store's engine
            statements.append(str(self.statement))
        return run(self, conn, params)

    monkeypatch.setattr(Prepared, "run", counted)
    rows = [fill_defaults(EVENT, _event(f"many-{i}", time=AWARE, params={**PARAMS, "i": i},
                                        tenant=None if i % 2 else "acme")) for i in range(8)]
    with engine.begin() as conn:
        ins.run_many(conn, rows)
        for r in rows:
            ins.run(conn, {**r, "target": r["target"].replace("many", "one")})
    assert len(statements) == 3 + 8  # rows 0-2, 3-5 and 6-7 in three statements, then one a row
    assert "r2_time" in statements[0] and "r3_time" not in statements[0] and "r1_time" in statements[2]
    with engine.connect() as conn:
        got = {r.target: r._asdict() for r in conn.execute(select(EVENT).order_by(EVENT.c.id))}
    assert list(got)[:8] == [f"many-{i}" for i in range(8)]  # in the rows' order
    for i in range(8):
        a, b = got[f"many-{i}"], got[f"one-{i}"]
        assert {k: v for k, v in a.items() if k not in ("id", "target")} == \
            {k: v for k, v in b.items() if k not in ("id", "target")}
        assert a["params"]["i"] == i and _as_utc(a["time"]) == AWARE


def test_missing_parameter_is_a_type_error_naming_it(engine: Engine) -> None:
    p = Prepared(select(TENANT.c.id).where(TENANT.c.name == bindparam("name"),
                                           TENANT.c.vms_used >= bindparam("least", type_=Integer)))
    with engine.connect() as conn:
        with pytest.raises(TypeError, match="'least'"):
            p.run(conn, {"name": "acme"})
        with pytest.raises(TypeError, match="'name'"):
            p.rows(conn, {"least": 0})
        assert p.rows(conn, {"name": "acme", "least": 0}) == []  # and with both it runs
    row = fill_defaults(EVENT, _event("t", params={"k": 1}))
    del row["params"]  # a column with a bind processor (JSON)
    with engine.begin() as conn:
        with pytest.raises(TypeError, match="'params'"):
            insert_all(EVENT).run(conn, row)
        with pytest.raises(TypeError, match="'params'"):
            insert_all(EVENT).run_many(conn, [row])
        with pytest.raises(TypeError, match="'r1_params'"):  # the second row of a multi-row INSERT
            insert_all(EVENT).run_many(conn, [fill_defaults(EVENT, _event("t", params={})), row])
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(EVENT)).scalar() == 0


def test_expanding_in_is_refused_at_compile(engine: Engine) -> None:
    expanding = Prepared(select(TENANT.c.id).where(TENANT.c.name.in_(bindparam("names", expanding=True))))
    literal_list = Prepared(select(TENANT.c.id).where(TENANT.c.name.in_(["a", "b"])))
    with engine.connect() as conn:
        for p in (expanding, literal_list):
            for _ in range(2):  # not cached as if it had compiled
                with pytest.raises(ValueError, match="expanding"):
                    p.run(conn, {"names": ["a", "b"]})


# -- transactions -----------------------------------------------------------------------------------------


def test_statements_run_in_the_callers_transaction(engine: Engine) -> None:
    # `other` reads only through a Prepared: on SQLite a SQLAlchemy statement would begin (BEGIN IMMEDIATE) and
    # wait for the writer's lock.
    count = Prepared(select(func.count()).select_from(TENANT).where(TENANT.c.name == bindparam("name")))
    with engine.connect() as conn, engine.connect() as other:
        trans = conn.begin()
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "rolled"}))
        assert count.run(conn, {"name": "rolled"}).fetchone()[0] == 1  # seen by its own transaction...
        assert _tenants(conn, "rolled") == ["rolled"]  # ... by SQLAlchemy's statements on it too
        assert count.run(other, {"name": "rolled"}).fetchone()[0] == 0  # ... not by another connection
        trans.rollback()
        assert count.run(conn, {"name": "rolled"}).fetchone()[0] == 0
        assert count.run(other, {"name": "rolled"}).fetchone()[0] == 0

        trans = conn.begin()
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "kept"}))
        _INSERT_TENANT.run(conn, fill_defaults(TENANT, {"name": "kept-too"}))
        assert count.run(other, {"name": "kept"}).fetchone()[0] == 0
        trans.commit()
        assert count.run(other, {"name": "kept"}).fetchone()[0] == 1
    with engine.connect() as conn:
        assert _tenants(conn) == ["kept", "kept-too"]


def test_constants_the_statement_holds_are_in_its_sql(engine: Engine) -> None:
    _add_hosts(engine)
    with engine.begin() as conn:  # a constant with a quote and a percent sign is rendered escaped
        conn.execute(HOST.insert().values(name="h5", uri="simulated:///o'dd%s", driver="simulated", labels={},
                                          state="active", vcpus=1, memory_mib=1))
    stmt = (select(HOST.c.name).where(HOST.c.uri == "simulated:///o'dd%s",
                                      HOST.c.vcpus >= bindparam("n", type_=Integer)).limit(1))
    p = Prepared(stmt)
    with engine.connect() as conn:
        compiled = p._for(conn.dialect)
        assert "LIMIT 1" in compiled.sql and "o''dd" in compiled.sql
        assert set(compiled.order or compiled.names) >= {"n"} and "param_1" not in (compiled.order or ())
        assert [r[0] for r in p.run(conn, {"n": 1}).fetchall()] == ["h5"]
        assert [r[0] for r in p.run(conn, {"n": 2}).fetchall()] == []


def test_generic_plans_last_to_the_end_of_the_transaction(engine: Engine) -> None:
    count = Prepared(select(func.count()).select_from(TENANT))
    with engine.begin() as conn:
        with sent_together(conn):
            generic_plans(conn)
            counted = count.run(conn)
        assert counted.fetchone()[0] == 0
        if engine.dialect.name == "postgresql":
            assert _plan_cache_mode(conn) == "force_generic_plan"
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            assert _plan_cache_mode(conn) == "auto"  # LOCAL: the next transaction plans as the server's setting


def _plan_cache_mode(conn: Connection) -> str:
    return str(conn.connection.driver_connection.execute("SHOW plan_cache_mode").fetchone()[0])


@pytest.mark.postgres
def test_a_generic_plan_on_postgresql_reads_a_summary_page_from_its_partial_index(pg_url: str) -> None:
    """`n_fit > 0` in the SQL, not `n_fit > $1`: a plan made once for every call can use `host_fit`'s partial
    indexes (with a parameter there it read every host of the pool)."""
    from sqlalchemy import text

    from vgpu_ctl.core.placement import CandidateOrder
    from vgpu_ctl.store.candidate_pages import _summary_query
    e = make_engine(pg_url)
    migrate.upgrade(e)
    try:
        with e.connect() as conn:
            sql = _summary_query(CandidateOrder.FULLEST_FIRST, False, True)._for(conn.dialect).sql
            assert "host_fit.n_fit > 0 " in sql and "host.state = 'active'" in sql
            names: list[str] = []
            numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${_number(names, m.group(1))}", sql)
            params = {"pool_id": "1", "c_model": "'A100-80GB'", "c_mode": "'vgpu-equal'", "c_bit": "1", "ndev": "1",
                      "req_vcpus": "1", "req_memory_mib": "1", "page_limit": "6", "page_offset": "0"}
            conn.execute(text("SET plan_cache_mode = force_generic_plan"))
            conn.execute(text("SET enable_seqscan = off"))  # the test's store is empty: plan as for a fleet
            driver = conn.connection.driver_connection

            def plan(name: str, query: str, values: list[str]) -> str:
                driver.execute(f"PREPARE {name} AS {query}")
                return "\n".join(r[0] for r in driver.execute(f"EXPLAIN EXECUTE {name}({', '.join(values)})"))

            values = [params[n] for n in names]
            assert "host_fit_by_width" in plan("page", numbered, values)
            # the same statement with the constant as a parameter cannot use the partial index
            as_parameter = numbered.replace("host_fit.n_fit > 0 ", f"host_fit.n_fit > ${len(names) + 1} ")
            assert "host_fit_by_width" not in plan("bound", as_parameter, [*values, "0"])
    finally:
        e.dispose()


def _number(names: list[str], name: str) -> int:
    """The 1-based position of `name` among `names` (added when new)."""
    if name not in names:
        names.append(name)
    return names.index(name) + 1
