"""Core statements compiled once per dialect and run on the connection's DB-API cursor.

The claim path runs about ten statements per request; through `Connection.execute` each pays for SQLAlchemy's
cache key, execution context and result wrapping, several times the database's own work. A `Prepared` keeps
the statement's SQL, its parameter order and its types' bind processors, so a call is one DB-API `execute`
inside the caller's transaction. Results are the driver's plain tuples.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from operator import itemgetter
from typing import Any

from sqlalchemy import Table, bindparam, insert
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import visitors
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.expression import Executable


@dataclass(frozen=True, slots=True)
class _Compiled:
    sql: str
    order: tuple[str, ...] | None  # parameter names in placeholder order (positional drivers), else None
    names: frozenset[str]  # every parameter the statement binds
    literals: Mapping[str, Any]  # values the statement itself binds (e.g. `state == 'active'`)
    processors: Mapping[str, Callable[[Any], Any]]  # type conversions (JSON, DATETIME on SQLite, ...)
    pick: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None  # positional drivers: the values in order
    convert: tuple[tuple[int, Callable[[Any], Any]], ...]  # positional drivers: (place, conversion) to apply


class Prepared:
    """A statement compiled once per dialect; `run` binds parameters by name and executes it on the DB-API
    connection underneath `conn` (in its transaction)."""

    __slots__ = ("_compiled", "_results", "_row", "statement")

    def __init__(self, statement: Executable) -> None:
        self.statement = statement
        self._compiled: dict[tuple[str, str], _Compiled] = {}
        self._results: dict[tuple[str, str], tuple[Callable[[Any], Any] | None, ...]] = {}
        names = list(getattr(statement, "selected_columns", {}).keys())
        self._row: Callable[[Iterable[Any]], Any] | None = \
            namedtuple("Row", names, rename=True)._make if names else None  # type: ignore[attr-defined]

    def _for(self, dialect: Dialect) -> _Compiled:
        key = (dialect.name, dialect.driver)
        found = self._compiled.get(key)
        if found is None:
            found = self._compiled[key] = _compile(self.statement, dialect)
        return found

    def run(self, conn: Connection, params: Mapping[str, Any] | None = None) -> Any:
        """Execute with `params` (by bind name); the DB-API cursor (fetchone/fetchall/rowcount)."""
        c = self._for(conn.dialect)
        return _execute(conn, c, _bind(c, params or {}))

    def rows(self, conn: Connection, params: Mapping[str, Any] | None = None) -> list[Any]:
        """The result rows, as named tuples (attributes named as the selected columns), values converted
        as SQLAlchemy would (JSON decoded, ...)."""
        return self.rows_sent(conn, params)()

    def rows_sent(self, conn: Connection, params: Mapping[str, Any] | None = None) -> Callable[[], list[Any]]:
        """`rows` sent (inside `sent_together`, with others); its rows are read by the callable it returns,
        after the block."""
        assert self._row is not None, "rows() of a statement that selects nothing"
        c = self._for(conn.dialect)
        cur = _execute(conn, c, _bind(c, params or {}))
        return lambda: self._converted(conn, cur)

    def _converted(self, conn: Connection, cur: Any) -> list[Any]:
        make = self._row
        assert make is not None
        raw = cur.fetchall()
        key = (conn.dialect.name, conn.dialect.driver)
        results = self._results.get(key)
        if results is None:  # the driver's column type codes are known once it has run
            columns = list(getattr(self.statement, "selected_columns", ()))
            results = self._results[key] = tuple(
                col.type.dialect_impl(conn.dialect).result_processor(conn.dialect, desc[1])
                for col, desc in zip(columns, cur.description, strict=True))
        if not any(results):
            return [make(t) for t in raw]
        return [make(v if f is None else f(v) for f, v in zip(results, t, strict=True)) for t in raw]

    def run_many(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Execute once per parameter set (an INSERT of several rows)."""
        c = self._for(conn.dialect)
        cur = _driver(conn).cursor()
        try:
            cur.executemany(c.sql, [_bind(c, r) for r in rows])
        except conn.dialect.loaded_dbapi.Error as exc:
            raise _wrapped(conn, c, exc) from exc
        finally:
            cur.close()


def end_read(conn: Connection) -> None:
    """End the transaction that prepared reads outside any SQLAlchemy transaction opened at the driver
    (PostgreSQL's drivers open one on the first statement; SQLite's reads ran in autocommit)."""
    _driver(conn).rollback()


@contextmanager
def sent_together(conn: Connection) -> Iterator[None]:
    """Statements run inside (ones whose results nobody reads, such as INSERTs) sent to the database together
    and answered together at the end: one round trip on PostgreSQL (psycopg's pipeline mode) instead of one per
    statement; on SQLite, which has no round trips, as they are. A driver error, raised at the end on
    PostgreSQL, is raised as SQLAlchemy's, as a statement run alone raises it."""
    driver = _driver(conn)
    if not hasattr(driver, "pipeline"):
        yield
        return
    error = conn.dialect.loaded_dbapi.Error
    failed: Exception | None = None
    try:
        with driver.pipeline():
            try:
                yield
            except (error, DBAPIError) as exc:  # a statement's error, seen early: the pipeline still ends cleanly
                failed = exc
    except error as exc:  # the first statement that failed, or (after one failed early) the pipeline aborted
        failed = failed or exc
    if isinstance(failed, DBAPIError):
        raise failed
    if failed is not None:
        raise DBAPIError.instance("(statements sent together)", None, failed, error,
                                  dialect=conn.dialect) from failed


def generic_plans(conn: Connection) -> None:
    """On PostgreSQL, plan each prepared statement of the rest of this transaction once for every call (a generic
    plan) instead of again at each call with its values; inside `sent_together` it costs no round trip of its
    own. For statements whose SQL holds its constants, so that the generic plan uses the partial index (see
    `_with_constants_inline`): PostgreSQL kept planning a candidate page again on every call (0.34 ms of each
    0.5 ms page at 10k GPUs) although its generic plan is as fast. SQLite: nothing."""
    if conn.dialect.name == "postgresql":
        _driver(conn).execute("SET LOCAL plan_cache_mode = force_generic_plan")


MAX_PARAMETERS = 999  # per statement: SQLite's limit before 3.32, far under PostgreSQL's 65,535


class RowInsert:
    """An INSERT of every column of a table but a generated key, each bound by its column name (`fill_defaults`
    completes rows): `run` one row, `run_many` many rows in as few multi-row statements as the parameter limit
    allows (each row count compiled once), so a batch of rows is one statement, not one per row."""

    __slots__ = ("_by_count", "_columns", "_one", "_table", "per_statement")

    def __init__(self, table: Table) -> None:
        self._table = table
        self._columns = [c for c in table.columns if c is not table.autoincrement_column]
        self._one = Prepared(insert(table).values({c.name: bindparam(c.name, type_=c.type) for c in self._columns}))
        self._by_count: dict[int, tuple[Prepared, tuple[tuple[str, ...], ...]]] = {}
        self.per_statement = max(1, MAX_PARAMETERS // len(self._columns))

    def run(self, conn: Connection, row: Mapping[str, Any]) -> Any:
        """Insert one row; the DB-API cursor."""
        return self._one.run(conn, row)

    def run_many(self, conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert `rows`, up to `per_statement` of them a statement."""
        for at in range(0, len(rows), self.per_statement):
            part = rows[at:at + self.per_statement]
            if len(part) == 1:
                self._one.run(conn, part[0])
                continue
            stmt, names = self._for(len(part))
            params: dict[str, Any] = {}
            for row, keys in zip(part, names, strict=True):
                for c, key in zip(self._columns, keys, strict=True):
                    if c.name in row:  # a missing column: Prepared names it
                        params[key] = row[c.name]
            stmt.run(conn, params)

    def _for(self, count: int) -> tuple[Prepared, tuple[tuple[str, ...], ...]]:
        found = self._by_count.get(count)
        if found is None:
            names = tuple(tuple(f"r{i}_{c.name}" for c in self._columns) for i in range(count))
            values = [{c.name: bindparam(key, type_=c.type) for c, key in zip(self._columns, keys, strict=True)}
                      for keys in names]
            found = self._by_count[count] = (Prepared(insert(self._table).values(values)), names)
        return found


def insert_all(table: Table) -> RowInsert:
    """A `RowInsert` of `table`."""
    return RowInsert(table)


def fill_defaults(table: Table, row: Mapping[str, Any]) -> dict[str, Any]:
    """`row` with each missing column (but a generated key) set to its Python-side default, or None."""
    out = dict(row)
    for name, value, call in _defaults(table):
        if name not in out:
            out[name] = value(None) if call else value
    return out


@lru_cache(maxsize=64)
def _defaults(table: Table) -> tuple[tuple[str, Any, bool], ...]:
    """Per column but a generated key: its default (a value, or a callable taking a context) and which."""
    out = []
    for c in table.columns:
        if c is table.autoincrement_column:
            continue
        d: Any = c.default
        out.append((c.name, None if d is None else d.arg, d is not None and d.is_callable))
    return tuple(out)


def _driver(conn: Connection) -> Any:
    return conn.connection.driver_connection


def _execute(conn: Connection, c: _Compiled, params: Any) -> Any:
    try:
        cur = _driver(conn).execute(c.sql, params)
        return _Finished(cur) if conn.dialect.name == "sqlite" else cur
    except conn.dialect.loaded_dbapi.Error as exc:
        raise _wrapped(conn, c, exc) from exc


class _Finished:
    """A SQLite statement's whole result, read when it runs (as a cursor offers it: fetchone, fetchall,
    iteration, rowcount, description). A statement left unfinished keeps its connection in a read transaction,
    even after COMMIT or ROLLBACK and back in the pool: that connection's next BEGIN IMMEDIATE then fails at
    once with 'database is locked' (SQLite does not wait for a connection that holds an old snapshot), as
    happened to a claim after the batch before it failed with the charge's answer unread."""

    __slots__ = ("_at", "_rows", "description", "rowcount")

    def __init__(self, cur: Any) -> None:
        try:
            self._rows: list[Any] = cur.fetchall()
            self.rowcount: int = cur.rowcount  # after the rows: an UPDATE ... RETURNING counts them as read
            self.description: Any = cur.description
        finally:
            cur.close()
        self._at = 0

    def fetchone(self) -> Any:
        """The next row, or None."""
        if self._at >= len(self._rows):
            return None
        self._at += 1
        return self._rows[self._at - 1]

    def fetchall(self) -> list[Any]:
        """The rows not read yet."""
        rows, self._at = self._rows[self._at:], len(self._rows)
        return rows

    def __iter__(self) -> Iterator[Any]:
        while (row := self.fetchone()) is not None:
            yield row


def _wrapped(conn: Connection, c: _Compiled, exc: Exception) -> Exception:
    """The driver's error as SQLAlchemy raises it (IntegrityError, OperationalError, ...), so callers handle
    prepared and ordinary statements alike."""
    return DBAPIError.instance(c.sql, None, exc, conn.dialect.loaded_dbapi.Error, dialect=conn.dialect)


def _bind(c: _Compiled, params: Mapping[str, Any]) -> Any:
    values = {**c.literals, **params} if c.literals else params
    procs = c.processors
    try:
        if c.order is None:
            missing = next((n for n in c.names if n not in values), None)
            if missing is not None:
                raise KeyError(missing)
            return {k: procs[k](v) if k in procs else v for k, v in values.items()} if procs else values
        assert c.pick is not None
        picked = c.pick(values)
        if not c.convert:
            return picked
        out = list(picked)
        for i, f in c.convert:
            out[i] = f(out[i])
        return tuple(out)
    except KeyError as exc:
        raise TypeError(f"missing parameter {exc.args[0]!r} for: {c.sql}") from None


def _with_constants_inline(statement: Executable, dialect: Dialect) -> Executable:
    """The statement with each constant it was built with (an anonymous bind holding an int or a string, as in
    `n_fit > 0` or `LIMIT 1`) marked to be rendered in the SQL itself. A generic plan of a prepared statement
    (PostgreSQL's one plan for every call, see `generic_plans`) can use a partial index (`WHERE n_fit > 0`) or the
    statistics of a value only when the constant is in the SQL: with `n_fit > $5` a summary page read every host
    of the pool (13 ms at 10k GPUs) or was planned again on every call (2 ms)."""
    def inline(element: Any) -> Any:
        if (isinstance(element, BindParameter) and element.unique and not element.required
                and not element.callable and type(element.value) in (int, str)
                and element.type.dialect_impl(dialect).literal_processor(dialect) is not None):
            return element.render_literal_execute()
        return None
    out: Executable = visitors.replacement_traverse(statement, {}, inline)  # type: ignore[call-overload]
    return out


def _compile(statement: Executable, dialect: Dialect) -> _Compiled:
    compiled: Any = _with_constants_inline(statement, dialect).compile(dialect=dialect)  # type: ignore[attr-defined]
    sql: str = compiled.string
    inlined = set()
    for name, bp in compiled.binds.items():
        token = f"__[POSTCOMPILE_{name}]"
        if bp.literal_execute and token in sql:
            sql = sql.replace(token, bp.type.dialect_impl(dialect).literal_processor(dialect)(bp.value))
            inlined.add(name)
    if "POSTCOMPILE" in sql:
        raise ValueError(f"statement needs per-call rendering (expanding or literal-execute parameters): {sql}")
    binds = {name: bp for name, bp in compiled.binds.items() if name not in inlined}
    literals = {name: bp.value for name, bp in binds.items() if not bp.required and bp.value is not None}
    processors = {}
    for name, bp in binds.items():
        proc = bp.type.dialect_impl(dialect).bind_processor(dialect)
        if proc is not None:
            processors[name] = proc
    order = tuple(n for n in compiled.positiontup if n not in inlined) if dialect.positional else None
    return _Compiled(sql, order, frozenset(binds), literals, processors, _picker(order),
                     tuple((i, processors[n]) for i, n in enumerate(order or ()) if n in processors))


def _picker(order: tuple[str, ...] | None) -> Callable[[Mapping[str, Any]], tuple[Any, ...]] | None:
    """The values of the parameters in placeholder order, in one C call (itemgetter), for positional drivers."""
    if order is None:
        return None
    if len(order) == 1:
        name = order[0]
        return lambda values: (values[name],)
    return itemgetter(*order) if order else lambda values: ()
