"""Store URLs: which ones vgpu-ctl accepts, and the errors that name a wrong one or a store that can't be
opened (the URL with its password masked, the accepted forms), for the CLI and the Python API alike."""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from vgpu_ctl.errors import InvalidInput

StoreUrl: TypeAlias = URL  # a parsed store URL (an engine's `url`)

URL_FORMS = ("sqlite:///RELATIVE/PATH.db, sqlite:////ABSOLUTE/PATH.db, "
             "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE")


def shown(url: str) -> str:
    """The URL with any password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def check_store_url(url: str | None) -> str | None:
    """`url` if it is a store URL vgpu-ctl can use (None: the default store); InvalidInput naming it and the
    accepted forms if not, or saying which extra to install when its driver is missing."""
    if url is None:
        return None
    try:
        parsed = make_url(url)
    except ArgumentError:
        parsed = None
    if parsed is None or parsed.get_backend_name() not in ("sqlite", "postgresql"):
        hint = f" (for a SQLite file: sqlite:///{url})" if "://" not in url else ""
        raise InvalidInput(f"--db {shown(url)!r} is not a store URL vgpu-ctl can use{hint}; accepted: {URL_FORMS}",
                           reasons=[{"field": "db", "value": shown(url), "accepted": URL_FORMS}])
    if parsed.get_backend_name() == "sqlite" and not parsed.database:
        raise InvalidInput(f"--db {url!r} names no SQLite file; accepted: {URL_FORMS}",
                           reasons=[{"field": "db", "value": url, "accepted": URL_FORMS}])
    if parsed.get_backend_name() == "postgresql":
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise InvalidInput(f"--db {shown(url)}: a PostgreSQL store needs the psycopg driver, which is not "
                               "installed; install it with: pip install 'vgpu-ctl[postgres]'",
                               reasons=[{"field": "db", "value": shown(url), "missing": "psycopg"}]) from None
    return url


def store_error(url: str, exc: BaseException) -> InvalidInput:
    """The error for a store that can't be opened: the URL (password masked), the driver's first line."""
    orig = getattr(exc, "orig", None) or exc
    detail = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    return InvalidInput(f"--db {shown(url)}: can't open the store: {detail} (accepted forms: {URL_FORMS})",
                        reasons=[{"field": "db", "value": shown(url), "error": detail}])


def missing_sqlite_file(url: str) -> bool:
    """True when `url` names a SQLite file store whose file does not exist (a URL that does not parse is
    not one: the store's own check names what is wrong with it)."""
    try:
        file = sqlite_file(url)
    except ArgumentError:
        return False
    return file is not None and not Path(file).exists()


def sqlite_file(url: str | StoreUrl) -> str | None:
    """The database file of a SQLite store at `url`; None for any other store (and SQLite in memory)."""
    parsed = make_url(url) if isinstance(url, str) else url
    if parsed.get_backend_name() == "sqlite" and parsed.database and parsed.database != ":memory:":
        return str(parsed.database)
    return None


def database_name(url: str | StoreUrl) -> str | None:
    """The database part of `url` (a SQLite file's path, PostgreSQL's database name)."""
    parsed = make_url(url) if isinstance(url, str) else url
    return parsed.database


def masked(url: str | StoreUrl) -> str:
    """`url` with its password masked."""
    parsed = make_url(url) if isinstance(url, str) else url
    return parsed.render_as_string(hide_password=True)
