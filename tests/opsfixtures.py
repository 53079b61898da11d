"""Helpers of the operations tests: a demo store with two tenants, cloning it fast, and running the CLI."""

from __future__ import annotations

import json
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from vgpu_ctl import Controller

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "inventory" / "demo.yaml"
TENANTS = ("acme", "globex")


@dataclass
class Store:
    """A store on disk: its URL, state folder and the tenants' tokens."""

    state: Path
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def db(self) -> Path:
        """The SQLite file."""
        return self.state / "s.db"

    @property
    def url(self) -> str:
        """The store URL."""
        return f"sqlite:///{self.db}"

    def ctl(self, token: str | None = None, actor: str | None = None) -> Controller:
        """A controller on this store (admin, or the tenant of `token`)."""
        return Controller(self.url, token=token, actor=actor, state_path=self.state)

    def as_tenant(self, name: str) -> Controller:
        """A controller acting as tenant `name`."""
        return self.ctl(token=self.tokens[name])

    def sql(self, statement: str, **params: Any) -> list[Any]:
        """Run raw SQL on the store (foreign keys off, to allow corrupting it); the rows, if any."""
        conn = sqlite3.connect(self.db, timeout=30, isolation_level=None)
        try:
            conn.execute("PRAGMA foreign_keys=OFF")
            return conn.execute(statement, params).fetchall()
        finally:
            conn.close()


def build_store(state: Path, vms: bool = True) -> Store:
    """The demo fleet with tenants acme and globex (tokens issued); with `vms`, each gets a VM."""
    state.mkdir(parents=True, exist_ok=True)
    store = Store(state)
    ctl = store.ctl()
    try:
        ctl.apply_inventory(DEMO)
        for t in TENANTS:
            ctl.create_tenant(t)
            store.tokens[t] = ctl.issue_token(t)
        if vms:
            ctl.request_vm("acme", "a1", [("A100D-10C", 1)], vcpus=4, memory_mib=8192, pool="inference")
            ctl.request_vm("acme", "a2", [("3g.40gb", 1)], vcpus=2, memory_mib=4096, pool="inference")
            ctl.request_vm("globex", "g1", [("L40S-12C", 1)], vcpus=2, memory_mib=4096)
    finally:
        ctl.close()
    return store


def clone(template: Store, state: Path) -> Store:
    """A copy of a store (database and simulated hosts) under `state`."""
    shutil.copytree(template.state, state)
    return Store(state, dict(template.tokens))


def template_store(factory: pytest.TempPathFactory, name: str = "template", vms: bool = True) -> Store:
    """Build a store once per session (cached on the factory) to clone in each test."""
    cache: dict[str, Store] = getattr(factory, "_ops_templates", {})
    setattr(factory, "_ops_templates", cache)  # noqa: B010
    key = f"{name}-{vms}"
    if key not in cache:
        cache[key] = build_store(factory.mktemp(name) / "state", vms=vms)
    return cache[key]


def cli(store: Store, *args: str, token: str | None = None, env_token: str | None = None,
        input: str | None = None) -> Result:
    """Run `vgpuctl ARGS` in-process against the store (as a tenant with `token` / $VGPU_CTL_TOKEN)."""
    from vgpu_ctl.cli.main import app
    env: dict[str, str | None] = {"VGPU_CTL_DATABASE_URL": store.url, "VGPU_CTL_STATE_DIR": str(store.state),
                                  "VGPU_CTL_TOKEN": env_token, "FORCE_COLOR": None, "TTY_COMPATIBLE": None}
    argv = (["--token", token] if token else []) + list(args)
    return CliRunner().invoke(app, argv, env=env, input=input, catch_exceptions=False)


def cli_json(store: Store, *args: str, token: str | None = None) -> Any:
    """Run a `--json` command and parse its stdout."""
    res = cli(store, *args, "--json", token=token)
    return json.loads(res.stdout)


def events_of(store: Store) -> list[dict[str, Any]]:
    """Every audit event (admin view)."""
    ctl = store.ctl()
    try:
        return ctl.events(limit=100000)
    finally:
        ctl.close()


def snapshot(store: Store) -> dict[str, list[Any]]:
    """The rows of every table except the audit trail, to check that nothing changed."""
    return {t: store.sql(f"SELECT * FROM {t} ORDER BY 1") for t in
            ("pool", "host", "gpu", "tenant", "scoped_quota", "vm", "device")}
