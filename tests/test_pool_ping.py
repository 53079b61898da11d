"""A PostgreSQL store pings a pooled connection before handing it out only when it sat idle for longer than
PING_AFTER_IDLE_S: a busy store saves a round trip per checkout, and a connection the server dropped while it
was idle is still replaced before anyone uses it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import pg_admin
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from vgpu_ctl.store import engine as store_engine

pytestmark = pytest.mark.postgres


@pytest.fixture
def pinged(pg_url: str) -> Iterator[tuple[Any, list[int]]]:
    """An engine on the test schema and the backend pids of the connections it pinged."""
    eng = store_engine.make_engine(pg_url)
    pings: list[int] = []
    ping = eng.dialect.do_ping

    def counted(dbapi: Any) -> bool:
        pings.append(dbapi.info.backend_pid)
        return bool(ping(dbapi))

    eng.dialect.do_ping = counted  # type: ignore[method-assign]
    try:
        yield eng, pings
    finally:
        eng.dispose()


def _backend(eng: Any) -> int:
    with eng.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _kill(pid: int) -> None:
    """Terminate a backend from outside the pool, as a server restart or an idle timeout would."""
    with pg_admin() as admin:
        assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone() == (True,)


def test_a_connection_given_back_a_moment_ago_is_not_pinged(pinged: tuple[Any, list[int]],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    eng, pings = pinged
    monkeypatch.setattr(store_engine, "PING_AFTER_IDLE_S", 3600.0)
    first = _backend(eng)
    assert [_backend(eng) for _ in range(5)] == [first] * 5
    assert pings == []
    monkeypatch.setattr(store_engine, "PING_AFTER_IDLE_S", 0.0)
    assert _backend(eng) == first
    assert pings == [first]


def test_a_connection_dropped_while_idle_is_replaced_before_use(pinged: tuple[Any, list[int]],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    eng, pings = pinged
    first = _backend(eng)
    _kill(first)
    monkeypatch.setattr(store_engine, "PING_AFTER_IDLE_S", 0.0)
    assert _backend(eng) != first  # pinged, found dead, replaced: the caller saw no error
    assert pings == [first]


def test_a_connection_dropped_within_the_window_fails_once_then_the_pool_recovers(
        pinged: tuple[Any, list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    eng, pings = pinged
    monkeypatch.setattr(store_engine, "PING_AFTER_IDLE_S", 3600.0)
    first = _backend(eng)
    _kill(first)
    with pytest.raises(OperationalError), eng.connect() as conn:  # as a statement in flight at a restart
        conn.execute(text("SELECT 1"))
    assert _backend(eng) != first  # the disconnect discarded it
    assert pings == []
